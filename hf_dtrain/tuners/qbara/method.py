"""Q-BaRA in the jobs: LoRA's rank and targets with the pooling factor ``qbara.pool``; fused with the pooling folded
into the factors."""

from dataclasses import dataclass

from hf_dtrain.errors import SettingsError
from hf_dtrain.settings import check_fields, setting

from ..finetune_method import FinetuneMethod, LowRankForm, register_finetune_method


@dataclass
class QBaRAJobSettings:
    """Q-BaRA's settings in the fine-tuning job (``--qbara.*``; YAML ``qbara:``)."""

    section_key = "qbara"

    pool: int = setting(2, "Pooling/repeat factor lambda (rank lambda * lora_r).", min=1)

    def __post_init__(self):
        check_fields(self)


def _config(adapter, settings, model):
    from .config import QBaRAConfig

    return QBaRAConfig(r=adapter.r, lora_alpha=adapter.alpha, pool=settings.pool, target_modules=adapter.targets())


def _check_fusable(layer, names) -> None:
    pools = {layer.pool[n] for n in names}
    if len(pools) > 1:
        raise SettingsError(f"Q-BaRA jobs with different pool factors {sorted(pools)} cannot be fused; use one pool.")


METHOD = register_finetune_method(
    FinetuneMethod(
        "qbara",
        4e-3,
        _config,
        quantized_bases=("nf4", "hqq4", "int4"),
        settings=QBaRAJobSettings,
        peft_type="QBARA",
        fused=LowRankForm(
            factors=lambda layer, name: (layer.qbara_A[name], layer.qbara_B[name]),
            pool=lambda layer, name: layer.pool[name],
            check=_check_fusable,
        ),
        order=30,
    )
)
