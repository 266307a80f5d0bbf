"""QA-HiRA in the jobs. Its single matrix acts on inputs averaged over a whole quantization group and needs much
larger steps than LoRA (benchmarks/results/quantized_adapters_lr_sweep.md); the output repeat factor is chosen so the
trainable count is closest to LoRA's at the job's rank. It has no fused form: its adapter multiplies into the base
weight."""

from dataclasses import dataclass

from hf_dtrain.settings import check_fields, setting

from ..finetune_method import FinetuneMethod, linear_shapes, lora_budget, register_finetune_method


@dataclass
class QAHiRAJobSettings:
    """QA-HiRA's settings in the fine-tuning job (``--qahira.*``; YAML ``qahira:``). Its input pooling factor is the
    job's ``quant_group_size``."""

    section_key = "qahira"

    lambda_out: int | None = setting(
        None,
        "Output repeat factor; default the divisor of every target's out_features whose parameter "
        "count is closest to lora's at lora_r.",
        min=1,
    )

    def __post_init__(self):
        check_fields(self)


def _config(adapter, settings, model):
    from .config import QAHiRAConfig

    targets = adapter.targets()
    g, lam = adapter.quant_group_size, settings.lambda_out
    shapes = linear_shapes(model, targets)
    if lam is None:  # the divisor of every out_features whose count (out/lam)(in/g) is closest to lora's
        budget = lora_budget(adapter.r, shapes)
        common = [d for d in range(1, min(o for o, _ in shapes) + 1) if all(o % d == 0 for o, _ in shapes)]
        lam = min(common, key=lambda d: abs(sum((o // d) * (i // g) for o, i in shapes) - budget))
    return QAHiRAConfig(group_size=g, lambda_out=lam, target_modules=targets)


METHOD = register_finetune_method(
    FinetuneMethod(
        "qahira",
        8e-2,
        _config,
        quantized_bases=("nf4", "hqq4", "int4"),
        settings=QAHiRAJobSettings,
        peft_type="QAHIRA",
        fused="QA-HiRA multiplies its adapter into the base weight elementwise (a Hadamard product), so the frozen "
        "base cannot run once for all jobs",
        order=40,
    )
)
