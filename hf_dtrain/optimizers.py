"""The choices of the jobs' ``--optimizer``: each engine registers its optimizers here (``hf_dtrain/optim``: adamw,
Eva, 1-bit LAMB; ``hf_dtrain/decentralized``: D-PSGD, DecentLaM, DiLoCo), and the optimizer section
(:mod:`hf_dtrain.optim.section`) offers every registered choice, with its settings section (``--eva.*``) and what it
implies for the others (an optimizer that exchanges gradients itself runs under DDP's noop hook). Imports nothing
heavy: the builders import their engine when called."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OptimizerChoice:
    """One ``--optimizer`` value. ``build(settings, model, params, lr, weight_decay)`` returns the torch optimizer
    over ``params`` (the trainable parameters of the unwrapped ``model``); ``settings`` is its settings section (the
    job config's field named ``settings``, shared by choices that name the same one) or None. ``defaults``: the
    settings' config class, or an instance of it where the jobs' defaults differ from the engine's (each job gets a
    copy)."""

    name: str
    build: Callable[[Any, Any, list, float, float], Any]
    help: str = ""
    settings: str | None = None  # the job config field holding its settings ("eva", "gossip")
    defaults: Any = None
    settings_help: str = ""
    exchanges: bool = False  # it exchanges gradients or parameters itself: DDP runs the noop hook under it
    asynchronous: Callable[[Any], bool] = lambda settings: False  # DDP must not broadcast buffers in every forward
    order: int = 100

    @property
    def settings_type(self) -> type | None:
        if self.defaults is None or isinstance(self.defaults, type):
            return self.defaults
        return type(self.defaults)

    def default_settings(self) -> Any:
        """A fresh copy of the settings a job starts from."""
        if isinstance(self.defaults, type):
            return self.defaults()
        return dataclasses.replace(self.defaults)


OPTIMIZER_CHOICES: dict[str, OptimizerChoice] = {}


def register_optimizer(choice: OptimizerChoice) -> OptimizerChoice:
    """Make ``choice`` an ``--optimizer`` value of every job (idempotent: a name registered again is replaced)."""
    OPTIMIZER_CHOICES[choice.name] = choice
    ordered = sorted(OPTIMIZER_CHOICES.values(), key=lambda c: c.order)
    OPTIMIZER_CHOICES.clear()
    OPTIMIZER_CHOICES.update((c.name, c) for c in ordered)
    return choice
