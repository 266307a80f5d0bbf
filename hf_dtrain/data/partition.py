"""Heterogeneity-aware data partitioning (after He & Dube, RCD-SGD, arXiv 2211.00839): each worker gets a shard sized
to its speed, with every class split in the same proportions, and, when features are given, the samples of a class
dealt out by submodular (facility-location) selection so that every shard covers the class's feature space.

* **Sizes.** Worker ``i`` gets ``N s_i / Σ s`` samples (largest remainder).
* **Class balance.** Class ``c`` (``n_c`` samples) gives worker ``i`` ``floor`` or ``ceil`` of ``n_c s_i / Σ s``:
  every per-class count is within 1 sample of its exact proportion, and the rounding is chosen so the shard sizes
  still match the speeds (the worker furthest below its size gets the next rounding unit).
* **Coverage.** Within a class, workers take turns (the one furthest from its class quota first) picking the sample
  with the largest marginal gain of ``F_i(S) = Σ_{v in class} max_{s in S} sim(v, s)``, ``sim = d_max - ||f_v - f_s||``
  (greedy facility location, each worker's shard a good summary of the whole class). Exact greedy up to 512 samples
  per class, stochastic greedy (64 random candidates per pick) above; without features, a seeded random deal.

Use :class:`HeterogeneityAwareSampler` as the sampler of each rank's ``DataLoader``. The loader is already this
rank's share: with Accelerate, prepare the model and optimizer but not this loader (``prepare`` would shard it a
second time), and move batches to ``accelerator.device`` yourself. Equal steps per epoch need per-rank batch sizes
proportional to the shards (:meth:`HeterogeneityAwareSampler.batch_size_for`); and since DDP averages the ranks'
mean gradients with equal weight, multiply each rank's loss by :meth:`HeterogeneityAwareSampler.loss_scale` so every
sample weighs the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.utils.data import Sampler

from hf_dtrain.distributed.quotas import speed_quotas
from hf_dtrain.errors import SettingsError

EXACT_GREEDY_MAX = 512  # classes up to this size: exact greedy; above: stochastic greedy
STOCHASTIC_CANDIDATES = 64


def _class_counts(class_sizes: list[int], speeds: Sequence[float], quotas: list[int]) -> list[list[int]]:
    """counts[c][i]: floor or ceil of n_c s_i / Σ s, with class sums n_c and worker sums ``quotas`` exactly.

    The fractional matrix lies in the transportation polytope with those sums, so such a rounding exists; it is found
    as an integral max flow: class c has n_c - Σ floors units to hand out, worker i needs quota_i - Σ floors, and a
    class can give one unit to a worker whose share of it is fractional."""
    import networkx as nx

    total = float(sum(speeds))
    k = len(speeds)
    exact = [[n_c * s / total for s in speeds] for n_c in class_sizes]
    counts = [[math.floor(x) for x in row] for row in exact]
    flow = nx.DiGraph()
    for c, n_c in enumerate(class_sizes):
        flow.add_edge("src", ("c", c), capacity=n_c - sum(counts[c]))
        for i in range(k):
            if exact[c][i] - counts[c][i] > 1e-9:
                flow.add_edge(("c", c), ("w", i), capacity=1)
    for i in range(k):
        flow.add_edge(("w", i), "sink", capacity=quotas[i] - sum(row[i] for row in counts))
    _value, paths = nx.maximum_flow(flow, "src", "sink")
    for c in range(len(class_sizes)):
        for node, units in paths.get(("c", c), {}).items():
            counts[c][node[1]] += units
    if any(sum(counts[c]) != n_c for c, n_c in enumerate(class_sizes)):  # numerically degenerate shares
        for c, n_c in enumerate(class_sizes):  # hand out what is left to the workers furthest below their quota
            while sum(counts[c]) < n_c:
                i = max(range(k), key=lambda w: (quotas[w] - sum(row[w] for row in counts), -w))
                counts[c][i] += 1
    return counts


def _facility_deal(features: torch.Tensor, counts: list[int], generator: torch.Generator) -> list[list[int]]:
    """Deal the rows of ``features`` (one class) to workers with ``counts[i]`` each by turn-taking greedy facility
    location; returns positions (into ``features``) per worker. Similarities are computed per pick for the candidate
    columns only (no n x n matrix), so memory is O(workers x n)."""
    n = features.shape[0]
    feats = features.float()
    d_max = 2 * float((feats - feats.mean(0)).norm(dim=1).max()) + 1e-12  # >= every pairwise distance

    def sim(cols: torch.Tensor) -> torch.Tensor:
        return d_max - torch.cdist(feats, feats[cols])

    best = torch.zeros(len(counts), n)  # per worker: each element's similarity to its closest pick so far
    free = torch.ones(n, dtype=torch.bool)
    picks: list[list[int]] = [[] for _ in counts]
    for _ in range(n):
        # the worker furthest (relatively) from its quota picks next
        open_workers = [i for i, q in enumerate(counts) if len(picks[i]) < q]
        i = min(open_workers, key=lambda w: (len(picks[w]) / counts[w], w))
        candidates = free.nonzero().squeeze(1)
        if n > EXACT_GREEDY_MAX and candidates.numel() > STOCHASTIC_CANDIDATES:
            candidates = candidates[torch.randperm(candidates.numel(), generator=generator)[:STOCHASTIC_CANDIDATES]]
        columns = sim(candidates)
        gains = (columns - best[i].unsqueeze(1)).clamp_(min=0).sum(0)
        k = int(gains.argmax())
        e = int(candidates[k])
        picks[i].append(e)
        free[e] = False
        best[i] = torch.maximum(best[i], columns[:, k])
    return picks


def partition_indices(
    labels: Sequence[int] | None,
    speeds: Sequence[float],
    n: int | None = None,
    features: torch.Tensor | None = None,
    seed: int = 0,
) -> list[list[int]]:
    """The shards (dataset indices per worker); the same on every rank for the same arguments."""
    if labels is None and n is None:
        raise SettingsError("partition_indices needs labels= (one per sample) or n= (the number of samples).")
    labels = list(labels) if labels is not None else [0] * int(n)
    n = len(labels)
    speeds = [float(s) for s in speeds]
    if len(speeds) < 1 or any(not (s > 0 and math.isfinite(s)) for s in speeds):
        raise SettingsError(f"speeds must be positive finite numbers, one per worker, got {speeds!r}.")
    if len(speeds) > n:
        raise SettingsError(
            f"A partition of {n} samples over {len(speeds)} workers would leave workers empty: use at "
            "most as many workers as samples (or more data)."
        )
    if features is not None and features.shape[0] != n:
        raise SettingsError(f"features has {features.shape[0]} rows for {n} samples; give one feature row per sample.")
    quotas = speed_quotas(n, speeds)
    if min(quotas) == 0:
        slow = [i for i, q in enumerate(quotas) if q == 0]
        raise SettingsError(
            f"Workers {slow} get no sample ({n} samples for speeds {speeds}); give more data or drop "
            "the slowest workers."
        )
    classes = sorted(set(labels))
    members = {c: [i for i, y in enumerate(labels) if y == c] for c in classes}
    counts = _class_counts([len(members[c]) for c in classes], speeds, quotas)
    gen = torch.Generator().manual_seed(seed)
    shards: list[list[int]] = [[] for _ in speeds]
    for c, row in zip(classes, counts):
        idx = members[c]
        if features is not None and len(idx) > 1:
            picks = _facility_deal(features[idx], row, gen)
            for w, positions in enumerate(picks):
                shards[w].extend(idx[p] for p in positions)
        else:
            order = torch.randperm(len(idx), generator=gen).tolist()
            start = 0
            for w, k in enumerate(row):
                shards[w].extend(idx[p] for p in order[start : start + k])
                start += k
    return [sorted(s) for s in shards]


class HeterogeneityAwareSampler(Sampler[int]):
    """This rank's speed-proportional, class-balanced shard.

    ``HeterogeneityAwareSampler(labels, speeds=[1, 1, 3, 1], rank=rank, features=None, shuffle=True, seed=0)``;
    ``labels=None`` with ``num_samples=len(dataset)`` treats the data as one class. ``speeds`` are relative
    throughputs (samples per second measured on each worker, or any proportional numbers).
    """

    def __init__(
        self,
        labels: Sequence[int] | None,
        speeds: Sequence[float],
        rank: int | None = None,
        features: torch.Tensor | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_samples: int | None = None,
        global_batch_size: int | None = None,
    ):
        if rank is None:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_initialized() else 0
        if not 0 <= rank < len(speeds):
            raise SettingsError(f"rank {rank} has no speed: speeds has {len(speeds)} entries (one per worker).")
        self.shards = partition_indices(labels, speeds, num_samples, features, seed)
        self.rank, self.speeds, self.shuffle, self.seed, self.epoch = rank, list(speeds), shuffle, seed, 0
        self.indices = self.shards[rank]
        # with a global batch size: this rank's batch size, and a length padded (by wrapping around the shard, as
        # DistributedSampler pads) so that every rank has the same number of batches per epoch: rounding the batch
        # sizes would otherwise leave one rank a batch short, and its peers waiting in a collective
        self.global_batch_size = global_batch_size
        self.steps_per_epoch: int | None = None
        if global_batch_size is not None:
            if not isinstance(global_batch_size, int) or global_batch_size < len(speeds):
                raise SettingsError(
                    f"global_batch_size must be an integer >= the number of workers ({len(speeds)}), "
                    f"got {global_batch_size!r}."
                )
            sizes = [max(1, b) for b in speed_quotas(global_batch_size, self.shard_sizes)]
            self.steps_per_epoch = max(-(-len(s) // b) for s, b in zip(self.shards, sizes))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = list(self.indices)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = [self.indices[i] for i in torch.randperm(len(self.indices), generator=g).tolist()]
        n = len(self)
        return iter((order * (-(-n // len(order))))[:n])

    def __len__(self) -> int:
        if self.steps_per_epoch is None:
            return len(self.indices)
        return self.steps_per_epoch * self.batch_size_for(self.global_batch_size)

    @property
    def shard_sizes(self) -> list[int]:
        return [len(s) for s in self.shards]

    def batch_size_for(self, global_batch_size: int) -> int:
        """This rank's batch size so that every rank takes the same number of steps per epoch (a share of
        ``global_batch_size`` proportional to its shard, at least 1)."""
        return max(1, speed_quotas(global_batch_size, self.shard_sizes)[self.rank])

    def loss_scale(self, global_batch_size: int) -> float:
        """Factor for this rank's mean loss so that DDP's equal-weight average of the ranks' gradients weighs every
        sample the same: ``b_i * world / B``."""
        b = speed_quotas(global_batch_size, self.shard_sizes)
        return b[self.rank] * len(b) / sum(b)
