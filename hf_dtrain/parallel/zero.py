"""DeepSpeed ZeRO configs for the Trainer: ``--deepspeed zero2`` / ``zero3`` name built-in configs (the Trainer fills
their ``"auto"`` values from its arguments), anything else is the path of the user's own JSON."""

from __future__ import annotations

import copy
import json

from hf_dtrain.errors import SettingsError

_COMMON = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,  # hf_dtrain's optimizers (LoRA-FA's, Eva at stage 0) are client optimizers
    "bf16": {"enabled": "auto"},
    "steps_per_print": 1000000,
}
PRESETS = {
    "zero2": {**_COMMON, "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True}},
    "zero3": {
        **_COMMON,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    },
}


def deepspeed_config(value: str) -> dict:
    """The DeepSpeed config that ``--deepspeed value`` names: a built-in preset (``zero2``, ``zero3``) or a JSON
    file. A ``ValueError`` names the field and the fix for a missing or unreadable file and a bad ZeRO stage."""
    if value in PRESETS:
        return copy.deepcopy(PRESETS[value])
    try:
        with open(value) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise SettingsError(
            f"deepspeed={value!r}: no such file and no preset; set --deepspeed to "
            f"{' or '.join(PRESETS)}, or to a DeepSpeed config JSON."
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SettingsError(
            f"deepspeed config {value} cannot be read as JSON: {e}; fix the file or set --deepspeed to another one."
        ) from None
    zero = cfg.get("zero_optimization", {}) if isinstance(cfg, dict) else None
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise SettingsError(f"deepspeed config {value}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}.")
    return cfg


def zero_stage(config: dict) -> int:
    return config.get("zero_optimization", {}).get("stage", 0)
