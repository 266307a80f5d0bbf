"""The loss guard's section of the jobs (``--stop-on-nonfinite-loss``, on by default)."""

from __future__ import annotations

import math
from dataclasses import field

from hf_dtrain.errors import NONFINITE_OPT_OUT, non_finite_loss
from hf_dtrain.run.section import Section, register_section


@register_section
class NonFiniteLossSection(Section):
    """Stop with :class:`~hf_dtrain.errors.NonFiniteLoss` at the first NaN or infinite training or held-out loss."""

    name = "stop_on_nonfinite_loss"
    order = 90

    @classmethod
    def settings(cls):
        help = (
            "Stop the run with an error naming the step when the training or held-out loss becomes NaN or infinite "
            "(false: train on, as the Trainer does)."
        )
        return [("stop_on_nonfinite_loss", bool, field(default=True, metadata={"help": help}))]

    @classmethod
    def active(cls, view) -> bool:
        return bool(view.cfg.stop_on_nonfinite_loss)

    def callbacks(self) -> list:
        from .callback import NonFiniteLossCallback

        return [NonFiniteLossCallback()]

    def after_step(self, step: int, loss: float) -> None:
        if not math.isfinite(loss):
            raise non_finite_loss("training", loss, step, NONFINITE_OPT_OUT)

    def evaluated(self, loss: float | None, step: int) -> None:
        if loss is not None and not math.isfinite(loss):
            raise non_finite_loss("held-out", loss, step, NONFINITE_OPT_OUT)
