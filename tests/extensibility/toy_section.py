"""A section that lives outside hf_dtrain, written as another package would write one: a gradient-norm logger with
one setting (``--grad-norm.every``) and one declared clash. Nothing in ``hf_dtrain/`` names it.

It logs the global L2 norm of the gradients between backward and the optimizer step: from a Trainer callback in the
fine-tuning job (``on_pre_optimizer_step``), from the plain loop's ``before_optimizer_step`` hook in pretraining. It
refuses optimizers that exchange gradients themselves (1-bit LAMB, the gossip optimizers, DiLoCo): there it would
log one rank's local gradient and call it the job's."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from transformers import TrainerCallback

from hf_dtrain.run.section import Clash, Section, register_section
from hf_dtrain.settings import check_fields, setting

NAME = "grad_norm"
REFUSAL = "the gradient-norm logger would log one rank's local gradient"


@dataclass
class GradNormConfig:
    section_key: ClassVar[str] = NAME

    every: int = setting(1, "Log the gradient norm every this many optimizer steps.", min=1)

    def __post_init__(self):
        check_fields(self)


def _exchanging(view) -> str | None:
    if view.fact("exchanging"):
        return (
            f"--grad-norm with optimizer={view.cfg.optimizer}: that optimizer exchanges gradients itself, so "
            f"{REFUSAL}; drop --grad-norm or use another optimizer"
        )
    return None


def global_norm(model) -> float:
    grads = [p.grad.detach().float() for p in model.parameters() if p.grad is not None]
    return math.sqrt(sum(float(g.pow(2).sum()) for g in grads))


class _Callback(TrainerCallback):
    def __init__(self, section: GradNormSection):
        self.section = section

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.section.record(state.global_step + 1, model)


@register_section
class GradNormSection(Section):
    """``--grad-norm``: the global gradient norm before every ``every``-th optimizer step, in ``results.json``."""

    name = NAME
    order = 85
    clashes = (
        Clash(
            "`--grad-norm` with an optimizer that exchanges gradients itself",
            "it would log one rank's local gradient",
            _exchanging,
        ),
    )

    @classmethod
    def settings(cls):
        help = "Log the global gradient norm (a section defined outside hf_dtrain); None: off."
        return [(NAME, GradNormConfig | None, field(default=None, metadata={"help": help}))]

    @classmethod
    def empty_results(cls, trainer: bool) -> dict:
        return {NAME: None}

    def __init__(self, run) -> None:
        super().__init__(run)
        self.model, self.steps, self.norms, self.count = None, [], [], 0

    def record(self, step: int, model) -> None:
        if step % self.cfg.grad_norm.every == 0:
            self.steps.append(step)
            self.norms.append(global_norm(model))

    # the Trainer
    def callbacks(self) -> list:
        return [_Callback(self)]

    # a plain loop
    def prepare(self, model) -> None:
        self.model = model

    def before_optimizer_step(self) -> None:
        self.count += 1
        with torch.no_grad():
            self.record(self.count, self.model)

    def results(self) -> dict:
        return {NAME: {"every": self.cfg.grad_norm.every, "steps": self.steps, "norms": self.norms}}
