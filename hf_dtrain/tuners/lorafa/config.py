from __future__ import annotations

from dataclasses import dataclass

from hf_dtrain.errors import SettingsError
from hf_dtrain.settings import check_number, setting

from .._registry import HfDtrainPeftConfig, register_folder


@dataclass
class LoraFAConfig(HfDtrainPeftConfig):
    """Configuration of a LoRA-FA adapter (LoRA with a frozen down-projection, arXiv 2308.03303).

    ``A`` is drawn once (Kaiming-uniform, seeded by ``init_seed``) and never trains; only ``B`` (initialised to zero)
    trains. Because ``A`` is frozen, the layer keeps only ``x @ A.T`` (``r`` values per token) for backward, never
    the layer input ``x``: that is the activation-memory saving of the method. Dropout, if any, is applied to the
    ``r``-dimensional projection ``x @ A.T``, so its mask is ``r`` values per token too.
    """

    peft_type_name = "LORAFA"

    r: int = setting(8, "Rank of the adapter: rows of the frozen A, columns of B.")
    lora_alpha: int = setting(16, "Scaling numerator: the update is (lora_alpha / r) * B A.")
    target_modules: list[str] | str | None = setting(
        None,
        "Module names (suffix match) or a regex of the nn.Linear layers to adapt, e.g. ['q_proj', "
        "'v_proj']. If None, the attention and MLP projections of known architectures (LLaMA: "
        "q,k,v,o,gate,up,down) are used.",
    )
    lora_dropout: float = setting(
        0.0,
        "Dropout probability applied to the r-dimensional projection x @ A.T (not to x, which would bring "
        "a full-size mask back into the saved activations).",
    )
    init_seed: int | None = setting(
        None,
        "Seed for drawing the frozen A (per layer, offset by a hash of the module name). None uses torch's "
        "global RNG. A is saved with the adapter either way.",
    )
    use_rslora: bool = setting(False, "Scale by lora_alpha / sqrt(r) instead of lora_alpha / r.")
    bias: str = setting("none", "Bias training: 'none', 'all' or 'lorafa_only'.")
    layers_to_transform: list[int] | int | None = setting(
        None, "Only adapt these layer indices (as in peft's LoraConfig)."
    )
    layers_pattern: list[str] | str | None = setting(
        None, "Name of the layer list when layers_to_transform is used, e.g. 'layers'."
    )

    def __post_init__(self):
        super().__post_init__()
        check_number(self, "lora_alpha", gt=0)
        check_number(self, "lora_dropout", low=0)
        self.positive_ints("r")
        if not 0.0 <= float(self.lora_dropout) < 1.0:
            raise SettingsError(f"LoraFAConfig.lora_dropout must be in [0, 1), got {self.lora_dropout!r}.")
        if self.bias not in ("none", "all", "lorafa_only"):
            raise SettingsError(f"LoraFAConfig.bias must be 'none', 'all' or 'lorafa_only', got {self.bias!r}.")
        if self.layers_pattern and self.layers_to_transform is None:
            raise SettingsError("LoraFAConfig.layers_pattern needs layers_to_transform; set both or neither.")


register_folder(__name__)
