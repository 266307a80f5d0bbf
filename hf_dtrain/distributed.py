"""What hf_dtrain's distributed pieces share: byte accounting of what goes on the wire, and checks that every rank
agrees before the first collective of a method (a mismatch is a clear error, not a hang)."""

from __future__ import annotations

import contextlib
import hashlib
import math
import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist


@dataclass
class WireStats:
    """Bytes this rank hands to collectives, per optimizer step.

    Counted as the payload of each collective call (``numel * element_size`` of the tensor this rank contributes),
    the same way for every method and for the dense baseline, so ratios between methods are exact. (A ring all-reduce
    moves ``2 (N - 1) / N`` times its payload over each link; that factor is common to all all-reduce methods.)
    """

    steps: list[int] = field(default_factory=list)  # payload bytes of every finished step
    current: int = 0
    collectives: int = 0  # collective calls in the current step

    def add(self, tensor: torch.Tensor) -> None:
        self.add_bytes(tensor.numel() * tensor.element_size())

    def add_bytes(self, nbytes: int) -> None:
        self.current += int(nbytes)
        self.collectives += 1

    def end_step(self) -> None:
        self.steps.append(self.current)
        self.current = 0
        self.collectives = 0

    @property
    def last_step_bytes(self) -> Optional[int]:
        return self.steps[-1] if self.steps else None


