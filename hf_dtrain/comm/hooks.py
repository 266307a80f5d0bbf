"""``register(model, config)``: a communication hook on a DDP model, by method (the table ``_REGISTER``), and the
dense all-reduce hook with byte accounting that the half-precision methods and the baseline use."""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from hf_dtrain.errors import SettingsError

from ..distributed.collectives import check_same_across_ranks, world_size_of
from ..distributed.counters import WireStats
from ..distributed.engines import keep_gradients_local, unwrap_optimizer
from .acp_sgd import ACPSGDState, acp_sgd_hook
from .config import METHODS, CommHookConfig
from .dear import DeARState
from .embrace import EmbRaceState, embrace_dense_hook
from .s2_reducer import S2ReducerState, s2_reducer_hook


@dataclass
class DenseState:
    """State of :func:`dense_allreduce_hook`: torch's averaged all-reduce, with the same byte accounting as the
    compressing hooks."""

    process_group: dist.ProcessGroup | None = None
    stats: WireStats = field(default_factory=WireStats)
    calls: int = 0
    wire_dtype: torch.dtype | None = None  # bf16 / fp16: the bucket travels in this dtype (torch's hooks)


# (no `from __future__ import annotations` here: DDP checks these annotations against the real classes)
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
        raise SettingsError(
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
        raise SettingsError(
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
    state = S2ReducerState.from_config(config, process_group=group)
    ddp.register_comm_hook(state, s2_reducer_hook)
    return state


def _register_acp_sgd(ddp, config, group, optimizer):
    state = ACPSGDState.from_config(config, process_group=group)
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
