from __future__ import annotations

from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

from .._base import LinearTunerModel
from .._registry import register, register_folder
from . import config
from .layer import Linear, QAHiRALayer


class QAHiRAModel(LinearTunerModel):
    """Injects QA-HiRA layers into ``nn.Linear``, bitsandbytes 4-bit, ``HQQLinear`` or ``Int4Linear`` targets
    (``get_peft_model`` after ``import hf_dtrain``). ``merge_and_unload`` on an HQQ or Int4 base returns the same 4-bit
    model with moved zero-points."""

    prefix: str = "qahr_"
    tuner_layer_cls = QAHiRALayer
    target_module_mapping = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    linear_cls = Linear
    method_name = "QA-HiRA"
    config_name = "QAHiRAConfig"
    quantized_bases = True


def register_with_peft() -> None:
    """Make qahira known to peft (idempotent: a reloaded config module's class replaces the old one)."""
    register("qahira", config.QAHiRAConfig, QAHiRAModel, prefix="qahr_")


register_folder(__name__)
