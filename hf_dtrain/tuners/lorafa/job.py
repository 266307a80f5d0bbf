"""LoRA-FA in ``hf-dtrain finetune``: LoRA's rank and targets, and hf_dtrain's LoRA-FA optimizer unless the job turns
it off (``--lorafa.optimizer false``)."""

from dataclasses import dataclass, field

from hf_dtrain.settings import check_fields

from ..finetune_method import LORA_TARGETS, FinetuneMethod, register_finetune_method
from .config import LoraFAConfig
from .optimizer import create_lorafa_optimizer


@dataclass
class LoraFAJobSettings:
    """LoRA-FA's settings in the fine-tuning job (``--lorafa.*``; YAML ``lorafa:``)."""

    section_key = "lorafa"

    optimizer: bool = field(
        default=True,
        metadata={"help": "Use hf_dtrain's create_lorafa_optimizer instead of the Trainer's optimizer (--optim)."},
    )

    def __post_init__(self):

        check_fields(self)


def _config(cfg, model):

    return LoraFAConfig(
        r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules=cfg.target_modules or LORA_TARGETS, lora_dropout=0.0
    )


def _optimizer(cfg, model, lr, weight_decay):
    if not cfg.lorafa.optimizer:
        return None

    return create_lorafa_optimizer(model, lr=lr, weight_decay=weight_decay)


METHOD = register_finetune_method(
    FinetuneMethod(
        "lorafa", 4e-3, _config, quantized_bases=("nf4",), build_optimizer=_optimizer, settings=LoraFAJobSettings
    )
)
