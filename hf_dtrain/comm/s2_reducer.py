"""S2 Reducer as a DDP communication hook: a bitmap of nonzero positions, then a count sketch of the values.

Ge et al., arXiv 2110.02140 (no public code; the recipe is the standard count sketch the paper builds on). For a bucket
of ``n`` gradient values of which few are nonzero (embedding rows of the tokens in the batch, for example):

1. ``bitmap = (g != 0)``, packed 8 positions per byte and all-reduced with bitwise OR: the union ``U`` of nonzero
   positions over ranks (``n / 8`` bytes);
2. ``d`` rows of ``w = ceil(width_factor * |U|)`` counters; position ``i`` adds ``s_j(i) g_i`` to row ``j`` at
   ``h_j(i)`` (hashes and signs drawn from a seed shared by all ranks); the sketch is all-reduced with SUM
   (``d w`` values: the sketch is linear, so the sum of sketches is the sketch of the sum);
3. each position of ``U`` is decoded as the median over rows of ``s_j(i) S[j, h_j(i)]``, divided by the world size;
   positions outside ``U`` are zero on every rank and stay zero.

DDP's buckets mix tensors (the embedding with its neighbours' dense gradients), so the choice is made **per tensor
of the bucket**, on the union (the same on every rank): a tensor whose ``d * c * |U ∩ tensor|`` counters are fewer
than its values is sketched, the others travel by one dense all-reduce of their concatenation, concurrently.

Exactness: a row's estimate of position ``i`` is exact when no other position of ``U`` shares its counter in that row;
the median is exact when more than half of the rows are exact for ``i``. With ``w = c |U|`` a given row collides for
``i`` with probability about ``1 - exp(-1/c)``. Otherwise the error of the estimate is bounded by the colliding values
in the rows that make the median. When no tensor of the bucket is sparse enough, the bucket falls
back to the dense all-reduce (counted, with the bitmap it already sent: 1/32 more than dense for fp32).

Error feedback (``error_feedback=True``, hf_dtrain's addition; the paper has none): each rank keeps, per bucket, what
its own sketch loses, ``e = x - decode(S_local)`` on the union (``x`` = its gradient plus the previous ``e``), and adds
it to its next gradient. With one sketch row the decode is linear, so the ranks' residuals sum to exactly what the
all-reduced sketch lost and nothing is lost for good (tested); with the median of several rows it is each rank's own
compression error. The hashes change every step, so a collision does not repeat. A dense-fallback step sends the
residual along (exact) and clears it.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hf_dtrain.errors import SettingsError

from ..distributed.collectives import pack_bits, unpack_bits, world_size_of
from ..distributed.counters import WireStats


@dataclass
class S2ReducerState:
    """State of :func:`s2_reducer_hook`.

    * ``rows``: d, count-sketch rows (odd, so the median is one of the estimates);
    * ``width_factor``: c, counters per row per nonzero position of the union;
    * ``seed``: seed of the hashes and signs (the same on every rank);
    * ``stats``: bytes per step; ``sketched`` / ``dense`` count buckets that took each path; ``exact_positions`` and
      ``union_positions`` count, over all sketched buckets, positions decoded exactly (majority of collision-free
      rows) and positions in the union.
    """

    process_group: dist.ProcessGroup | None = None
    rows: int = 3
    width_factor: float = 4.0
    seed: int = 0
    iter: int = 0
    stats: WireStats = field(default_factory=WireStats)
    sketched: int = 0
    dense: int = 0
    exact_positions: int = 0
    union_positions: int = 0
    error_feedback: bool = False
    residuals: dict = field(default_factory=dict)  # bucket index -> what this rank's sketch lost (error feedback)
    last_decode: dict = field(default_factory=dict)  # bucket index -> (union positions, exactly decoded mask)

    @classmethod
    def from_config(cls, config, **state) -> "S2ReducerState":
        """The state a :class:`~hf_dtrain.comm.CommHookConfig` asks for; ``state``: the other fields (the group, or
        an ``error_feedback`` the caller decides)."""
        fields = dict(
            rows=config.sketch_rows,
            width_factor=config.sketch_width_factor,
            seed=config.seed,
            error_feedback=config.use_error_feedback,
        )
        return cls(**{**fields, **state})

    def state_dict(self) -> dict:
        """The step count (the hashes and signs are drawn per step from ``seed`` and it) and the residuals."""
        return {"iter": self.iter, "residuals": {str(k): v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.iter = int(state["iter"])
        self.residuals = {int(k): v.clone() for k, v in state.get("residuals", {}).items()}

    def __post_init__(self):
        if not isinstance(self.rows, int) or self.rows < 1 or self.rows % 2 == 0:
            raise SettingsError(f"S2ReducerState.rows must be an odd positive integer, got {self.rows!r}.")
        if self.width_factor < 1:
            raise SettingsError(f"S2ReducerState.width_factor must be >= 1, got {self.width_factor!r}.")


def _hashes(state: S2ReducerState, n: int, width: int, bucket_index: int, device):
    gen = torch.Generator().manual_seed(state.seed * 1_000_003 + bucket_index * 7919 + state.iter * 104_729 + width)
    h = torch.randint(0, width, (state.rows, n), generator=gen)
    s = torch.randint(0, 2, (state.rows, n), generator=gen) * 2 - 1
    return h.to(device), s.to(device)


# (no `from __future__ import annotations` here: DDP checks these annotations against the real classes)
def s2_reducer_hook(state: S2ReducerState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: ``model.register_comm_hook(S2ReducerState(), s2_reducer_hook)``."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = world_size_of(group)
    buffer = bucket.buffer()
    n = buffer.numel()
    last = bucket.is_last()
    residual = state.residuals.get(bucket.index()) if state.error_feedback else None
    if residual is not None and residual.numel() == n:
        buffer.add_(residual)  # what this rank's sketch lost last time (error feedback)

    bitmap = pack_bits(buffer != 0)
    state.stats.add(bitmap)
    dist.all_reduce(bitmap, op=dist.ReduceOp.BOR, group=group)  # small and synchronous: the sketch size depends on it
    nonzero = unpack_bits(bitmap, n)
    # per tensor of the bucket (DDP mixes an embedding with its neighbours' dense gradients): sketch a tensor only if
    # its d * c counters per union position come to fewer values than the tensor; the rest of the bucket goes dense
    sizes = [p.numel() for p in bucket.parameters()]
    if sum(sizes) != n:
        sizes = [n]
    sparse = torch.zeros(n, dtype=torch.bool, device=buffer.device)
    counts = torch.stack([seg.sum() for seg in nonzero.split(sizes)]).tolist()  # one host sync for all tensors
    offset = 0
    for size, k in zip(sizes, counts):
        if state.rows * math.ceil(state.width_factor * k) < size:
            sparse[offset : offset + size] = True
        offset += size
    union = (nonzero & sparse).nonzero().flatten()
    width = max(1, math.ceil(state.width_factor * union.numel()))

    def finish(out):
        if last:
            state.iter += 1
            state.stats.end_step()
        return out

    if not bool(sparse.any()):  # nothing worth sketching: the dense all-reduce (the bitmap is paid)
        state.dense += 1
        state.residuals.pop(bucket.index(), None)  # sent exactly, with the residual in it
        state.stats.add(buffer)
        fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
        return fut.then(lambda f: finish(f.value()[0].div_(world)))

    dense_part = buffer[~sparse].contiguous()
    dense_work = None
    if dense_part.numel():
        state.stats.add(dense_part)
        dense_work = dist.all_reduce(dense_part, group=group, async_op=True)
    state.sketched += 1
    h, s = _hashes(state, union.numel(), width, bucket.index(), buffer.device)
    values = buffer[union]
    sketch = torch.zeros(state.rows, width, dtype=buffer.dtype, device=buffer.device)
    sketch.scatter_add_(1, h, s.to(buffer.dtype) * values.unsqueeze(0))
    state.stats.add(sketch)
    # collision-free (row, position) pairs: the counter holds one position of the union only
    occupancy = torch.zeros(state.rows, width, dtype=torch.long, device=buffer.device)
    occupancy.scatter_add_(1, h, torch.ones_like(h))
    clean = occupancy.gather(1, h) == 1
    exact = clean.sum(0) > state.rows // 2
    state.exact_positions += int(exact.sum())
    state.last_decode[bucket.index()] = (union, exact)
    state.union_positions += union.numel()
    if state.error_feedback:  # this rank's own loss: its values minus what its sketch alone decodes to
        local = (s.to(buffer.dtype) * sketch.gather(1, h)).median(dim=0).values
        new_residual = torch.zeros_like(buffer)
        new_residual[union] = values - local
        state.residuals[bucket.index()] = new_residual
    fut = dist.all_reduce(sketch, group=group, async_op=True).get_future()

    def decode(f):
        summed = f.value()[0]
        estimates = s.to(summed.dtype) * summed.gather(1, h)
        if dense_work is not None:
            dense_work.wait()
        buffer.zero_()
        buffer[~sparse] = dense_part / world
        buffer[union] = estimates.median(dim=0).values / world
        return finish(buffer)

    return fut.then(decode)