def sharded_engine_of(p) -> Optional[str]:
    """Which sharded engine holds ``p``, if any: an FSDP2 DTensor shard, or a DeepSpeed ZeRO-3 partition."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return "FSDP2 (a DTensor shard)"
    if hasattr(p, "ds_id"):
        return "DeepSpeed ZeRO-3 (a partitioned parameter)"
    return None


class WholeReplicaGuard:
    """For optimizers that exchange whole gradients or parameters between replicas (1-bit LAMB, gossip): refuse
    sharded engines with the reason. ``check_construction`` at ``__init__`` (FSDP2 and ZeRO-3 hand it shards),
    ``check_step`` at each ``step`` (DeepSpeed ZeRO-1/2 swap the parameters for flat fp32 partitions after
    construction)."""

    def __init__(self, optimizer: torch.optim.Optimizer, who: str):
        self.who = who
        self.ids = [id(p) for g in optimizer.param_groups for p in g["params"]]
        for g in optimizer.param_groups:
            for p in g["params"]:
                engine = sharded_engine_of(p)
                if engine is not None:
                    raise ValueError(self._message(engine))

    def _message(self, engine: str) -> str:
        return (f"{self.who} exchanges whole gradients or parameters between replicas, and its parameters are held by "
                f"{engine}: each rank holds a shard, not a replica, so there is nothing whole to exchange. Train it "
                "with DDP (no --fsdp / --deepspeed, or ZeRO stage 0), or keep the sharded engine with AdamW or Eva.")

    def check_step(self, optimizer: torch.optim.Optimizer) -> None:
        if [id(p) for g in optimizer.param_groups for p in g["params"]] != self.ids:
            raise ValueError(self._message("an engine that replaced them after construction (DeepSpeed ZeRO stage "
                                           ">= 1 hands its client optimizer flat fp32 partitions)"))


def unwrap_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` / DeepSpeed's wrappers (or the optimizer)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


# bit i of a byte holds position i (little-endian bit order)
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A boolean vector as uint8, 8 positions per byte (little-endian bit order, zero-padded): the bitmaps of the
    S2 Reducer and the signs of 1-bit LAMB."""
    n = mask.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask.reshape(-1)
    return (padded.view(-1, 8) * _BIT_WEIGHTS.to(mask.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` positions as a boolean vector."""
    bits = packed.unsqueeze(1).bitwise_and(_BIT_WEIGHTS.to(packed.device)).ne(0)
    return bits.reshape(-1)[:n]


def _sign(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)  # sign(0) = +1, as DeepSpeed


def _scale_blocks(chunk: int, scale_block: Optional[int]) -> tuple[int, int]:
    """(block length, blocks per chunk) of the per-block scales of the 1-bit all-reduce."""
    block = min(scale_block or chunk, chunk)
    return block, -(-chunk // block)


def onebit_compress(x: torch.Tensor, scale_block: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` (rows, chunk) -> (signs ±1, per-block scales (rows, blocks), the compression error): the scale of a
    block is its RMS, so ``scale * sign`` keeps the block's L2 norm."""
    rows, chunk = x.shape
    block, nb = _scale_blocks(chunk, scale_block)
    padded = torch.nn.functional.pad(x, (0, nb * block - chunk)).view(rows, nb, block)
    counts = torch.full((nb,), float(block))
    counts[-1] = chunk - (nb - 1) * block
    scales = padded.norm(dim=2) / counts.sqrt()
    sign = _sign(x)
    approx = scales.repeat_interleave(block, dim=1)[:, :chunk] * sign
    return sign, scales, x - approx


def onebit_decompress(sign: torch.Tensor, scales: torch.Tensor, scale_block: Optional[int]) -> torch.Tensor:
    block, _ = _scale_blocks(sign.shape[1], scale_block)
    return scales.repeat_interleave(block, dim=1)[:, :sign.shape[1]] * sign


def onebit_allreduce(x: torch.Tensor, errors: dict, group=None, scale_block: Optional[int] = 2048,
                     stats: Optional[WireStats] = None) -> torch.Tensor:
    """The average of ``x`` over the ranks, sent as signs (8 per byte) and per-block scales, with worker and server
    error feedback (1-bit LAMB's exchange; Li et al., arXiv 2104.06069, after DeepSpeed's ``compressed_allreduce``).

    ``x``: flat fp32, its length a multiple of ``8 * world``. ``errors``: ``{"worker_error": zeros(len(x)),
    "server_error": zeros(len(x) // world)}``, updated in place (what compression left out, added back next call).

    - worker: ``x += e_w``; chunk k of ``x`` belongs to rank k; each block of ``scale_block`` values gets its RMS as
      scale, ``e_w = x - scale * sign(x)``; chunk k's signs and scales go to rank k (``all_to_all``);
    - server (rank k, chunk k): ``y = mean_i(s_i sign_i) + e_s``, compressed the same way, ``e_s`` kept; every
      rank's chunk (signs and scales) is ``all_gather``-ed back.
    """
    world = world_size_of(group)
    chunk = x.numel() // world
    _, nb = _scale_blocks(chunk, scale_block)
    x = (x + errors["worker_error"]).view(world, chunk)
    sign, s_w, err = onebit_compress(x, scale_block)
    errors["worker_error"] = err.reshape(-1)
    packed = pack_bits(sign.reshape(-1) > 0)  # the length is a multiple of 8 * world: whole bytes per chunk
    received = torch.empty_like(packed)
    scales = torch.empty(world * nb)
    if stats is not None:
        stats.add(packed)
        stats.add(s_w)
    # phase 1: chunk k of every rank's signs (and its block scales) to rank k
    dist.all_to_all_single(received, packed, group=group)
    dist.all_to_all_single(scales, s_w.reshape(-1).contiguous(), group=group)
    signs = unpack_bits(received, chunk * world).view(world, chunk).float() * 2 - 1
    y = onebit_decompress(signs, scales.view(world, nb), scale_block).mean(0, keepdim=True) + errors["server_error"]
    server_sign, s_s, err = onebit_compress(y, scale_block)
    errors["server_error"] = err.reshape(-1)
    mine = pack_bits(server_sign.reshape(-1) > 0)
    all_signs = torch.empty(mine.numel() * world, dtype=torch.uint8)
    all_scales = torch.empty(world * nb)
    if stats is not None:
        stats.add(mine)
        stats.add(s_s)
    # phase 2: every rank's averaged chunk (signs and block scales) to every rank
    all_gather_single(all_signs, mine, group=group)
    all_gather_single(all_scales, s_s.reshape(-1).contiguous(), group=group)
    out = unpack_bits(all_signs, chunk * world).view(world, chunk).float() * 2 - 1
    return onebit_decompress(out, all_scales.view(world, nb), scale_block).reshape(-1)


def int8_allreduce(x: torch.Tensor, errors: dict, group=None, block: int = 2048,
                   stats: Optional[WireStats] = None) -> torch.Tensor:
    """The average of flat fp32 ``x`` over the ranks, sent as int8 with one fp32 scale per block of ``block`` values
    (``max|x| / 127``) and error feedback: ``errors["worker_error"]`` (zeros like ``x`` at first) holds what the
    rounding left out and is added to the next call's ``x``. Every rank all-gathers every rank's int8 values and
    scales and averages locally (int8 sums would overflow): ``n + 4 n / block`` bytes of payload per rank."""
    world = world_size_of(group)
    n = x.numel()
    padded = -(-n // block) * block
    y = torch.zeros(padded, dtype=torch.float32, device=x.device)
    y[:n] = x.float() + errors.get("worker_error", 0)
    blocks = y.view(-1, block)
    scales = blocks.abs().amax(dim=1) / 127.0
    q = torch.round(blocks / scales.clamp(min=1e-30).unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    errors["worker_error"] = (blocks - q.float() * scales.unsqueeze(1)).reshape(-1)[:n].clone()
    all_q = torch.empty(world * padded, dtype=torch.int8, device=x.device)
    all_s = torch.empty(world * scales.numel(), dtype=torch.float32, device=x.device)
    if stats is not None:
        stats.add(q)
        stats.add(scales)
    all_gather_single(all_q, q.reshape(-1), group=group)
    all_gather_single(all_s, scales, group=group)
    total = (all_q.view(world, -1, block).float() * all_s.view(world, -1, 1)).sum(0).reshape(-1)[:n]
    return total.div_(world).to(x.dtype)


def keep_gradients_local(ddp_model) -> None:
    """Register torch's ``noop_hook`` on a DDP model: DDP sends nothing and each rank keeps its own gradients, for
    optimizers that exchange gradients or parameters themselves (1-bit LAMB, the decentralized optimizers)."""
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"keep_gradients_local() needs the DistributedDataParallel model that accelerator.prepare "
                        f"(or DDP(model)) returns, got {type(ddp_model).__name__}.")
    ddp_model.register_comm_hook(None, noop_hook)


def world_size_of(process_group=None) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(process_group)


def check_same_across_ranks(value: Any, what: str, process_group=None) -> None:
    """Raise a ``ValueError`` on every rank unless ``value`` (JSON-serialisable) is the same on all ranks. Uses one
    small all-gather, bounded by the process group's timeout."""
    if world_size_of(process_group) == 1:
        return
    digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
    gathered: list = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, (digest, value), group=process_group)
    if len({d for d, _ in gathered}) > 1:
        per_rank = {r: v for r, (_, v) in enumerate(gathered)}
        raise ValueError(f"{what} differs across ranks: {per_rank}. Give every rank the same {what} (the same recipe "
                         "or config file on every host).")


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """``all_gather_single`` (torch >= 2.13), else ``all_gather_into_tensor`` (its old name, deprecated in 2.13)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """``reduce_scatter_single`` (torch >= 2.13), else ``reduce_scatter_tensor`` (its old name)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)


def release_process_group() -> None:
    """End a distributed run cleanly: collect what still references DDP models, then destroy the default process
    group. Freeing a DDP model after its gloo group is gone (or at interpreter exit) can abort or hang the process
    (pytorch/pytorch#56297); call this after the last collective, once the DDP model's own references are dropped
    (``del model`` in the caller)."""
    import gc

    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def init_distributed(backend: Optional[str] = None) -> bool:
    """Initialize the default process group before Accelerate / the Trainer do, when torchrun's or accelerate's
    elastic agent launched this process and shares its store with the workers (``TORCHELASTIC_USE_AGENT_STORE``).

    That store outlives a failed generation, and torch puts no per-attempt prefix on the keys gloo and NCCL
    publish their addresses under: a restarted generation (``--max-restarts``) reads the dead one's addresses and
    fails in ``connectFullMesh`` (``Connection refused``) or hangs. Here the keys are prefixed with
    ``TORCHELASTIC_RESTART_COUNT``. Returns whether it initialized the group (Accelerate and the Trainer then use
    it as it is)."""
    import os

    from torch.distributed.constants import default_pg_timeout as timeout  # what init_process_group uses

    if not dist.is_available() or dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return False
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"hf_dtrain/attempt_{attempt}", store)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    return True


