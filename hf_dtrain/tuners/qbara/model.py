from __future__ import annotations

from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

from .._base import LinearTunerModel
from .layer import Linear, QBaRALayer


class QBaRAModel(LinearTunerModel):
    """Injects Q-BaRA layers (``get_peft_model`` after ``import hf_dtrain``)."""

    prefix: str = "qbara_"
    tuner_layer_cls = QBaRALayer
    target_module_mapping = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    linear_cls = Linear
    method_name = "Q-BaRA"
    config_name = "QBaRAConfig"
    quantized_bases = True
