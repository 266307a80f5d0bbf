from __future__ import annotations

from dataclasses import dataclass

from hf_dtrain.settings import setting

from .._registry import HfDtrainPeftConfig, register_folder


@dataclass
class QAHiRAConfig(HfDtrainPeftConfig):
    """Configuration of QA-HiRA (Shen et al., arXiv 2407.17029, TACL 2025; "QA-BLoRA" in the final version).

    One matrix per layer, no B: the input is average-pooled by ``group_size`` along ``in_features`` (the base's
    quantization group size), multiplied by ``qahr_A`` of shape ``(out / lambda_out, in / group_size)``, and the
    output repeated ``lambda_out`` times. The update is constant within every quantization group, so it merges exactly
    into the zero-points of a group-wise 4-bit base with zero-points (HQQ ``HQQLinear`` with ``axis=1``, or
    ``hf_dtrain.quantization.int4.Int4Linear``). ``qahr_A`` starts at zero:
    the untrained adapter leaves the model unchanged (the published code's Kaiming init does not).
    """

    peft_type_name = "QAHIRA"

    target_modules: list[str] | str | None = setting(
        None, "Module names (suffix match) or a regex of the linear layers to adapt; None: all seven LLaMA projections."
    )
    group_size: int = setting(
        64,
        "Input pooling factor; must equal the quantization group size of an HQQ or Int4Linear base (for "
        "the exact merge) and divide in_features.",
    )
    lambda_out: int = setting(8, "Output repeat factor; must divide out_features.")
    r: int | None = setting(
        None,
        "None: QA-HiRA's single full-rank matrix. An integer factorises it as qahr_B @ qahr_A of this "
        "rank (QA-LoRA, Xu et al., arXiv 2309.14717, with lambda_out=1); B starts at zero.",
    )
    scaling: float = setting(1.0, "Multiplier of the adapter's output.")
    require_quantized_base: bool = setting(
        False, "Raise a ValueError when a target is a dense layer instead of a 4-bit one (nf4, hqq4, int4)."
    )

    def __post_init__(self):
        super().__post_init__()
        self.positive_ints("group_size", "lambda_out", "r")


register_folder(__name__)
