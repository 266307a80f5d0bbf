from __future__ import annotations

from dataclasses import dataclass, field

from peft.config import PeftConfig
from peft.utils import PeftType

from hf_dtrain.settings import check_number

from .._registry import HfDtrainConfigMixin


@dataclass
class QBaRAConfig(HfDtrainConfigMixin, PeftConfig):
    """Configuration of Q-BaRA (Shen et al., arXiv 2407.17029, TACL 2025; "Q-BLoRA" in the final version).

    The input is average-pooled by ``pool`` (lambda, the paper uses 2 for LLaMA), ``A: in/lambda -> lambda*r``,
    ``B: lambda*r -> out/lambda``, the output repeated ``lambda`` times and scaled by ``lora_alpha / r``. That is the
    parameter count of LoRA at rank ``r`` with rank up to ``lambda * r``.
    """

    r: int = field(default=8, metadata={"help": "LoRA-equivalent rank: the adapter has lambda * r inner dimensions."})
    lora_alpha: int = field(default=16, metadata={"help": "Scaling numerator: the update is scaled by lora_alpha / r."})
    pool: int = field(default=2, metadata={"help": "lambda: input pooling and output repeat factor (paper: 2)."})
    target_modules: list[str] | str | None = field(
        default=None,
        metadata={"help": "Module names or a regex of the linear layers to adapt; None: all seven LLaMA projections."},
    )
    exclude_modules: list[str] | str | None = field(default=None, metadata={"help": "Modules not to adapt."})
    modules_to_save: list[str] | None = field(default=None, metadata={"help": "Extra modules to train and save."})
    require_quantized_base: bool = field(
        default=False,
        metadata={
            "help": "Raise a ValueError when a target is a dense layer instead of a 4-bit one (nf4, hqq4, int4)."
        },
    )

    init_weights: bool = field(
        default=True,
        metadata={
            "help": "True: the adapter starts as the identity (its delta is zero). False: a small random non-zero "
            "start, as peft's own methods take it (for testing merges and save/load round trips)."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        self.peft_type = PeftType.QBARA

        check_number(self, "lora_alpha", gt=0)
        if isinstance(self.target_modules, list):
            self.target_modules = set(self.target_modules)
        if isinstance(self.exclude_modules, list):
            self.exclude_modules = set(self.exclude_modules)
        for name in ("r", "pool"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"QBaRAConfig.{name} must be a positive integer, got {value!r}.")
