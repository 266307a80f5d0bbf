"""DDP communication hooks for Accelerate, the Trainer, plain DDP and DeepSpeed stage 0.

``register(model, config)`` after ``accelerator.prepare(model)`` (Accelerate's ``DistributedDataParallelKwargs``
silently ignores a callable ``comm_hook``), :class:`hf_dtrain.callbacks.CommHookCallback` with the Trainer, or
:func:`hf_dtrain.comm.deepspeed.register_deepspeed` on a DeepSpeed engine.

Methods: ``"allreduce"`` (the dense baseline, counted), ``"bf16"`` / ``"fp16"`` (the same in half precision, torch's
compress hooks, counted), ``"acp_sgd"`` (:mod:`hf_dtrain.comm.acp_sgd`),
``"s2_reducer"`` (:mod:`hf_dtrain.comm.s2_reducer`), ``"dear"`` (:mod:`hf_dtrain.comm.dear`; needs the optimizer),
``"embrace"`` (:mod:`hf_dtrain.comm.embrace`; call :func:`exclude_embeddings` before wrapping), ``"noop"`` (DDP
sends nothing: for optimizers that exchange gradients themselves, such as :class:`hf_dtrain.optim.OneBitLamb`).

FSDP2 has no DDP hooks: under HSDP, :func:`register_fsdp` (:mod:`hf_dtrain.comm.fsdp`) compresses the exchange across
replica groups with ``allreduce``, ``bf16``, ``fp16`` or ``acp_sgd``.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ..distributed.collectives import check_same_across_ranks, world_size_of
from ..distributed.counters import WireStats
from ..distributed.engines import keep_gradients_local, unwrap_optimizer
from .acp_sgd import ACPSGDState, acp_sgd_hook, acp_sgd_step_bytes
from .config import METHODS, CommHookConfig
from .dear import DeARState, dear_step_bytes
from .embrace import EmbRaceState, embrace_dense_hook, embrace_step_bytes, exclude_embeddings
from .embrace_sharded import ColumnShardedEmbedding, clip_sharded_grad_norm_, shard_embeddings, unshard_embeddings
from .fsdp import FSDP_METHODS, FSDPExchangeState, fsdp_exchange_step_bytes, register_fsdp
from .s2_reducer import S2ReducerState, s2_reducer_hook


@dataclass
class DenseState:
    """State of :func:`dense_allreduce_hook`: torch's averaged all-reduce, with the same byte accounting as the
    compressing hooks."""

    process_group: dist.ProcessGroup | None = None
    stats: WireStats = field(default_factory=WireStats)
    calls: int = 0
    wire_dtype: torch.dtype | None = None  # bf16 / fp16: the bucket travels in this dtype (torch's hooks)


def dense_allreduce_hook(state: DenseState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:

    state.calls += 1
    buffer = bucket.buffer()
    if state.wire_dtype is None:
        state.stats.add(buffer)
        fut = default_hooks.allreduce_hook(state.process_group, bucket)
    else:  # torch casts the bucket, all-reduces it and casts back: count what travels
        state.stats.add_bytes(buffer.numel() * state.wire_dtype.itemsize)
        half_hook = (
            default_hooks.bf16_compress_hook if state.wire_dtype == torch.bfloat16 else default_hooks.fp16_compress_hook
        )
        fut = half_hook(state.process_group, bucket)
    if not bucket.is_last():
        return fut

    def end(f):
        state.stats.end_step()
        return f.value()

    return fut.then(end)


def _ddp_module(model):

    if isinstance(model, DistributedDataParallel):
        return model
    raise TypeError(
        f"register() needs the DistributedDataParallel model that accelerator.prepare(model) (or DDP(model)) returns, "
        f"got {type(model).__name__}. Call it after accelerator.prepare and before the first backward; with one "
        "process there is nothing to communicate (launch with accelerate launch / torchrun and >= 2 processes)."
    )


def register(model, config: CommHookConfig | dict | str | None = None, process_group=None, optimizer=None):
    """Register the configured hook on a DDP-wrapped model; returns the hook's state (``state.stats`` counts the
    bytes of every step). ``optimizer`` is needed by ``"dear"`` (its update is deferred to the next forward).
    Errors (``TypeError``/``ValueError``) for an unwrapped model, a world of one process, a rank that exceeds a
    gradient matrix's dimension, a config that differs across ranks, DeAR without its optimizer, or EmbRace on a model
    whose embeddings were not excluded from DDP before wrapping."""
    ddp = _ddp_module(model)
    config = CommHookConfig.from_any(config)
    if world_size_of(process_group) < 2:
        raise ValueError(
            "communication hooks need a world of >= 2 processes; this one has 1. Launch with "
            "accelerate launch / torchrun --nproc_per_node >= 2 (on CPU set ACCELERATE_USE_CPU=true)."
        )
    check_same_across_ranks(dataclasses.asdict(config), "comm hook config", process_group)
    return _REGISTER[config.method](ddp, config, process_group, optimizer)


def _register_allreduce(ddp, config, group, optimizer):
    state = DenseState(process_group=group)
    ddp.register_comm_hook(state, dense_allreduce_hook)
    return state


def _register_half(ddp, config, group, optimizer):
    state = DenseState(process_group=group, wire_dtype=torch.bfloat16 if config.method == "bf16" else torch.float16)
    ddp.register_comm_hook(state, dense_allreduce_hook)
    return state


def _register_noop(ddp, config, group, optimizer):
    """Gradients stay local: the optimizer communicates (1-bit LAMB, decentralized)."""
    keep_gradients_local(ddp)
    return DenseState(process_group=group)


def _register_dear(ddp, config, group, optimizer):
    if optimizer is None:
        raise ValueError(
            "DeAR defers the optimizer update to the next forward and needs the optimizer: "
            "register(model, 'dear', optimizer=optimizer) with the prepared optimizer."
        )
    state = DeARState(process_group=group, fusion_mb=config.fusion_mb)
    state.attach(ddp, unwrap_optimizer(optimizer))  # per-layer hooks; DDP itself sends nothing
    return state


def _register_embrace(ddp, config, group, optimizer):
    state = EmbRaceState(process_group=group, exchange=config.exchange)
    state.attach(ddp)
    ddp.register_comm_hook(state, embrace_dense_hook)
    return state


def _register_s2_reducer(ddp, config, group, optimizer):
    state = S2ReducerState(
        process_group=group,
        rows=config.sketch_rows,
        width_factor=config.sketch_width_factor,
        seed=config.seed,
        error_feedback=config.use_error_feedback,
    )
    ddp.register_comm_hook(state, s2_reducer_hook)
    return state


def _register_acp_sgd(ddp, config, group, optimizer):
    state = ACPSGDState(
        process_group=group,
        rank=config.rank,
        start_iter=config.start_iter,
        min_compression_rate=config.min_compression_rate,
        use_error_feedback=config.use_error_feedback,
        seed=config.seed,
    )
    state.check_rank((n, p.shape) for n, p in ddp.module.named_parameters() if p.requires_grad)
    state.param_names = {id(p): n for n, p in ddp.module.named_parameters()}  # state keyed by parameter
    ddp.register_comm_hook(state, acp_sgd_hook)
    return state


# method name -> (DDP model, config, process group, optimizer) -> the hook's state
_REGISTER: dict[str, Callable] = {
    "allreduce": _register_allreduce,
    "bf16": _register_half,
    "fp16": _register_half,
    "noop": _register_noop,
    "dear": _register_dear,
    "embrace": _register_embrace,
    "s2_reducer": _register_s2_reducer,
    "acp_sgd": _register_acp_sgd,
}
assert set(_REGISTER) == set(METHODS)

__all__ = [
    "FSDP_METHODS",
    "ACPSGDState",
    "ColumnShardedEmbedding",
    "CommHookConfig",
    "DeARState",
    "DenseState",
    "EmbRaceState",
    "FSDPExchangeState",
    "S2ReducerState",
    "WireStats",
    "acp_sgd_hook",
    "acp_sgd_step_bytes",
    "clip_sharded_grad_norm_",
    "dear_step_bytes",
    "dense_allreduce_hook",
    "embrace_dense_hook",
    "embrace_step_bytes",
    "exclude_embeddings",
    "fsdp_exchange_step_bytes",
    "register",
    "register_fsdp",
    "s2_reducer_hook",
    "shard_embeddings",
    "unshard_embeddings",
    "unwrap_optimizer",
]
