from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from hf_dtrain.errors import SettingsError

from ...quantization import adapter_dtype_and_device, check_quantized_base
from .._base import MergeableLinearMixin
from .._registry import register_folder


class QBaRALayer(BaseTunerLayer):
    adapter_layer_names = ("qbara_A", "qbara_B")
    other_param_names = ("r", "pool", "scaling")

    def __init__(self, base_layer: nn.Module, **kwargs) -> None:
        self.base_layer = base_layer
        self.qbara_A = nn.ParameterDict({})
        self.qbara_B = nn.ParameterDict({})
        self.r: dict[str, int] = {}
        self.pool: dict[str, int] = {}
        self.scaling: dict[str, float] = {}
        self._disable_adapters = False
        self.merged_adapters = []
        base = self.get_base_layer()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.kwargs = kwargs

    def update_layer(self, adapter_name: str, config, layer_key: str = "", inference_mode: bool = False) -> None:
        lam, r = config.pool, config.r
        for dim, name in ((self.in_features, "in_features"), (self.out_features, "out_features")):
            if dim % lam:
                raise SettingsError(
                    f"QBaRAConfig.pool={lam} does not divide {name}={dim} of {layer_key!r}; choose a "
                    "pooling factor that divides both dimensions of every target (the paper uses 2)."
                )
        self.r[adapter_name], self.pool[adapter_name] = r, lam
        self.scaling[adapter_name] = config.lora_alpha / r
        base = self.get_base_layer()
        if config.require_quantized_base:
            check_quantized_base(base, "QBaRAConfig", layer_key)
        dtype, device = adapter_dtype_and_device(base)
        a = torch.empty(lam * r, self.in_features // lam, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # as LoRA's A
        self.qbara_A[adapter_name] = nn.Parameter(a)
        self.qbara_B[adapter_name] = nn.Parameter(
            torch.zeros(self.out_features // lam, lam * r, device=device, dtype=dtype)
        )
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """Delta W = (s / lambda) * expand(B A): pooling averages lambda inputs (the 1/lambda) and the output is
        repeated; rows and columns of B A are each repeated lambda times. (The published merge script hard-codes 0.25
        here, i.e. s / lambda with s = 0.5: the constant depends on lora_alpha, r and lambda.)"""
        lam = self.pool[adapter]
        ba = self.qbara_B[adapter].float() @ self.qbara_A[adapter].float()
        ba = torch.repeat_interleave(torch.repeat_interleave(ba, lam, dim=0), lam, dim=1)
        return ba * (self.scaling[adapter] / lam)


class Linear(MergeableLinearMixin, nn.Module, QBaRALayer):
    """``y = base(x) + s * repeat_lambda(B A avgpool_lambda(x))`` on any linear base (nn.Linear, bitsandbytes 4-bit,
    HQQLinear, Int4Linear); merges into dense weights only (its update is not constant within quantization groups)."""

    # under torch.compile on a dense base the plain path: inductor fused its ops into a faster layer than the lean
    # function on CPU (per layer, bf16 autocast, 1,024 tokens, 768 -> 2048: 26.0 ms against 29.8); on a 4-bit
    # base the lean path stays (docs/fast.md; hf_dtrain.fast.paths.lean_when_compiled)
    compiled_plain_on_dense_base = True

    def __init__(self, base_layer: nn.Module, adapter_name: str, config, layer_key: str = "", **kwargs) -> None:
        super().__init__()
        QBaRALayer.__init__(self, base_layer, **kwargs)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, layer_key=layer_key)

    def _lean_factors(self, name: str):
        # s * repeat_lambda(B A pool_lambda(x)) = (s / lambda) * (x A_full^T) B_full^T with A's columns and B's rows
        # each repeated lambda times: the lean function makes the copies in the compute dtype (one op each way, the
        # cast included) and sums their gradients back; the pooling and the repeat ride on the two low-rank products.
        # Pooling the input explicitly measured slower on CPU at lambda 2 (a short strided reduction over the whole
        # activation, forward and backward)
        return self.qbara_A[name], self.qbara_B[name], self.scaling[name] / self.pool[name], None, self.pool[name]

    def _adapter_output(self, x: torch.Tensor, name: str) -> torch.Tensor:
        # Pooling lambda inputs and repeating each output lambda times are folded into the two small factors (A's
        # columns repeated over each pool and divided by lambda, B's rows repeated, the scaling on B): the same
        # s * repeat(B A pool(x)), as two rank-(lambda r) products on x like LoRA's, with no pooled or repeated
        # activation. Pooling x first and repeating the output made the step 1.4x slower on CPU (profiled in
        # docs/throughput.md): repeat_interleave's backward scatters a whole activation per layer.
        a, b, lam = self.qbara_A[name], self.qbara_B[name], self.pool[name]
        a_full = a.repeat_interleave(lam, dim=1) / lam  # (lambda r, in)
        b_full = b.repeat_interleave(lam, dim=0) * self.scaling[name]  # (out, lambda r)
        return F.linear(F.linear(x.to(a.dtype), a_full), b_full)

    def __repr__(self) -> str:
        return "qbara." + super().__repr__()


register_folder(__name__)
