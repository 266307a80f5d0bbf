"""CRAIG coresets (Mirzasoleiman, Bilmes, Leskovec, ICML 2020): a weighted subset whose weighted gradient
approximates the full gradient, for training on fewer examples per epoch.

For per-example gradient proxies ``g_i`` (for deep nets, the gradient of the loss with respect to the last layer's
input or logits), CRAIG picks ``S`` by greedy maximisation of the facility-location function

    F(S) = Σ_i max_{j in S} (d_max - ||g_i - g_j||)

and weighs each ``j in S`` by the number of examples whose closest selected example is ``j`` (``γ_j``). The guarantee
(their Theorem 1 and Eq. 6-9): for every parameter value,

    || Σ_i ∇f_i - Σ_{j in S} γ_j ∇f_j ||  <=  Σ_i min_{j in S} ||∇f_i - ∇f_j||  =  n d_max - F(S)  =: ε,

and since ``F`` is monotone submodular the greedy ``S`` gets ``F(S) >= (1 - 1/e) F(S*)`` of the best subset of its
size, so it (nearly) minimises that bound. Selection is per class when labels are given (the subset keeps each
class's share), with the lazy greedy (a heap of stale gains) over a similarity matrix computed per class.

``craig_select(proxies, size, labels)`` returns indices and weights; ``craig_subset(dataset, ...)`` a
``datasets.Dataset`` of the selected rows with a ``weight`` column; ``lm_gradient_proxies(model, loader)`` the
per-example mean over the answer tokens of ``softmax(logits) - onehot(label)`` (the gradient of the loss with respect
to the logits, CRAIG's last-layer proxy).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from hf_dtrain.errors import SettingsError

from .partition import speed_quotas


def _lazy_greedy(sim: torch.Tensor, k: int) -> list[int]:
    """Greedy facility location on a similarity matrix (n x n, >= 0), with lazy evaluation of the gains."""
    n = sim.shape[0]
    best = torch.zeros(n, dtype=sim.dtype)
    heap = [(-float(g), j) for j, g in enumerate(sim.sum(0).tolist())]
    heapq.heapify(heap)
    chosen: list[int] = []
    while len(chosen) < k and heap:
        _neg_gain, j = heapq.heappop(heap)
        gain = float((sim[:, j] - best).clamp(min=0).sum())
        if not heap or gain >= -heap[0][0] - 1e-12:  # still the best after refreshing its gain: take it
            chosen.append(j)
            best = torch.maximum(best, sim[:, j])
        else:
            heapq.heappush(heap, (-gain, j))
    return chosen


def craig_select(
    proxies: torch.Tensor, size: int | float, labels: Sequence[int] | None = None
) -> tuple[list[int], torch.Tensor]:
    """CRAIG subset of ``size`` examples (an int, or a fraction in (0, 1]) from per-example gradient proxies
    ``proxies`` (n x d); returns (indices, weights) with weights summing to n (the examples each one stands for).
    With labels, each class gets its share of ``size`` and at least one example."""
    if not torch.is_tensor(proxies) or proxies.dim() != 2:
        raise TypeError(
            f"proxies must be an (n, d) tensor of per-example gradient proxies, got "
            f"{type(proxies).__name__}{tuple(getattr(proxies, 'shape', ()))}."
        )
    n = proxies.shape[0]
    k = round(size * n) if isinstance(size, float) else int(size)
    if isinstance(size, float) and not 0 < size <= 1:
        raise SettingsError(f"size as a fraction must be in (0, 1], got {size!r}.")
    if not 1 <= k <= n:
        raise SettingsError(f"size must select between 1 and {n} examples, got {size!r} ({k} examples).")
    labels = list(labels) if labels is not None else [0] * n
    if len(labels) != n:
        raise SettingsError(f"labels has {len(labels)} entries for {n} proxies; give one label per example.")
    classes = sorted(set(labels))
    members = {c: [i for i, y in enumerate(labels) if y == c] for c in classes}
    budgets = speed_quotas(k, [len(members[c]) for c in classes])  # each class keeps its share of the subset
    indices: list[int] = []
    weights: list[float] = []
    for c, budget in zip(classes, budgets):
        idx = members[c]
        if budget == 0:
            budget = 1  # every class is represented (its examples would otherwise have no stand-in)
        x = proxies[idx].double()
        dist = torch.cdist(x, x)
        sim = dist.max() - dist
        chosen = _lazy_greedy(sim, min(budget, len(idx)))
        nearest = dist[:, chosen].argmin(1)  # each example's closest selected example
        counts = torch.bincount(nearest, minlength=len(chosen))
        indices.extend(idx[j] for j in chosen)
        weights.extend(float(c_) for c_ in counts)
    return indices, torch.tensor(weights, dtype=torch.float64)


def craig_subset(
    dataset,
    proxies: torch.Tensor,
    size: int | float,
    labels: Sequence[int] | None = None,
    weight_column: str = "weight",
):
    """The CRAIG subset of a ``datasets.Dataset`` as a ``datasets.Dataset`` with a ``weight`` column (use it to
    weigh each example's loss; the weights sum to ``len(dataset)``)."""
    if len(dataset) != proxies.shape[0]:
        raise SettingsError(
            f"proxies has {proxies.shape[0]} rows for a dataset of {len(dataset)}; compute one per row."
        )
    indices, weights = craig_select(proxies, size, labels)
    subset = dataset.select(indices)
    return subset.add_column(weight_column, weights.tolist())


@torch.no_grad()
def lm_gradient_proxies(model, loader) -> torch.Tensor:
    """Per-example gradient proxies of a causal LM: the mean over an example's label tokens (labels != -100, shifted
    as the model's loss does) of ``softmax(logits) - onehot(label)``. ``loader`` yields batches with ``labels``."""
    was_training = model.training
    model.eval()
    rows = []
    try:
        for batch in loader:
            labels = batch["labels"]
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            logits = model(**inputs).logits[:, :-1].float()
            target = labels[:, 1:]
            mask = (target != -100).unsqueeze(-1).float()
            grad = torch.softmax(logits, -1)
            grad.scatter_add_(-1, target.clamp(min=0).unsqueeze(-1), -torch.ones_like(grad[..., :1]))
            rows.append((grad * mask).sum(1) / mask.sum(1).clamp(min=1))
    finally:
        model.train(was_training)
    return torch.cat(rows)
