from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from peft.tuners._buffer_dict import BufferDict
from peft.tuners.tuners_utils import BaseTunerLayer, _get_in_out_features
from torch import nn

from hf_dtrain.errors import SettingsError, UnsupportedTarget

from ...quantization import adapter_dtype_and_device
from .._base import MergeableLinearMixin
from .._registry import register_folder


class LoraFALayer(BaseTunerLayer):
    """LoRA-FA adapter state: frozen ``lorafa_A`` (a persistent buffer, so it is saved but can never train) and
    trainable ``lorafa_B`` per adapter name."""

    adapter_layer_names = ("lorafa_B",)
    other_param_names = ("lorafa_A", "r", "lora_alpha", "scaling", "lorafa_dropout")

    def __init__(self, base_layer: nn.Module, **kwargs) -> None:
        self.base_layer = base_layer
        self.r: dict[str, int] = {}
        self.lora_alpha: dict[str, float] = {}
        self.scaling: dict[str, float] = {}
        self.lorafa_dropout = nn.ModuleDict({})
        self.lorafa_A = BufferDict({}, persistent=True)
        self.lorafa_B = nn.ParameterDict({})
        self._disable_adapters = False
        self.merged_adapters = []
        self.in_features, self.out_features = _get_in_out_features(self.get_base_layer())
        if self.in_features is None:
            raise UnsupportedTarget(
                f"LoRA-FA supports nn.Linear targets only, got {type(self.get_base_layer()).__name__}."
            )
        self.kwargs = kwargs

    def update_layer(self, adapter_name: str, config, layer_key: str = "", inference_mode: bool = False) -> None:
        r = config.r
        if r > min(self.in_features, self.out_features):
            raise SettingsError(
                f"LoraFAConfig.r={r} exceeds min(in_features, out_features)={min(self.in_features, self.out_features)} "
                f"of {layer_key or 'a target layer'}; lower r."
            )
        self.r[adapter_name] = r
        self.lora_alpha[adapter_name] = config.lora_alpha
        self.scaling[adapter_name] = config.lora_alpha / (math.sqrt(r) if config.use_rslora else r)
        self.lorafa_dropout[adapter_name] = (
            nn.Dropout(config.lora_dropout) if config.lora_dropout > 0 else nn.Identity()
        )

        dtype, device = adapter_dtype_and_device(self.get_base_layer())
        a = torch.empty(r, self.in_features, dtype=torch.float32)
        if config.init_seed is None:
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        else:
            gen = torch.Generator().manual_seed(config.init_seed + zlib.crc32(layer_key.encode()) % (2**31))
            bound = 1.0 / math.sqrt(self.in_features)  # kaiming_uniform_(a=sqrt(5)) bound, as nn.Linear and LoRA
            a.uniform_(-bound, bound, generator=gen)
        self.lorafa_A[adapter_name] = a.to(device=device, dtype=dtype)
        self.lorafa_B[adapter_name] = nn.Parameter(torch.zeros(self.out_features, r, device=device, dtype=dtype))
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        a = self.lorafa_A[adapter]
        b = self.lorafa_B[adapter]
        return (b.float() @ a.float()).mul_(self.scaling[adapter])


class Linear(MergeableLinearMixin, nn.Module, LoraFALayer):
    """An ``nn.Linear`` with LoRA-FA adapters: ``y = W x + b + s * B (dropout(A x))`` with ``A`` frozen."""

    def __init__(self, base_layer: nn.Module, adapter_name: str, config, layer_key: str = "", **kwargs) -> None:
        super().__init__()
        LoraFALayer.__init__(self, base_layer, **kwargs)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, layer_key=layer_key)

    def _lean_factors(self, name: str):
        return self.lorafa_A[name], self.lorafa_B[name], self.scaling[name], self.lorafa_dropout[name]

    def _adapter_output(self, x: torch.Tensor, name: str) -> torch.Tensor:
        # The base weight is frozen, so autograd keeps W (a parameter) rather than x for the base matmul; A is a
        # buffer, so x @ A.T keeps A rather than x. Only the r-dim projection is saved, for B's gradient.
        # A is a buffer, so engines that cast parameters (FSDP2's MixedPrecisionPolicy gathers B in bf16) leave it
        # in its own dtype: each product runs in its weight's dtype
        a, b = self.lorafa_A[name], self.lorafa_B[name]
        h = self.lorafa_dropout[name](F.linear(x.to(a.dtype), a))
        return F.linear(h.to(b.dtype), b) * self.scaling[name]

    def __repr__(self) -> str:
        return "lorafa." + super().__repr__()


register_folder(__name__)