class RankFailure(RuntimeError):
    """Another rank stopped (killed, crashed, its host lost) while this one was in a collective with it."""


class CommFailure(RuntimeError):
    """A collective or transfer failed, said with what this rank was doing (a layer's own wording, such as the
    pipeline stage that waited): :meth:`RankMonitor.guard` keeps that wording after the dead rank's name."""


class RankMonitor:
    """Names the rank that died when a collective fails, instead of a raw gloo/NCCL traceback.

    Each rank publishes a heartbeat (a counter, its host, pid and the step it is on) every ``interval`` seconds
    in the rendezvous store (``MASTER_ADDR:MASTER_PORT``, which torchrun's agent or rank 0 hosts). When a collective
    inside :meth:`guard` fails, the survivor reads the heartbeats twice, ``3 * interval`` apart: a rank whose
    counter stood still is dead, and :class:`RankFailure` says which, on which host, at which step, and how to
    resume. ``monitor.step = n`` as training goes."""

    def __init__(self, interval: float = 1.0, resume_hint: str = "relaunch the same command to resume"):
        import os
        import socket
        import threading

        self.interval, self.resume_hint = interval, resume_hint
        self._step = 0
        self.step_of = None  # or a callable giving the current step (a Trainer's state.global_step)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"hf_dtrain/heartbeat/{attempt}/"
        self.store = None
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            from datetime import timedelta

            try:
                self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), self.world,
                                           is_master=False, timeout=timedelta(seconds=max(5.0, 3 * interval)))
            except Exception:  # no TCP store there (a file:// rendezvous): failures pass through unnamed
                self.store = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._beats = 0
        self._beat()
        self._thread = threading.Thread(target=self._run, daemon=True, name="hf_dtrain-heartbeat")
        self._thread.start()

    def _beat(self) -> None:
        if self.store is None:
            return
        if self.step_of is not None:
            self._step = self.step_of()
        self._beats += 1
        self.store.set(self.prefix + str(self.rank),
                       json.dumps({"n": self._beats, "host": self.host, "pid": self.pid, "step": self.step}))

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:  # published by the heartbeat thread at once (the loop never waits on it)
        self._step = value
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._beat()
            except Exception:  # the store is gone (its host died): diagnose() says so
                return

    def _read(self) -> dict:
        out = {}
        for r in range(self.world):
            key = self.prefix + str(r)
            if self.store.check([key]):
                out[r] = json.loads(self.store.get(key))
        return out

    def diagnose(self) -> Optional[str]:
        """A message naming the dead ranks, or None when every rank's heartbeat still moves."""
        if self.store is None:
            return None
        if self.step_of is not None:
            self._step = self.step_of()
        try:
            first = self._read()
            time.sleep(3 * self.interval)
            second = self._read()
        except Exception:
            return (f"hf_dtrain: the rendezvous store at {self.address} is unreachable, so rank 0 (or the launcher "
                    f"that hosted it) is gone; rank {self.rank} (host {self.host}) stops at step {self.step}. "
                    f"{self.resume_hint[0].upper()}{self.resume_hint[1:]}.")
        dead = [r for r in range(self.world) if r != self.rank and
                (r not in second or second[r]["n"] == first.get(r, {}).get("n"))]
        if not dead:
            return None
        beats = {r: second.get(r, {}) for r in dead}
        named = ", ".join(f"rank {r} (host {b.get('host', '?')}, pid {b.get('pid', '?')}, last at step "
                          f"{b.get('step', '?')})" for r, b in beats.items())
        return (f"hf_dtrain: {named} stopped responding while rank {self.rank} (host {self.host}) was in a "
                f"collective at step {self.step}; rank {self.rank} stops too. {self.resume_hint[0].upper()}"
                f"{self.resume_hint[1:]}.")

    @contextlib.contextmanager
    def guard(self):
        """Context manager: a failing collective inside becomes a :class:`RankFailure` naming the dead rank (the
        original error chained); any other error, or one no dead rank explains, passes through unchanged."""
        try:
            yield self
        except Exception as e:
            message = self.diagnose() if is_comm_error(e) and not isinstance(e, RankFailure) else None
            if message is None:
                raise
            if isinstance(e, CommFailure):
                message = f"{message} ({e})"
            raise RankFailure(message) from e

    def close(self) -> None:
        self._stop.set()
        self._wake.set()


