from __future__ import annotations

from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

from .._base import LinearTunerModel
from .._registry import register, register_folder
from . import config
from .layer import Linear, LoraFALayer


class LoraFAModel(LinearTunerModel):
    """Injects LoRA-FA layers into the ``nn.Linear`` targets of a model. Use through ``get_peft_model``::

    import hf_dtrain  # registers LORAFA with peft
    model = get_peft_model(base, LoraFAConfig(r=8, target_modules=["q_proj", "v_proj"]))
    """

    prefix: str = "lorafa_"
    tuner_layer_cls = LoraFALayer
    target_module_mapping = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    linear_cls = Linear
    method_name = "LoRA-FA"
    config_name = "LoraFAConfig"


def register_with_peft() -> None:
    """Make lorafa known to peft (idempotent: a reloaded config module's class replaces the old one)."""
    register("lorafa", config.LoraFAConfig, LoraFAModel, prefix="lorafa_")


register_folder(__name__)
