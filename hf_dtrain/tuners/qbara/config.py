from __future__ import annotations

from dataclasses import dataclass

from hf_dtrain.settings import check_number, setting

from .._registry import HfDtrainPeftConfig, register_folder


@dataclass
class QBaRAConfig(HfDtrainPeftConfig):
    """Configuration of Q-BaRA (Shen et al., arXiv 2407.17029, TACL 2025; "Q-BLoRA" in the final version).

    The input is average-pooled by ``pool`` (lambda, the paper uses 2 for LLaMA), ``A: in/lambda -> lambda*r``,
    ``B: lambda*r -> out/lambda``, the output repeated ``lambda`` times and scaled by ``lora_alpha / r``. That is the
    parameter count of LoRA at rank ``r`` with rank up to ``lambda * r``.
    """

    peft_type_name = "QBARA"

    r: int = setting(8, "LoRA-equivalent rank: the adapter has lambda * r inner dimensions.")
    lora_alpha: int = setting(16, "Scaling numerator: the update is scaled by lora_alpha / r.")
    pool: int = setting(2, "lambda: input pooling and output repeat factor (paper: 2).")
    target_modules: list[str] | str | None = setting(
        None, "Module names or a regex of the linear layers to adapt; None: all seven LLaMA projections."
    )
    require_quantized_base: bool = setting(
        False, "Raise a ValueError when a target is a dense layer instead of a 4-bit one (nf4, hqq4, int4)."
    )

    def __post_init__(self):
        super().__post_init__()
        check_number(self, "lora_alpha", gt=0)
        self.positive_ints("r", "pool")


register_folder(__name__)
