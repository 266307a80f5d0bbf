"""ACP-SGD as a DDP communication hook: alternate compressed PowerSGD, one all-reduce per bucket per step.

Zhang, Shi, Li (ICDCS 2023, arXiv 2306.08881; code lzhangbv/acpsgd). PowerSGD (torch's ``powerSGD_hook``) needs two
dependent all-reduces per step (P, then Q after a local product). ACP-SGD sends only one factor per step and
alternates:

* even steps: ``Q <- orth(Q_avg of the last odd step)``, ``P = (M + E) Q``, all-reduce P, ``grad = P_avg Q^T``;
* odd steps: ``P <- orth(P_avg of the last even step)``, ``Q = (M + E)^T P``, all-reduce Q, ``grad = P Q_avg^T``;
* error feedback: ``E <- (M + E) - (local P) Q^T`` (even) or ``(M + E) - P (local Q)^T`` (odd), kept per rank.

The factor that is not sent is the orthogonalised all-reduced factor of the previous step, identical on every rank,
so the averaged gradient is identical everywhere and replicas stay in sync. ``M`` is a gradient viewed as
``(shape[0], numel / shape[0])``; 1-D tensors and tensors where compression does not win go uncompressed in the same
flat buffer: one all-reduce per bucket per step.
"""


from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..distributed import WireStats, world_size_of


@dataclass
class _BucketState:
    shapes: list[tuple[int, int]]  # (n, m) of each compressed tensor, in bucket order
    compressed: list[bool]  # per tensor of the bucket
    errors: list[torch.Tensor]  # E per compressed tensor
    p: list[torch.Tensor]  # last P (all-reduced average, or seeded random before the first odd step)
    q: list[torch.Tensor]  # last Q


@dataclass
class ACPSGDState:
    """State of :func:`acp_sgd_hook` (one per DDP model).

    * ``process_group``: the group to reduce over (None: the default group).
    * ``rank``: r, the rank of the P (n x r) and Q (m x r) factors.
    * ``start_iter``: steps of plain all-reduce first (at least 2: DDP rebuilds its buckets after step 1, and the
      state is keyed by bucket index), as torch's ``PowerSGDState.start_powerSGD_iter``.
    * ``min_compression_rate``: a tensor is compressed only if ``n m >= min_compression_rate * (n + m) r``.
    * ``use_error_feedback``: keep the local compression error E and add it to the next gradient.
    * ``seed``: seed of the initial Q (identical on every rank).
    * ``iter``: optimizer steps seen (advanced on the bucket DDP reports last); ``stats``: bytes per step.
    """

    process_group: Optional[dist.ProcessGroup] = None
    rank: int = 4
    start_iter: int = 10
    min_compression_rate: float = 2.0
    use_error_feedback: bool = True
    seed: int = 0
    iter: int = 0
    stats: WireStats = field(default_factory=WireStats)
    buckets: dict[int, _BucketState] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"ACPSGDState.rank must be a positive integer, got {self.rank!r}.")
        if not isinstance(self.start_iter, int) or self.start_iter < 2:
            raise ValueError(f"ACPSGDState.start_iter must be an integer >= 2 (DDP rebuilds its buckets after the "
                             f"first step), got {self.start_iter!r}.")
        if self.min_compression_rate < 0:
            raise ValueError(f"ACPSGDState.min_compression_rate must be >= 0, got {self.min_compression_rate!r}.")

    def compresses(self, shape: torch.Size) -> bool:
        if len(shape) < 2:
            return False
        n, m = shape[0], shape.numel() // shape[0]
        return n * m >= self.min_compression_rate * (n + m) * self.rank

    def check_rank(self, named_shapes) -> None:
        """``ValueError`` if ``rank`` exceeds a dimension of a tensor it would compress (``named_shapes``: iterable of
        ``(name, shape)``)."""
        for name, shape in named_shapes:
            if len(shape) < 2:
                continue
            n, m = shape[0], int(torch.Size(shape).numel()) // shape[0]
            if self.rank > min(n, m) and self.min_compression_rate * (n + m) * self.rank <= n * m:
                raise ValueError(f"ACP-SGD rank={self.rank} exceeds min{(n, m)} of {name!r} (its gradient as a "
                                 f"matrix); use rank <= {min(n, m)}.")

    @property
    def even(self) -> bool:
        """Whether this step sends P (even) or Q (odd), counted from the first compressed step."""
        return (self.iter - self.start_iter) % 2 == 0


