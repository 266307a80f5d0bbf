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

import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hf_dtrain.errors import SettingsError

from ..distributed.collectives import world_size_of
from ..distributed.counters import WireStats


@dataclass
class _TensorState:
    shape: tuple[int, int]  # (n, m) of the gradient as a matrix
    error: torch.Tensor  # E
    p: torch.Tensor  # last P (all-reduced average, or zeros before the first odd step)
    q: torch.Tensor  # last Q (seeded random before the first even step)


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

    process_group: dist.ProcessGroup | None = None
    rank: int = 4
    start_iter: int = 10
    min_compression_rate: float = 2.0
    use_error_feedback: bool = True
    seed: int = 0
    iter: int = 0
    stats: WireStats = field(default_factory=WireStats)
    # per compressed tensor, keyed by its parameter's name (``register`` fills ``param_names``), so the state does not
    # depend on DDP's bucket layout: a restarted run starts with DDP's initial buckets, not the rebuilt ones
    tensors: dict[str, _TensorState] = field(default_factory=dict)
    param_names: dict[int, str] = field(default_factory=dict)  # id(parameter) -> name

    @classmethod
    def from_config(cls, config, **state) -> "ACPSGDState":
        """The state a :class:`~hf_dtrain.comm.CommHookConfig` asks for; ``state``: the other fields (the group)."""
        return cls(
            rank=config.rank,
            start_iter=config.start_iter,
            min_compression_rate=config.min_compression_rate,
            use_error_feedback=config.use_error_feedback,
            seed=config.seed,
            **state,
        )

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise SettingsError(f"ACPSGDState.rank must be a positive integer, got {self.rank!r}.")
        if not isinstance(self.start_iter, int) or self.start_iter < 2:
            raise SettingsError(
                f"ACPSGDState.start_iter must be an integer >= 2 (DDP rebuilds its buckets after the "
                f"first step), got {self.start_iter!r}."
            )
        if self.min_compression_rate < 0:
            raise SettingsError(f"ACPSGDState.min_compression_rate must be >= 0, got {self.min_compression_rate!r}.")

    def state_dict(self) -> dict:
        """The step count and every tensor's factors and error feedback, as copies (the hook changes them in the
        next backward): what a snapshot needs for the run to go on exactly."""
        return {
            "iter": self.iter,
            "tensors": {
                k: {"shape": list(t.shape), "error": t.error.clone(), "p": t.p.clone(), "q": t.q.clone()}
                for k, t in self.tensors.items()
            },
        }

    def load_state_dict(self, state: dict) -> None:
        self.iter = int(state["iter"])
        self.tensors = {
            k: _TensorState(tuple(t["shape"]), t["error"].clone(), t["p"].clone(), t["q"].clone())
            for k, t in state["tensors"].items()
        }

    def tensor_key(self, bucket: dist.GradBucket, position: int, param=None) -> str:
        """The state key of the ``position``-th tensor of ``bucket``: its parameter's name when known."""
        if param is not None and id(param) in self.param_names:
            return self.param_names[id(param)]
        return f"bucket{bucket.index()}.{position}"

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
                raise SettingsError(
                    f"ACP-SGD rank={self.rank} exceeds min{(n, m)} of {name!r} (its gradient as a "
                    f"matrix); use rank <= {min(n, m)}."
                )

    @property
    def even(self) -> bool:
        """Whether this step sends P (even) or Q (odd), counted from the first compressed step."""
        return (self.iter - self.start_iter) % 2 == 0


