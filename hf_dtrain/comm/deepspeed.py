"""The communication methods on a DeepSpeed engine (ZeRO stage 0).

DeepSpeed does not use DDP, so there is no bucket hook to register. At ZeRO stage 0 the engine all-reduces every
gradient after backward (``engine.allreduce_gradients``) and then calls the client optimizer; ``register_deepspeed``
turns the engine's all-reduce off (``engine.enable_backward_allreduce = False``, the switch DeepSpeed's own 1-bit
optimizers used) and runs the hf_dtrain method from a step pre-hook of the optimizer instead, on buckets of the
gradients built like DDP's (reverse parameter order, ``bucket_cap_mb``). The same hook functions and states run as
under DDP, so the results and the byte counts are the same.

What applies where:

* **stage 0**: ``allreduce`` (counted), ``acp_sgd``, ``s2_reducer``. DeAR and EmbRace are DDP-schedule methods
  (forward pre-hooks on DDP's buckets; parameters ignored by DDP) and are refused.
* **stage 1 and up**: DeepSpeed's ZeRO optimizer reduces the gradients into its partitions itself (reduce-scatter /
  all-reduce inside ``DeepSpeedZeroOptimizer``), so there is nothing to replace from outside; refused with a
  ``ValueError``. Stage 1 still benefits from hf_dtrain's optimizers that do their own communication.
* The engine's ``gradient_clipping`` runs before the optimizer step, that is before the gradients are averaged here;
  it is refused (clip inside the optimizer if needed). Gradient accumulation works: the step pre-hook runs at the
  accumulation boundary only.
"""

import math

import torch

from hf_dtrain.errors import SettingsError

from ..distributed.collectives import world_size_of
from .acp_sgd import ACPSGDState, acp_sgd_hook
from .config import CommHookConfig
from .hooks import DenseState, dense_allreduce_hook
from .s2_reducer import S2ReducerState, s2_reducer_hook

DEEPSPEED_METHODS = ("allreduce", "acp_sgd", "s2_reducer")


class FlatBucket:
    """The parts of ``torch.distributed.GradBucket`` the hooks use, over a list of parameters' gradients: one flat
    buffer, gradients as views into it."""

    def __init__(self, index: int, params: list[torch.nn.Parameter], last: bool):
        self._index, self._params, self._last = index, params, last
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        self._buffer = torch.cat([g.reshape(-1) for g in grads])
        self._views, offset = [], 0
        for p in params:
            self._views.append(self._buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def write_back(self, reduced: torch.Tensor) -> None:
        offset = 0
        for p in self._params:
            value = reduced[offset : offset + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = value.clone()
            else:
                p.grad.copy_(value)
            offset += p.numel()


def _buckets(params: list[torch.nn.Parameter], cap_bytes: int) -> list[list[torch.nn.Parameter]]:
    buckets, current, size = [], [], 0
    for p in reversed(params):  # gradients of the last layers are ready first, as in DDP
        if current and (size + p.numel() * p.element_size() > cap_bytes or p.dtype != current[0].dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
    if current:
        buckets.append(current)
    return buckets


def register_deepspeed(engine, config=None, bucket_cap_mb: float = 25.0):
    """Run an hf_dtrain communication method in place of the DeepSpeed engine's gradient all-reduce (ZeRO stage 0).
    Returns the method's state (``state.stats.steps``: bytes per optimizer step)."""
    config = CommHookConfig.from_any(config)
    stage = engine.zero_optimization_stage()
    if stage != 0:
        raise SettingsError(
            f"hf_dtrain communication methods replace the gradient all-reduce of ZeRO stage 0; this engine "
            f"runs ZeRO stage {stage}, whose optimizer reduces gradients into its partitions itself. Set "
            "zero_optimization.stage to 0, or use DDP (Accelerate / Trainer without DeepSpeed)."
        )
    if config.method not in DEEPSPEED_METHODS:
        raise SettingsError(
            f"comm method {config.method!r} needs DDP's bucket schedule (forward pre-hooks or parameters "
            f"ignored by DDP); with DeepSpeed use one of {', '.join(DEEPSPEED_METHODS)}."
        )
    if engine.gradient_clipping():
        raise SettingsError(
            f"DeepSpeed's gradient_clipping={engine.gradient_clipping()} runs before the optimizer step, "
            "that is before this method averages the gradients; set gradient_clipping to 0."
        )
    if not math.isfinite(bucket_cap_mb) or bucket_cap_mb <= 0:
        raise SettingsError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}.")

    if world_size_of() < 2:
        raise SettingsError(
            "communication methods need a world of >= 2 processes; this one has 1 (launch with deepspeed "
            "/ torchrun --nproc_per_node >= 2)."
        )
    params = [p for p in engine.module.parameters() if p.requires_grad]
    if config.method == "allreduce":
        state, hook = DenseState(), dense_allreduce_hook
    elif config.method == "s2_reducer":
        # without error feedback here, whatever use_error_feedback says (as since this path was written)
        state = S2ReducerState.from_config(config, error_feedback=False)
        hook = s2_reducer_hook
    else:
        state = ACPSGDState.from_config(config)
        state.check_rank((n, p.shape) for n, p in engine.module.named_parameters() if p.requires_grad)
        hook = acp_sgd_hook
    buckets = _buckets(params, int(bucket_cap_mb * 2**20))

    def communicate(optimizer, args, kwargs):
        flats = [FlatBucket(i, b, last=i == len(buckets) - 1) for i, b in enumerate(buckets)]
        futures = [hook(state, flat) for flat in flats]
        for flat, fut in zip(flats, futures):
            flat.write_back(fut.wait())

    engine.enable_backward_allreduce = False
    state.deepspeed_hook_handle = engine.basic_optimizer.register_step_pre_hook(communicate)
    return state
