"""The Trainer's half of the loss guard: :class:`NonFiniteLossCallback`."""

import math

import torch
from transformers import TrainerCallback

from hf_dtrain.errors import NONFINITE_OPT_OUT, non_finite_loss


class NonFiniteLossCallback(TrainerCallback):
    """Stops training with :class:`~hf_dtrain.errors.NonFiniteLoss` at the first optimizer step whose loss was NaN
    or infinite, and at an evaluation whose ``eval_loss`` is. The Trainer itself trains on: its
    ``logging_nan_inf_filter`` even hides such losses from the logs. A forward hook keeps each training forward's
    loss (detached, no host sync); ``on_step_end`` checks them in one reduction per optimizer step."""

    def __init__(self, opt_out: str = NONFINITE_OPT_OUT):
        self.opt_out = opt_out
        self._losses: list[torch.Tensor] = []
        self._handle = None

    def _hook(self, module, args, output):
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if module.training and isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach().reshape(-1)[:1])

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and self._handle is None:
            self._handle = model.register_forward_hook(self._hook)

    def on_step_end(self, args, state, control, **kwargs):
        losses, self._losses = self._losses, []
        if not losses:
            return
        values = torch.cat([v.float() for v in losses])
        if not bool(torch.isfinite(values).all()):
            bad = values[~torch.isfinite(values)][0].item()
            raise non_finite_loss("training", bad, state.global_step, self.opt_out)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        value = (metrics or {}).get("eval_loss")
        if isinstance(value, float) and not math.isfinite(value):
            raise non_finite_loss("held-out", value, state.global_step, self.opt_out)

    def on_train_end(self, args, state, control, **kwargs):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