def _orth(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns of ``x`` by QR, computed in fp32 for bf16 / fp16 factors (QR has no low-precision kernel,
    and would lose the orthogonality anyway), returned in ``x``'s dtype."""
    if x.dtype in (torch.bfloat16, torch.float16):
        return torch.linalg.qr(x.float()).Q.to(x.dtype)
    return torch.linalg.qr(x).Q


def tensor_state(state: ACPSGDState, key: str, n: int, m: int, device, dtype) -> _TensorState:
    """The ``_TensorState`` of the n x m gradient matrix named ``key`` (created on first use: the initial Q seeded
    from ``seed`` and the key, identical on every rank)."""
    ts = state.tensors.get(key)
    if ts is None or ts.shape != (n, m):
        gen = torch.Generator().manual_seed(state.seed + 1_000_003 * zlib.crc32(key.encode()))
        ts = _TensorState(
            (n, m),
            torch.zeros(n, m, device=device, dtype=dtype),
            torch.zeros(n, state.rank, device=device, dtype=dtype),
            torch.randn(m, state.rank, generator=gen).to(device=device, dtype=dtype),
        )
        state.tensors[key] = ts
    return ts


def _tensor_states(state: ACPSGDState, bucket: dist.GradBucket) -> list:
    """Per tensor of the bucket: its ``_TensorState`` if compressed, else None."""
    grads = bucket.gradients()
    params = bucket.parameters() if state.param_names else [None] * len(grads)
    out = []
    for position, (g, param) in enumerate(zip(grads, params)):
        if not state.compresses(g.shape):
            out.append(None)
            continue
        out.append(
            tensor_state(
                state, state.tensor_key(bucket, position, param), g.shape[0], g.numel() // g.shape[0], g.device, g.dtype
            )
        )
    return out


def encode(state: ACPSGDState, grads: list, states: list, even: bool):
    """One step's payload: the flat buffer to all-reduce (P or Q of each compressed gradient, the others whole),
    the orthogonalised factors kept back, and the error feedback before the step."""
    pieces, orth = [], []
    errors = [ts.error if ts is not None else None for ts in states]
    for g, ts in zip(grads, states):
        if ts is None:
            pieces.append(g.reshape(-1))
            orth.append(None)
            continue
        n, m = ts.shape
        mat = g.reshape(n, m)
        if state.use_error_feedback:
            mat = mat + ts.error
        if even:
            q = _orth(ts.q)
            p = mat @ q
            if state.use_error_feedback:
                ts.error = mat - p @ q.T
            pieces.append(p.reshape(-1))
            orth.append(q)
        else:
            p = _orth(ts.p)
            q = mat.T @ p
            if state.use_error_feedback:
                ts.error = mat - p @ q.T
            pieces.append(q.reshape(-1))
            orth.append(p)
    return torch.cat(pieces) if pieces else torch.zeros(0), orth, errors


def decode(
    state: ACPSGDState, reduced: torch.Tensor, grads: list, states: list, orth: list, errors: list, even: bool
) -> None:
    """Write the averaged payload ``reduced`` back into ``grads`` (in place) and keep the new factors.

    An overflowing step (fp16 with a GradScaler, whose scaled gradients hold inf on some rank) carries inf or nan
    through the sum to every rank alike: the gradients come out non-finite, so every rank's scaler skips the step,
    but the factors and the error feedback keep the last finite step's values (state taken from this one would stay
    nan for the rest of the run). Chosen on the device: no host sync."""
    finite = torch.isfinite(reduced).all()
    offset = 0
    for g, ts, o, err in zip(grads, states, orth, errors):
        if ts is None:
            g.copy_(reduced[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
            continue
        n, m = ts.shape
        size = (n if even else m) * state.rank
        factor = reduced[offset : offset + size].view(-1, state.rank)
        offset += size
        if even:
            ts.p = torch.where(finite, factor, ts.p)
            g.copy_((factor @ o.T).view_as(g))
        else:
            ts.q = torch.where(finite, factor, ts.q)
            g.copy_((o @ factor.T).view_as(g))
        if state.use_error_feedback:
            ts.error = torch.where(finite, ts.error, err)


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

    states = _tensor_states(state, bucket)
    even = state.even
    grads = bucket.gradients()
    flat, orth, errors = encode(state, grads, states, even)
    state.stats.add(flat)
    fut = dist.all_reduce(flat, group=group, async_op=True).get_future()

    def decompress(f):
        decode(state, f.value()[0].div_(world), grads, states, orth, errors, even)
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