def _orth(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(x).Q


def _bucket_state(state: ACPSGDState, bucket: dist.GradBucket) -> _BucketState:
    idx = bucket.index()
    bs = state.buckets.get(idx)
    grads = bucket.gradients()
    if bs is None or len(bs.compressed) != len(grads):
        gen = torch.Generator().manual_seed(state.seed + 1_000_003 * idx)
        compressed = [state.compresses(g.shape) for g in grads]
        shapes = [(g.shape[0], g.numel() // g.shape[0]) for g, c in zip(grads, compressed) if c]
        device, dtype = bucket.buffer().device, bucket.buffer().dtype
        bs = _BucketState(
            shapes=shapes, compressed=compressed,
            errors=[torch.zeros(n, m, device=device, dtype=dtype) for n, m in shapes],
            p=[torch.zeros(n, state.rank, device=device, dtype=dtype) for n, _ in shapes],
            q=[torch.randn(m, state.rank, generator=gen).to(device=device, dtype=dtype) for _, m in shapes],
        )
        state.buckets[idx] = bs
    return bs


# (no `from __future__ import annotations` here: DDP checks these annotations against the real classes)
def acp_sgd_hook(state: ACPSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: ``model.register_comm_hook(ACPSGDState(rank=4), acp_sgd_hook)``."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = world_size_of(group)
    buffer = bucket.buffer()
    last = bucket.is_last()

    if state.iter < state.start_iter:  # warm-up: plain averaged all-reduce
        state.stats.add(buffer)
        fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()

        def plain(f):
            out = f.value()[0].div_(world)
            if last:
                state.iter += 1
                state.stats.end_step()
            return out

        return fut.then(plain)

    bs = _bucket_state(state, bucket)
    even = state.even
    grads = bucket.gradients()
    pieces, sent, orth = [], [], []
    k = 0
    for g, comp in zip(grads, bs.compressed):
        if not comp:
            pieces.append(g.reshape(-1))
            continue
        n, m = bs.shapes[k]
        mat = g.reshape(n, m)
        if state.use_error_feedback:
            mat = mat + bs.errors[k]
        if even:
            q = _orth(bs.q[k])
            p = mat @ q
            if state.use_error_feedback:
                bs.errors[k] = mat - p @ q.T
            pieces.append(p.reshape(-1))
            sent.append(p)
            orth.append(q)
        else:
            p = _orth(bs.p[k])
            q = mat.T @ p
            if state.use_error_feedback:
                bs.errors[k] = mat - p @ q.T
            pieces.append(q.reshape(-1))
            sent.append(q)
            orth.append(p)
        k += 1
    flat = torch.cat(pieces) if pieces else buffer.new_zeros(0)
    state.stats.add(flat)
    fut = dist.all_reduce(flat, group=group, async_op=True).get_future()

    def decompress(f):
        reduced = f.value()[0].div_(world)
        offset, k = 0, 0
        for g, comp in zip(grads, bs.compressed):
            if not comp:
                g.copy_(reduced[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
                continue
            n, m = bs.shapes[k]
            size = (n if even else m) * state.rank
            factor = reduced[offset:offset + size].view(-1, state.rank)
            offset += size
            if even:
                bs.p[k] = factor.clone()
                g.copy_((factor @ orth[k].T).view_as(g))
            else:
                bs.q[k] = factor.clone()
                g.copy_((orth[k] @ factor.T).view_as(g))
            k += 1
        if last:
            state.iter += 1
            state.stats.end_step()
        return buffer

    return fut.then(decompress)


def acp_sgd_step_bytes(state: ACPSGDState, named_shapes, element_size: int = 4, even: bool = True) -> int:
    """The payload bytes of one compressed ACP-SGD step for these gradient shapes (the formula the tests check)."""
    total = 0
    for _, shape in named_shapes:
        shape = torch.Size(shape)
        if state.compresses(shape):
            n, m = shape[0], shape.numel() // shape[0]
            total += (n if even else m) * state.rank
        else:
            total += shape.numel()
    return total * element_size
