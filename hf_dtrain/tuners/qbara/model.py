from __future__ import annotations

from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

from .._base import LinearTunerModel
from .._registry import register, register_folder
from . import config
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


def register_with_peft() -> None:
    """Make qbara known to peft (idempotent: a reloaded config module's class replaces the old one)."""
    register("qbara", config.QBaRAConfig, QBaRAModel, prefix="qbara_")


register_folder(__name__)
