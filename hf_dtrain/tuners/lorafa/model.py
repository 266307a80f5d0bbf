from __future__ import annotations

import torch
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

from .layer import Linear, LoraFALayer


class LoraFAModel(BaseTuner):
    """Injects LoRA-FA layers into the ``nn.Linear`` targets of a model. Use through ``get_peft_model``::

        import hf_dtrain  # registers LORAFA with peft
        model = get_peft_model(base, LoraFAConfig(r=8, target_modules=["q_proj", "v_proj"]))
    """

    prefix: str = "lorafa_"
    tuner_layer_cls = LoraFALayer
    target_module_mapping = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    def _create_and_replace(self, config, adapter_name, target, target_name, parent, current_key, **kwargs):
        if current_key is None:
            raise ValueError("current_key must not be None")
        if isinstance(target, Linear):
            target.update_layer(adapter_name, config, layer_key=current_key)
            return
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        if not isinstance(base, torch.nn.Linear):
            raise TypeError(
                f"LoRA-FA can adapt nn.Linear layers only; {current_key!r} is {type(base).__name__}. "
                "Narrow LoraFAConfig.target_modules to linear projections."
            )
        new_module = Linear(target, adapter_name, config, layer_key=current_key)
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)
        self._replace_module(parent, target_name, new_module, target)
