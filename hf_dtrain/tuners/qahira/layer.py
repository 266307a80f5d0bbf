from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from hf_dtrain.errors import SettingsError, UnsupportedTarget

from ...fast import paths as fast_paths
from ...quantization import (
    adapter_dtype_and_device,
    check_quantized_base,
    hqq_fold_group_constant_update,
    quantized_base_types,
    quantized_kind,
)
from .._base import MergeableLinearMixin
from .._registry import register_folder


class QAHiRALayer(BaseTunerLayer):
    adapter_layer_names = ("qahr_A", "qahr_B")
    other_param_names = ("group_size", "lambda_out", "scaling")

    def __init__(self, base_layer: nn.Module, **kwargs) -> None:
        self.base_layer = base_layer
        self.qahr_A = nn.ParameterDict({})
        self.qahr_B = nn.ParameterDict({})  # only for adapters with a rank (QA-LoRA)
        self.group_size: dict[str, int] = {}
        self.lambda_out: dict[str, int] = {}
        self.scaling: dict[str, float] = {}
        self._disable_adapters = False
        self.merged_adapters = []
        base = self.get_base_layer()
        if not isinstance(base, (nn.Linear, *quantized_base_types())):
            raise UnsupportedTarget(
                f"QA-HiRA adapts nn.Linear, bitsandbytes 4-bit, HQQLinear or Int4Linear layers, got "
                f"{type(base).__name__}."
            )
        self.in_features, self.out_features = base.in_features, base.out_features
        self.kwargs = kwargs

    def update_layer(self, adapter_name: str, config, layer_key: str = "", inference_mode: bool = False) -> None:
        g, lam = config.group_size, config.lambda_out
        if self.in_features % g:
            raise SettingsError(
                f"QAHiRAConfig.group_size={g} does not divide in_features={self.in_features} of "
                f"{layer_key!r}; use the base's quantization group size (a divisor of in_features)."
            )
        if self.out_features % lam:
            raise SettingsError(
                f"QAHiRAConfig.lambda_out={lam} does not divide out_features={self.out_features} of "
                f"{layer_key!r}; choose a divisor of out_features."
            )
        base = self.get_base_layer()
        kind = quantized_kind(base)
        if config.require_quantized_base:
            check_quantized_base(base, "QAHiRAConfig", layer_key)
        base_group = {"int4": lambda: base.group_size, "hqq4": lambda: int(base.meta["group_size"])}.get(kind)
        if base_group is not None and base_group() != g:
            raise SettingsError(
                f"QAHiRAConfig.group_size={g} differs from the quantization group size "
                f"{base_group()} of {layer_key!r}; set group_size={base_group()} so the update "
                "is constant within each quantization group (needed for the exact merge)."
            )
        self.group_size[adapter_name], self.lambda_out[adapter_name] = g, lam
        self.scaling[adapter_name] = float(config.scaling)
        dtype, device = adapter_dtype_and_device(base)
        rows, cols = self.out_features // lam, self.in_features // g
        if config.r is None:
            self.qahr_A[adapter_name] = nn.Parameter(torch.zeros(rows, cols, device=device, dtype=dtype))
        else:  # QA-LoRA: B @ A with B = 0, A as LoRA's A
            a = torch.empty(config.r, cols, device=device, dtype=dtype)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            self.qahr_A[adapter_name] = nn.Parameter(a)
            self.qahr_B[adapter_name] = nn.Parameter(torch.zeros(rows, config.r, device=device, dtype=dtype))
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    def _matrix(self, adapter: str) -> torch.Tensor:
        """The ``(out / lambda_out, in / group_size)`` matrix: ``qahr_A``, or ``qahr_B @ qahr_A`` with a rank."""
        a = self.qahr_A[adapter].float()
        return self.qahr_B[adapter].float() @ a if adapter in self.qahr_B else a

    def group_update(self, adapter: str) -> torch.Tensor:
        """The update as one value per (output row, input group): ``(out, in / group_size)``."""
        m = torch.repeat_interleave(self._matrix(adapter), self.lambda_out[adapter], dim=0)
        return m * (self.scaling[adapter] / self.group_size[adapter])

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        return torch.repeat_interleave(self.group_update(adapter), self.group_size[adapter], dim=1)


class Linear(MergeableLinearMixin, nn.Module, QAHiRALayer):
    """``y = base(x) + scaling * repeat_out(A @ avgpool_g(x))`` (``B @ A`` with a rank); exact merge into an
    ``Int4Linear`` or HQQ base, dense merge into a float base; a bitsandbytes NF4 base cannot take a merge."""

    # under torch.compile on a dense base the plain path: inductor fused its ops into a faster layer than the lean
    # function on CPU (per layer, bf16 autocast, 1,024 tokens, 768 -> 2048: 24.3 ms against 32.6); on a 4-bit
    # base the lean path stays (docs/fast.md; hf_dtrain.fast.paths.lean_when_compiled)
    compiled_plain_on_dense_base = True

    def __init__(self, base_layer: nn.Module, adapter_name: str, config, layer_key: str = "", **kwargs) -> None:
        super().__init__()
        QAHiRALayer.__init__(self, base_layer, **kwargs)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, layer_key=layer_key)

    def _merge_one(self, adapter: str, sign: float, safe_merge: bool = False) -> None:
        base = self.get_base_layer()
        kind = quantized_kind(base)
        if kind in ("int4", "hqq4"):  # exact: only the zero-points move
            update = self.group_update(adapter)
            if safe_merge and not torch.isfinite(update).all():
                raise SettingsError(f"NaNs in adapter {adapter!r}; refusing to merge.")
            if kind == "int4":
                base.fold_group_constant_update(update, sign=sign)
            else:
                hqq_fold_group_constant_update(base, update, sign=sign)
        else:
            super()._merge_one(adapter, sign, safe_merge)

    def _lean_call(self, x: torch.Tensor, args, kwargs, name: str) -> torch.Tensor | None:
        a, b = self.qahr_A[name], self.qahr_B.get(name)
        g, lam = self.group_size[name], self.lambda_out[name]
        return fast_paths.pooled_forward(self, x, args, kwargs, a, b, g, lam, self.scaling[name])

    def _adapter_output(self, x: torch.Tensor, name: str) -> torch.Tensor:
        a, g = self.qahr_A[name], self.group_size[name]
        h = F.linear(x.to(a.dtype).unflatten(-1, (self.in_features // g, g)).mean(-1), a)
        if name in self.qahr_B:
            h = F.linear(h, self.qahr_B[name])
        return torch.repeat_interleave(h, self.lambda_out[name], dim=-1) * self.scaling[name]

    def __repr__(self) -> str:
        return "qahira." + super().__repr__()


register_folder(__name__)