def is_comm_error(e: BaseException) -> bool:
    """``e`` is a failed collective or transfer (torch's ``DistError``, or a backend's runtime error)."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(s in text for s in (
        "Gloo", "gloo", "NCCL", "Connection reset", "Connection closed", "Broken pipe", "connectFullMesh",
        "Timed out", "timed out"))


class SavedTensorCounter:
    """Counts the bytes autograd saves for backward, as unique storages (``saved_tensors_hooks``).

    ``exclude`` takes tensors (for example parameters) whose storages are not activations and should not count.
    """

    def __init__(self, exclude=()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._storages: dict[int, int] = {}

    def _pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self._exclude:
            self._storages[ptr] = max(self._storages.get(ptr, 0), st.nbytes())
        return t

    @staticmethod
    def _unpack(t):
        return t

    @property
    def nbytes(self) -> int:
        return sum(self._storages.values())

    @contextlib.contextmanager
    def __call__(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


def speed_quotas(n: int, speeds: Sequence[float]) -> list[int]:
    """``n`` split proportionally to ``speeds`` (largest remainder; sums to ``n``): the heterogeneity-aware
    partitioner's shard sizes and the federated simulation's clients per process."""
    total = float(sum(speeds))
    exact = [n * s / total for s in speeds]
    quotas = [math.floor(x) for x in exact]
    order = sorted(range(len(speeds)), key=lambda i: (-(exact[i] - quotas[i]), i))
    for i in order[:n - sum(quotas)]:
        quotas[i] += 1
    return quotas
