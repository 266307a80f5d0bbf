"""Q-BaRA in ``hf-dtrain finetune``: LoRA's rank and targets with the pooling factor ``qbara.pool``."""

from dataclasses import dataclass, field

from hf_dtrain.settings import check_fields

from ..finetune_method import LORA_TARGETS, FinetuneMethod, register_finetune_method
from .config import QBaRAConfig


@dataclass
class QBaRAJobSettings:
    """Q-BaRA's settings in the fine-tuning job (``--qbara.*``; YAML ``qbara:``)."""

    section_key = "qbara"

    pool: int = field(default=2, metadata={"min": 1, "help": "Pooling/repeat factor lambda (rank lambda * lora_r)."})

    def __post_init__(self):

        check_fields(self)


def _config(cfg, model):

    return QBaRAConfig(
        r=cfg.lora_r, lora_alpha=cfg.lora_alpha, pool=cfg.qbara.pool, target_modules=cfg.target_modules or LORA_TARGETS
    )


METHOD = register_finetune_method(
    FinetuneMethod("qbara", 4e-3, _config, quantized_bases=("nf4", "hqq4", "int4"), settings=QBaRAJobSettings)
)
