"""DDP communication hooks for Accelerate, the Trainer, plain DDP and DeepSpeed stage 0.

``register(model, config)`` after ``accelerator.prepare(model)`` (Accelerate's ``DistributedDataParallelKwargs``
silently ignores a callable ``comm_hook``), :class:`hf_dtrain.callbacks.CommHookCallback` with the Trainer, or
:func:`hf_dtrain.comm.deepspeed.register_deepspeed` on a DeepSpeed engine.

Methods: ``"allreduce"`` (the dense baseline, counted), ``"acp_sgd"`` (:mod:`hf_dtrain.comm.acp_sgd`),
``"s2_reducer"`` (:mod:`hf_dtrain.comm.s2_reducer`), ``"dear"`` (:mod:`hf_dtrain.comm.dear`; needs the optimizer),
``"embrace"`` (:mod:`hf_dtrain.comm.embrace`; call :func:`exclude_embeddings` before wrapping), ``"noop"`` (DDP
sends nothing: for optimizers that exchange gradients themselves, such as :class:`hf_dtrain.optim.OneBitLamb`).
"""


import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.distributed as dist

from ..distributed import WireStats, check_same_across_ranks, world_size_of
from .acp_sgd import ACPSGDState, acp_sgd_hook, acp_sgd_step_bytes
from .dear import DeARState, dear_hook, dear_step_bytes
from .embrace import EXCHANGES, EmbRaceState, embrace_dense_hook, embrace_step_bytes, exclude_embeddings
from .s2_reducer import S2ReducerState, s2_reducer_hook

METHODS = ("allreduce", "acp_sgd", "s2_reducer", "dear", "embrace", "noop")


@dataclass
class DenseState:
    """State of :func:`dense_allreduce_hook`: torch's averaged all-reduce, with the same byte accounting as the
    compressing hooks."""

    process_group: Optional[dist.ProcessGroup] = None
    stats: WireStats = field(default_factory=WireStats)
    calls: int = 0


def dense_allreduce_hook(state: DenseState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    state.calls += 1
    state.stats.add(bucket.buffer())
    fut = allreduce_hook(state.process_group, bucket)
    if not bucket.is_last():
        return fut

    def end(f):
        state.stats.end_step()
        return f.value()

    return fut.then(end)


@dataclass
class CommHookConfig:
    """A communication method and its settings; every field is a YAML recipe key (``comm_hook: {method: acp_sgd,
    rank: 4}``)."""

    method: str = "acp_sgd"
    rank: int = 4
    start_iter: int = 10
    min_compression_rate: float = 2.0
    use_error_feedback: bool = True
    seed: int = 0
    sketch_rows: int = 3
    sketch_width_factor: float = 4.0
    exchange: str = "allgather"  # EmbRace: "allgather" or "alltoall"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"CommHookConfig.method={self.method!r} is unknown; use one of {', '.join(METHODS)}.")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"CommHookConfig.exchange={self.exchange!r} is unknown; use one of {', '.join(EXCHANGES)}.")

    @classmethod
    def from_any(cls, config: Union["CommHookConfig", dict, str, None]) -> "CommHookConfig":
        if config is None:
            return cls()
        if isinstance(config, cls):
            return config
        if isinstance(config, str):
            return cls(method=config)
        if isinstance(config, dict):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(config) - known)
            if unknown:
                raise ValueError(f"comm hook config: unknown key(s) {unknown}; valid keys are {sorted(known)}.")
            return cls(**config)
        raise TypeError(f"comm hook config must be a CommHookConfig, a dict or a method name, got {type(config).__name__}.")


def _ddp_module(model):
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model
    raise TypeError(
        f"register() needs the DistributedDataParallel model that accelerator.prepare(model) (or DDP(model)) returns, "
        f"got {type(model).__name__}. Call it after accelerator.prepare and before the first backward; with one "
        "process there is nothing to communicate (launch with accelerate launch / torchrun and >= 2 processes)."
    )


def unwrap_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` (or the optimizer itself)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def register(model, config: Union[CommHookConfig, dict, str, None] = None, process_group=None, optimizer=None):
    """Register the configured hook on a DDP-wrapped model; returns the hook's state (``state.stats`` counts the
    bytes of every step). ``optimizer`` is needed by ``"dear"`` (its update is deferred to the next forward).
    Errors (``TypeError``/``ValueError``) for an unwrapped model, a world of one process, a rank that exceeds a
    gradient matrix's dimension, a config that differs across ranks, DeAR without its optimizer, or EmbRace on a model
    whose embeddings were not excluded from DDP before wrapping."""
    ddp = _ddp_module(model)
    config = CommHookConfig.from_any(config)
    if world_size_of(process_group) < 2:
        raise ValueError("communication hooks need a world of >= 2 processes; this one has 1. Launch with "
                         "accelerate launch / torchrun --nproc_per_node >= 2 (on CPU set ACCELERATE_USE_CPU=true).")
    check_same_across_ranks(dataclasses.asdict(config), "comm hook config", process_group)
    if config.method == "allreduce":
        state = DenseState(process_group=process_group)
        ddp.register_comm_hook(state, dense_allreduce_hook)
        return state
    if config.method == "noop":  # gradients stay local: the optimizer communicates (1-bit LAMB, decentralized)
        from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

        ddp.register_comm_hook(None, noop_hook)
        return DenseState(process_group=process_group)
    if config.method == "dear":
        if optimizer is None:
            raise ValueError("DeAR defers the optimizer update to the next forward and needs the optimizer: "
                             "register(model, 'dear', optimizer=optimizer) with the prepared optimizer.")
        state = DeARState(process_group=process_group)
        state.attach(ddp, unwrap_optimizer(optimizer))
        ddp.register_comm_hook(state, dear_hook)
        return state
    if config.method == "embrace":
        state = EmbRaceState(process_group=process_group, exchange=config.exchange)
        state.attach(ddp)
        ddp.register_comm_hook(state, embrace_dense_hook)
        return state
    if config.method == "s2_reducer":
        state = S2ReducerState(process_group=process_group, rows=config.sketch_rows,
                               width_factor=config.sketch_width_factor, seed=config.seed)
        ddp.register_comm_hook(state, s2_reducer_hook)
        return state
    state = ACPSGDState(process_group=process_group, rank=config.rank, start_iter=config.start_iter,
                        min_compression_rate=config.min_compression_rate,
                        use_error_feedback=config.use_error_feedback, seed=config.seed)
    state.check_rank((n, p.shape) for n, p in ddp.module.named_parameters() if p.requires_grad)
    state.param_names = {id(p): n for n, p in ddp.module.named_parameters()}  # state keyed by parameter
    ddp.register_comm_hook(state, acp_sgd_hook)
    return state


__all__ = ["CommHookConfig", "register", "unwrap_optimizer", "DenseState", "dense_allreduce_hook", "ACPSGDState",
           "acp_sgd_hook", "acp_sgd_step_bytes", "S2ReducerState", "s2_reducer_hook", "DeARState", "dear_hook",
           "dear_step_bytes", "EmbRaceState", "embrace_dense_hook", "embrace_step_bytes", "exclude_embeddings",
           "WireStats"]
