"""The surface shared by optimizers that wrap another torch optimizer (Eva, the decentralized optimizers): the wrapped
optimizer owns the parameter groups and the state, so LR schedulers, Accelerate, the Trainer and DeepSpeed see the
usual ``param_groups``/``state``/``zero_grad``, and the wrapper's own state travels under one extra key of
``state_dict()``."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from hf_dtrain.errors import SettingsError

BASE_OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW, "adam": torch.optim.Adam}


def closure_loss(closure):
    """``optimizer.step(closure)``'s closure run with gradients on (steps run under ``no_grad``): its loss, or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def build_base_optimizer(base_optimizer: str | Callable, params, owner: str, **kwargs) -> torch.optim.Optimizer:
    """``"sgd"``/``"adamw"``/``"adam"`` or a ``torch.optim.Optimizer`` class, built on ``params`` with ``kwargs``."""
    if isinstance(base_optimizer, str):
        if base_optimizer.lower() not in BASE_OPTIMIZERS:
            raise SettingsError(
                f"{owner} base_optimizer={base_optimizer!r} is unknown; use one of "
                f"{', '.join(BASE_OPTIMIZERS)} or a torch.optim.Optimizer class."
            )
        base_optimizer = BASE_OPTIMIZERS[base_optimizer.lower()]
    return base_optimizer(params, **kwargs)


class WrappedOptimizer(torch.optim.Optimizer):
    """Delegates groups, state, ``zero_grad`` and checkpoints to ``self.base``. Subclasses set ``self.base`` in their
    ``__init__`` (after calling ``_init_wrapper()``), implement ``step``, and put their own state in
    ``_wrapper_state()`` / ``_load_wrapper_state()`` (saved under ``state_key``)."""

    state_key = "wrapper"

    def _init_wrapper(self) -> None:
        # what torch.optim.Optimizer.__init__ would set up (hooks that schedulers and profilers may register)
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

    @property
    def param_groups(self):
        return self.base.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.base.param_groups = value

    @property
    def state(self):
        return self.base.state

    @property
    def defaults(self):
        return self.base.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        self.base.add_param_group(param_group)

    def _wrapper_state(self) -> dict:
        return {}

    def _load_wrapper_state(self, state: dict) -> None:
        pass

    def state_dict(self) -> dict:
        sd = self.base.state_dict()
        sd[self.state_key] = self._wrapper_state()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        own = state_dict.pop(self.state_key, None)
        self.base.load_state_dict(state_dict)
        if own is not None:
            self._load_wrapper_state(own)
