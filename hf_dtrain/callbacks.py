"""hf_dtrain's Trainer callbacks: thin adapters from Trainer events to engines that are testable without a Trainer."""

import math

import torch
from transformers import TrainerCallback

from hf_dtrain.comm.trainer import CommHookCallback
from hf_dtrain.errors import NONFINITE_OPT_OUT, non_finite_loss
from hf_dtrain.fault import InMemoryFaultToleranceCallback
from hf_dtrain.memory import DeltaCallback
from hf_dtrain.tuners.smt.selection import SMTSelectionCallback


class NonFiniteLossCallback(TrainerCallback):
    """Stops training with :class:`~hf_dtrain.errors.NonFiniteLoss` at the first optimizer step whose loss was NaN
    or infinite, and at an evaluation whose ``eval_loss`` is. The Trainer itself trains on: its
    ``logging_nan_inf_filter`` even hides such losses from the logs. A forward hook on the model folds each loss into
    a flag on the loss's device (no host sync per forward); ``on_step_end`` reads it once per optimizer step."""

    def __init__(self, opt_out: str = NONFINITE_OPT_OUT):
        self.opt_out = opt_out
        self._flag, self._value, self._handle = None, None, None

    def _hook(self, module, args, output):
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if isinstance(loss, torch.Tensor) and module.training:
            bad = ~torch.isfinite(loss.detach()).all()
            if self._flag is None or self._flag.device != bad.device:
                self._flag, self._value = bad, loss.detach().float().reshape(-1)[:1]
            else:
                self._value = torch.where(bad & ~self._flag, loss.detach().float().reshape(-1)[:1], self._value)
                self._flag = self._flag | bad

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and self._handle is None:
            self._handle = model.register_forward_hook(self._hook)

    def on_step_end(self, args, state, control, **kwargs):
        if self._flag is not None and bool(self._flag):
            value = float(self._value.item())
            self._flag = None
            raise non_finite_loss("training", value, state.global_step, self.opt_out)
        self._flag = None

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        value = (metrics or {}).get("eval_loss")
        if isinstance(value, float) and not math.isfinite(value):
            raise non_finite_loss("held-out", value, state.global_step, self.opt_out)

    def on_train_end(self, args, state, control, **kwargs):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


__all__ = [
    "CommHookCallback",
    "DeltaCallback",
    "InMemoryFaultToleranceCallback",
    "NonFiniteLossCallback",
    "SMTSelectionCallback",
]
