"""DELTA's scheduler on a model (:class:`DeltaScheduler`, :func:`apply_delta`) and its Trainer callback
(:class:`DeltaCallback`): profile a step, plan for the budget, run every later step under the plan."""

from __future__ import annotations

import logging

import torch
from torch import nn
from transformers import TrainerCallback

from .config import DeltaConfig
from .executor import DeltaExecutor, FileTier, PinnedTier
from .planner import Plan, make_plan, minimum_budget
from .profiler import Profile, measure_tier_bandwidth, plan_units

logger = logging.getLogger(__name__)


class DeltaScheduler:
    """Wraps ``model.forward``: the first training step at each new input shape is the profiling step (it runs with
    everything kept and is measured as it runs), after which a plan is made for the budget and every later training
    forward at that shape runs under it. ``plans`` maps shapes to plans; ``executor.stats.history`` has
    the measured saved and offloaded bytes of every step."""

    def __init__(self, model: nn.Module, config: DeltaConfig | int | float | None = None, tier=None, **overrides):
        self.config = DeltaConfig.from_any(config, **overrides)
        self.model = model
        device = next(model.parameters()).device
        self.overlap = device.type == "cuda"  # a side stream overlaps the copies with compute
        self.tier = tier or (PinnedTier(device) if self.overlap else FileTier())
        self.executor = DeltaExecutor(model, plan_units(model, self.config.granularity), self.tier)
        self.plans: dict[tuple, Plan] = {}
        self._replanned: set = set()
        self.bandwidth = measure_tier_bandwidth(self.tier)
        self._orig_forward = model.forward
        model.forward = self._forward

    @property
    def layers(self) -> list:
        """The planning units (name, module), in the order the profiling step ran them."""
        return self.executor.layers

    def budget_bytes(self, profile: Profile) -> int:
        return self.config.budget_bytes(profile.total_saved_bytes)

    def _shape(self, args, kwargs) -> tuple:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not torch.is_tensor(ids):
            ids = kwargs.get("inputs_embeds")
        return tuple(ids.shape) if torch.is_tensor(ids) else ()

    def _forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self._orig_forward(*args, **kwargs)
        shape = self._shape(args, kwargs)
        if shape not in self.plans:
            # the profiling step: this training step itself, everything kept, measured as it runs (no extra step,
            # no backward inside the forward, so DDP and gradient accumulation see an ordinary step)
            self.executor.set_plan({})
            self.executor.begin_step(profile=True)
            with self.executor.hooks():
                out = self._orig_forward(*args, **kwargs)
            self.executor.end_step()
            profile = self.executor.profile(shape, self.bandwidth)
            self.plans[shape] = make_plan(
                profile,
                self.budget_bytes(profile),
                self.config.method,
                self.config.allow_offload,
                overlap=self.overlap,
                objective=self.config.objective,
            )
            logger.info("DELTA plan for input shape %s:\n%s", shape, self.plans[shape].table())
            return out
        plan = self.plans[shape]
        self.executor.set_plan(plan.actions)
        self.executor.begin_step()
        with self.executor.hooks():
            out = self._orig_forward(*args, **kwargs)
        self.executor.end_step()
        measured = self.executor.stats.saved_bytes
        if measured > plan.budget and shape not in self._replanned:
            # measured above the budget (the profile under-predicted): plan again with the excess taken off, once
            self._replanned.add(shape)
            excess = measured - plan.predicted_bytes
            config = self.config
            corrected = make_plan(
                plan.profile,
                max(minimum_budget(plan.profile, config.allow_offload), plan.budget - excess),
                config.method,
                config.allow_offload,
                overlap=self.overlap,
                objective=config.objective,
            )
            corrected.budget = plan.budget
            self.plans[shape] = corrected
            logger.warning(
                "DELTA: %d bytes saved against a budget of %d for shape %s; re-planned.", measured, plan.budget, shape
            )
        return out

    def remove(self) -> None:
        """Restore the model's forward and layers and delete the offload tier."""
        self.model.forward = self._orig_forward
        self.executor.remove()
        if hasattr(self.tier, "close"):
            self.tier.close()


class _NoTier:
    """The offload tier of a profile that offloads nothing (:func:`plan_from_trace`)."""

    live = frozenset()  # nothing waits for its backward

    def reset(self) -> None:
        pass


def plan_from_trace(model: nn.Module, forward, config: DeltaConfig | int | float) -> Plan:
    """DELTA's plan for the step whose forward ``forward()`` runs, made before any step runs: the bytes each unit
    saves are counted as that forward runs (on a model of fake tensors, a memory trace's, nothing is allocated),
    and the budget is checked against them. Raises :class:`~hf_dtrain.errors.SettingsError` naming the smallest
    budget that can be met when the budget cannot. The forward times are not measured (on fake tensors they mean
    nothing): the plan's bytes are the run's, its choice between recomputing and offloading a unit may not be."""
    config = DeltaConfig.from_any(config)
    executor = DeltaExecutor(model, plan_units(model, config.granularity), _NoTier())
    try:
        executor.begin_step(profile=True)
        with executor.hooks():
            forward()
        executor.end_step()
    finally:
        executor.remove()
    profile = executor.profile((), bandwidth=1.0)
    return make_plan(
        profile,
        config.budget_bytes(profile.total_saved_bytes),
        config.method,
        config.allow_offload,
        objective=config.objective,
    )


def apply_delta(model: nn.Module, config: DeltaConfig | int | float | None = None, **overrides) -> DeltaScheduler:
    """DELTA on ``model`` for Accelerate and custom loops (call before ``accelerator.prepare``, or on the unwrapped
    model); ``config`` is a :class:`DeltaConfig` or a budget (``apply_delta(model, 0.5, granularity="submodule")``).
    Returns the scheduler (``.plans``, ``.executor.stats``, ``.remove()``)."""
    return DeltaScheduler(model, config, **overrides)


class DeltaCallback(TrainerCallback):
    """``Trainer(..., callbacks=[DeltaCallback(DeltaConfig(budget=0.5))])`` (or ``DeltaCallback(0.5)``): DELTA on the
    Trainer's model from ``on_train_begin`` to ``on_train_end``. The config is validated here, before training."""

    def __init__(self, config: DeltaConfig | int | float | None = None, **overrides):
        self.config = DeltaConfig.from_any(config, **overrides)
        self.scheduler: DeltaScheduler | None = None
        self.history: list = []
        self.budgets: dict = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.scheduler is None:
            self.scheduler = DeltaScheduler(model, self.config)

    def on_train_end(self, args, state, control, **kwargs):
        if self.scheduler is not None:
            # kept for reports after the run: every step's measured bytes, and the budget of each shape's plan
            self.history = list(self.scheduler.executor.stats.history)
            self.budgets = {str(k): p.budget for k, p in self.scheduler.plans.items()}
            self.scheduler.remove()
            self.scheduler = None
