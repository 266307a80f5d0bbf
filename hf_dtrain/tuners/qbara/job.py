"""Q-BaRA in ``hf-dtrain finetune``: LoRA's rank and targets with the pooling factor ``qbara_pool``."""

from ..finetune_method import LORA_TARGETS, FinetuneMethod


def _config(cfg, model):
    from .config import QBaRAConfig

    return QBaRAConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, pool=cfg.qbara_pool,
                       target_modules=cfg.target_modules or LORA_TARGETS)


METHOD = FinetuneMethod("qbara", 4e-3, _config, quantized_bases=("nf4", "hqq4", "int4"))
