from __future__ import annotations

from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

from .._base import LinearTunerModel
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
