from __future__ import annotations

from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from .._base import LinearTunerModel
from .layer import Linear, QAHiRALayer
from .quant import Int4Linear


class QAHiRAModel(LinearTunerModel):
    """Injects QA-HiRA layers into ``nn.Linear`` or ``Int4Linear`` targets (``get_peft_model`` after ``import
    hf_dtrain``). ``merge_and_unload`` on an Int4 base returns the same Int4 model with moved zero-points."""

    prefix: str = "qahr_"
    tuner_layer_cls = QAHiRALayer
    target_module_mapping = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    linear_cls = Linear
    method_name = "QA-HiRA"
    config_name = "QAHiRAConfig"

    def _create_and_replace(self, config, adapter_name, target, target_name, parent, current_key, **kwargs):
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        if isinstance(base, Int4Linear) and not isinstance(target, Linear):
            new_module = Linear(target, adapter_name, config, layer_key=current_key)
            if adapter_name not in self.active_adapters:
                new_module.requires_grad_(False)
            self._replace_module(parent, target_name, new_module, target)
            return
        super()._create_and_replace(config, adapter_name, target, target_name, parent, current_key, **kwargs)
