"""LoRA-FA in the jobs: LoRA's rank and targets, hf_dtrain's LoRA-FA optimizer unless the job turns it off
(``--lorafa.optimizer false``), and its fused form (the frozen A stays a buffer)."""

from dataclasses import dataclass

from hf_dtrain.settings import check_fields, setting

from ..finetune_method import FinetuneMethod, LowRankForm, register_finetune_method


@dataclass
class LoraFAJobSettings:
    """LoRA-FA's settings in the fine-tuning job (``--lorafa.*``; YAML ``lorafa:``)."""

    section_key = "lorafa"

    optimizer: bool = setting(
        True, "Use hf_dtrain's create_lorafa_optimizer instead of the Trainer's optimizer (--optim)."
    )

    def __post_init__(self):
        check_fields(self)


def _config(adapter, settings, model):
    from .config import LoraFAConfig

    return LoraFAConfig(r=adapter.r, lora_alpha=adapter.alpha, target_modules=adapter.targets(), lora_dropout=0.0)


def _optimizer(settings, model, lr, weight_decay):
    from .optimizer import create_lorafa_optimizer

    return create_lorafa_optimizer(model, lr=lr, weight_decay=weight_decay)


METHOD = register_finetune_method(
    FinetuneMethod(
        "lorafa",
        4e-3,
        _config,
        quantized_bases=("nf4",),
        settings=LoraFAJobSettings,
        peft_type="LORAFA",
        owns_optimizer=lambda settings: settings.optimizer,
        build_optimizer=_optimizer,
        own_optimizer_off="--lorafa.optimizer false",
        fused=LowRankForm(
            factors=lambda layer, name: (layer.lorafa_A[name], layer.lorafa_B[name]),
            dropout=lambda layer, name: float(getattr(layer.lorafa_dropout[name], "p", 0.0)),
            a_trainable=False,
            optimizer_rule="lorafa",
        ),
        order=10,
        default=True,  # the jobs' --method (LoRA's quality at a fraction of its activation memory)
    )
)
