"""A tuner that lives outside hf_dtrain, written as another package would write one: a peft config, a layer and a
model, registered with peft, and its entry for the jobs (a :class:`FinetuneMethod` with a settings section and a
fused form). Nothing in ``hf_dtrain/`` names it.

The method ("toylr"): ``y = W x + s * B (A x)`` with both ``A (r, in)`` and ``B (out, r)`` trained, ``B`` starting at
zero and ``s = scale * alpha / r`` where ``scale`` is its own setting (``--toylr.scale``)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from peft.tuners.tuners_utils import BaseTunerLayer, _get_in_out_features
from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from torch import nn

from hf_dtrain.settings import check_fields, setting
from hf_dtrain.tuners import HfDtrainPeftConfig, LinearTunerModel, MergeableLinearMixin, register_peft_tuner
from hf_dtrain.tuners.finetune_method import FinetuneMethod, LowRankForm, register_finetune_method

NAME = "toylr"


@dataclass
class ToyConfig(HfDtrainPeftConfig):
    peft_type_name = "TOYLR"

    r: int = setting(4, "Rank of A and B.")
    alpha: float = setting(8.0, "The update is scale * alpha / r * B A.")
    scale: float = setting(1.0, "Extra factor on the update.")
    target_modules: list[str] | str | None = setting(None, "Linear layers to adapt (default: LLaMA's projections).")

    def __post_init__(self):
        super().__post_init__()
        self.positive_ints("r")


class ToyLayer(BaseTunerLayer):
    adapter_layer_names = ("toylr_A", "toylr_B")
    other_param_names = ("r", "scaling")

    def __init__(self, base_layer: nn.Module, **kwargs) -> None:
        self.base_layer = base_layer
        self.r, self.scaling = {}, {}
        self.toylr_A = nn.ParameterDict({})
        self.toylr_B = nn.ParameterDict({})
        self._disable_adapters = False
        self.merged_adapters = []
        self.in_features, self.out_features = _get_in_out_features(self.get_base_layer())
        self.kwargs = kwargs

    def update_layer(self, adapter_name: str, config: ToyConfig, layer_key: str = "", inference_mode=False) -> None:
        weight = self.get_base_layer().weight
        self.r[adapter_name] = config.r
        self.scaling[adapter_name] = config.scale * config.alpha / config.r
        a = torch.empty(config.r, self.in_features)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        self.toylr_A[adapter_name] = nn.Parameter(a.to(weight.device))
        self.toylr_B[adapter_name] = nn.Parameter(torch.zeros(self.out_features, config.r, device=weight.device))
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        return (self.toylr_B[adapter] @ self.toylr_A[adapter]) * self.scaling[adapter]


class ToyLinear(MergeableLinearMixin, nn.Module, ToyLayer):
    def __init__(self, base_layer: nn.Module, adapter_name: str, config: ToyConfig, layer_key: str = "", **kwargs):
        super().__init__()
        ToyLayer.__init__(self, base_layer, **kwargs)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, config, layer_key=layer_key)

    def _adapter_output(self, x: torch.Tensor, name: str) -> torch.Tensor:
        a, b = self.toylr_A[name], self.toylr_B[name]
        return F.linear(F.linear(x.to(a.dtype), a), b) * self.scaling[name]


class ToyModel(LinearTunerModel):
    prefix: str = "toylr_"
    tuner_layer_cls = ToyLayer
    target_module_mapping = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    linear_cls = ToyLinear
    method_name = "toylr"
    config_name = "ToyConfig"


@dataclass
class ToySettings:
    """The method's own section of the fine-tuning job (``--toylr.*``)."""

    section_key: ClassVar[str] = NAME

    scale: float = setting(1.0, "Extra factor on the update (s = scale * alpha / r).", gt=0)

    def __post_init__(self):
        check_fields(self)


def _build_config(adapter, settings: ToySettings, model) -> ToyConfig:
    return ToyConfig(r=adapter.r, alpha=adapter.alpha, scale=settings.scale, target_modules=adapter.targets())


METHOD = FinetuneMethod(
    NAME,
    4e-3,
    _build_config,
    settings=ToySettings,
    peft_type="TOYLR",
    fused=LowRankForm(factors=lambda layer, name: (layer.toylr_A[name], layer.toylr_B[name])),
    order=90,
)
# the same method declaring that it cannot be fused (the sweep refuses it with this reason)
NOT_FUSABLE = "toylr keeps its A and B in a layout the fused engine cannot stack (a test's declaration)"


def register(fused: bool = True) -> FinetuneMethod:
    """Register the method with peft and the jobs (idempotent)."""
    register_peft_tuner(NAME, ToyConfig, ToyModel, prefix="toylr_")
    return register_finetune_method(METHOD if fused else dataclasses.replace(METHOD, fused=NOT_FUSABLE))
