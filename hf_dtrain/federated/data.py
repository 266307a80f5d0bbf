"""Client data: non-IID splits of a dataset over the clients."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_dtrain.errors import SettingsError


def dirichlet_split(labels: Sequence, num_clients: int, alpha: float | None, seed: int = 0) -> list[list[int]]:
    """Indices per client. ``alpha`` None: an IID split (a seeded permutation dealt round robin). Otherwise each
    label's samples (labels may be any hashable: a class, a source, a task) are dealt to the clients in proportions
    drawn from Dirichlet(alpha, ..., alpha) (the usual non-IID benchmark split; small alpha, few labels per client).
    Every client gets at least one sample: an empty client takes one from the largest."""
    n = len(labels)
    if num_clients > n:
        raise SettingsError(
            f"{num_clients} clients for {n} samples: every client needs at least one; lower the clients."
        )
    gen = torch.Generator().manual_seed(seed)
    clients: list[list[int]] = [[] for _ in range(num_clients)]
    if alpha is None:
        for pos, i in enumerate(torch.randperm(n, generator=gen).tolist()):
            clients[pos % num_clients].append(i)
        return clients
    groups: dict = {}
    for i, label in enumerate(labels):
        groups.setdefault(label, []).append(i)
    dirichlet = torch.distributions.Dirichlet(torch.full((num_clients,), float(alpha)))
    for label in sorted(groups, key=str):
        idx = groups[label]
        idx = [idx[j] for j in torch.randperm(len(idx), generator=gen).tolist()]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
            p = dirichlet.sample()
        cuts = (torch.cumsum(p, 0) * len(idx)).round().long().tolist()
        start = 0
        for c, end in enumerate(cuts):
            clients[c].extend(idx[start:end])
            start = end
    for c in range(num_clients):  # no empty client
        if not clients[c]:
            donor = max(range(num_clients), key=lambda j: len(clients[j]))
            clients[c].append(clients[donor].pop())
    return clients
