"""LoRA-FA in ``hf-dtrain finetune``: LoRA's rank and targets, and hf_dtrain's LoRA-FA optimizer unless the job turns
it off (``--lorafa-optimizer false``)."""

from ..finetune_method import LORA_TARGETS, FinetuneMethod


def _config(cfg, model):
    from .config import LoraFAConfig

    return LoraFAConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules=cfg.target_modules or LORA_TARGETS,
                        lora_dropout=0.0)


def _optimizer(cfg, model, lr, weight_decay):
    if not cfg.lorafa_optimizer:
        return None
    from .optimizer import create_lorafa_optimizer

    return create_lorafa_optimizer(model, lr=lr, weight_decay=weight_decay)


METHOD = FinetuneMethod("lorafa", 4e-3, _config, quantized_bases=("nf4",), build_optimizer=_optimizer)
