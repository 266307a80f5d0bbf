from __future__ import annotations

from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

from .._base import LinearTunerModel
from ..qahira.quant import Int4Linear
from .layer import Linear, QBaRALayer


class QBaRAModel(LinearTunerModel):
    """Injects Q-BaRA layers (``get_peft_model`` after ``import hf_dtrain``)."""

    prefix: str = "qbara_"
    tuner_layer_cls = QBaRALayer
    target_module_mapping = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    linear_cls = Linear
    method_name = "Q-BaRA"
    config_name = "QBaRAConfig"

    def _create_and_replace(self, config, adapter_name, target, target_name, parent, current_key, **kwargs):
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        if isinstance(base, Int4Linear) and not isinstance(target, Linear):
            new_module = Linear(target, adapter_name, config, layer_key=current_key)
            if adapter_name not in self.active_adapters:
                new_module.requires_grad_(False)
            self._replace_module(parent, target_name, new_module, target)
            return
        super()._create_and_replace(config, adapter_name, target, target_name, parent, current_key, **kwargs)
