from __future__ import annotations

import torch
import torch.nn.functional as F
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from .._base import MergeableLinearMixin
from .quant import Int4Linear


class QAHiRALayer(BaseTunerLayer):
    adapter_layer_names = ("qahr_A",)
    other_param_names = ("group_size", "lambda_out", "scaling")

    def __init__(self, base_layer: nn.Module, **kwargs) -> None:
        self.base_layer = base_layer
        self.qahr_A = nn.ParameterDict({})
        self.group_size: dict[str, int] = {}
        self.lambda_out: dict[str, int] = {}
        self.scaling: dict[str, float] = {}
        self._disable_adapters = False
        self.merged_adapters = []
        base = self.get_base_layer()
        if not isinstance(base, (nn.Linear, Int4Linear)):
            raise TypeError(f"QA-HiRA adapts nn.Linear or Int4Linear layers, got {type(base).__name__}.")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.kwargs = kwargs

    def update_layer(self, adapter_name: str, config, layer_key: str = "", inference_mode: bool = False) -> None:
        g, lam = config.group_size, config.lambda_out
        if self.in_features % g:
            raise ValueError(f"QAHiRAConfig.group_size={g} does not divide in_features={self.in_features} of "
                             f"{layer_key!r}; use the base's quantization group size (a divisor of in_features).")
        if self.out_features % lam:
            raise ValueError(f"QAHiRAConfig.lambda_out={lam} does not divide out_features={self.out_features} of "
                             f"{layer_key!r}; choose a divisor of out_features.")
        base = self.get_base_layer()
        if isinstance(base, Int4Linear) and base.group_size != g:
            raise ValueError(f"QAHiRAConfig.group_size={g} differs from the quantization group size "
                             f"{base.group_size} of {layer_key!r}; set group_size={base.group_size} so the update "
                             "is constant within each quantization group (needed for the exact merge).")
        self.group_size[adapter_name], self.lambda_out[adapter_name] = g, lam
        self.scaling[adapter_name] = float(config.scaling)
        device = base.qweight.device if isinstance(base, Int4Linear) else base.weight.device
        dtype = torch.float32 if isinstance(base, Int4Linear) else base.weight.dtype
        self.qahr_A[adapter_name] = nn.Parameter(torch.zeros(self.out_features // lam, self.in_features // g,
                                                             device=device, dtype=dtype))
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    def group_update(self, adapter: str) -> torch.Tensor:
        """The update as one value per (output row, input group): ``(out, in / group_size)``."""
        a = self.qahr_A[adapter].float()
        return torch.repeat_interleave(a, self.lambda_out[adapter], dim=0) * (self.scaling[adapter] / self.group_size[adapter])

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        return torch.repeat_interleave(self.group_update(adapter), self.group_size[adapter], dim=1)


class Linear(MergeableLinearMixin, nn.Module, QAHiRALayer):
    """``y = base(x) + scaling * repeat_out(A @ avgpool_g(x))``; exact merge into an ``Int4Linear`` base."""

    def __init__(self, base_layer: nn.Module, adapter_name: str, config, layer_key: str = "", **kwargs) -> None:
        super().__init__()
        QAHiRALayer.__init__(self, base_layer, **kwargs)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, layer_key=layer_key)

    def _merge_one(self, adapter: str, sign: float, safe_merge: bool = False) -> None:
        base = self.get_base_layer()
        if isinstance(base, Int4Linear):  # exact: only the zero-points move
            update = self.group_update(adapter)
            if safe_merge and not torch.isfinite(update).all():
                raise ValueError(f"NaNs in adapter {adapter!r}; refusing to merge.")
            base.fold_group_constant_update(update, sign=sign)
        else:
            super()._merge_one(adapter, sign, safe_merge)

    def _adapter_output(self, x: torch.Tensor, name: str) -> torch.Tensor:
        a, g = self.qahr_A[name], self.group_size[name]
        pooled = x.to(a.dtype).unflatten(-1, (self.in_features // g, g)).mean(-1)
        return torch.repeat_interleave(F.linear(pooled, a), self.lambda_out[name], dim=-1) * self.scaling[name]

    def __repr__(self) -> str:
        return "qahira." + super().__repr__()
