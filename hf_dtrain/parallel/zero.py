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


def model_states_estimate(config: dict, model, world_size: int) -> tuple[int, str]:
    """One rank's model states (parameters, gradients, optimizer state) under the DeepSpeed ``config``, by
    DeepSpeed's own estimators (``estimate_zero3_model_states_mem_needs`` for ZeRO-3,
    ``estimate_zero2_model_states_mem_needs`` for ZeRO-1 and 2: mixed-precision Adam, 18 bytes per trainable
    parameter spread over the ranks, the 16-bit parameters whole or, under ZeRO-3, spread plus the largest layer
    gathered; CPU offload as the config asks) for the parameters that train, and the frozen ones (a peft model's base,
    which DeepSpeed's estimators do not tell apart) at their own bytes, spread over the ranks under ZeRO-3, whole
    otherwise. Returns ``(bytes, how it was counted)``; ZeRO-0: ``(0, ...)``, the caller keeps its own count."""
    stage = zero_stage(config)
    zero = config.get("zero_optimization", {})
    offload_optimizer = (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    offload_params = (zero.get("offload_param") or {}).get("device") in ("cpu", "nvme")
    params = list(model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in params if not p.requires_grad)
    if stage == 0:
        return 0, "ZeRO-0: DeepSpeed shards nothing; the traced model states are kept"
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
        _, gpu, _ = estimate_zero3_model_states_mem_needs(
            trainable,
            largest,
            num_gpus_per_node=world_size,
            cpu_offload=offload_optimizer,
            cpu_offload_params=offload_params,
            zero_init=True,
        )
        held = 0 if offload_params else frozen // world_size
        how = "estimate_zero3_model_states_mem_needs"
    else:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        _, gpu = estimate_zero2_model_states_mem_needs(
            trainable, num_gpus_per_node=world_size, cpu_offload=offload_optimizer
        )
        held = frozen
        how = "estimate_zero2_model_states_mem_needs"
    spread = "spread over the ranks" if stage == 3 else "whole on each rank"
    return int(gpu + held), (
        f"ZeRO-{stage}: model states by DeepSpeed's {how} for the {trainable:,} trainable parameters on "
        f"{world_size} ranks{' (optimizer offloaded)' if offload_optimizer else ''}, plus the frozen parameters' "
        f"{frozen / 2**30:.2f} GiB {spread}; activations and temporaries traced (one rank's micro-batch, the model "
        "whole: DeepSpeed's engine itself is not traced)"
    )
