from __future__ import annotations

import torch

from hf_dtrain.errors import SettingsError

from .._base import LinearTunerModel
from .._registry import register, register_folder
from . import config
from .layer import Linear, SMTLayer

# The paper's default candidates: the attention Q, K, V projections.
_QKV = ["q_proj", "k_proj", "v_proj"]
TRANSFORMERS_MODELS_TO_SMT_TARGET_MODULES_MAPPING = dict.fromkeys(
    (
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen3",
        "gemma",
        "gemma2",
        "gemma3_text",
        "phi3",
        "olmo",
        "olmo2",
        "granite",
    ),
    _QKV,
)


class SMTModel(LinearTunerModel):
    """Injects SMT layers into the ``nn.Linear`` targets of a model. Use through ``get_peft_model``::

        import hf_dtrain  # registers SMT with peft
        model = get_peft_model(base, SMTConfig(block_size=256, num_blocks=64))

    Until blocks are selected (``SMTSelectionCallback``, ``smt_warmup`` or ``SMTConfig.block_indices``) each layer
    holds zero blocks and the model computes exactly the base model.
    """

    prefix: str = "smt_"
    tuner_layer_cls = SMTLayer
    target_module_mapping = TRANSFORMERS_MODELS_TO_SMT_TARGET_MODULES_MAPPING
    linear_cls = Linear
    method_name = "SMT"
    config_name = "SMTConfig"

    def _post_injection_hook(self, model, config, adapter_name) -> None:
        layers = [m for m in model.modules() if isinstance(m, SMTLayer) and adapter_name in m.block_size]
        total = sum(
            (m.out_features // m.block_size[adapter_name]) * (m.in_features // m.block_size[adapter_name])
            for m in layers
        )
        if config.block_indices is not None:
            known = {m.smt_layer_key[adapter_name] for m in layers}
            unknown = sorted(set(config.block_indices) - known)
            if unknown:
                raise SettingsError(
                    f"SMTConfig.block_indices names modules that are not SMT targets: {unknown[:5]}; use module names "
                    f"as in base_model.named_modules(), e.g. {sorted(known)[:3]}."
                )
            return
        n = resolve_num_blocks(config, model)
        if n > total:
            raise SettingsError(
                f"SMTConfig asks for {n} blocks but the targets hold only {total} blocks of size {config.block_size}; "
                "lower num_blocks/trainable_ratio, add target_modules, or use a smaller block_size."
            )


def resolve_num_blocks(config, model: torch.nn.Module) -> int:
    """The block budget of ``config``: ``num_blocks``, or ``trainable_ratio`` of the model's parameters."""
    if config.num_blocks is not None:
        return int(config.num_blocks)
    n_params = sum(p.numel() for n, p in model.named_parameters() if "smt_" not in n)
    return max(1, int(config.trainable_ratio * n_params // config.block_size**2))


def register_with_peft() -> None:
    """Make smt known to peft (idempotent: a reloaded config module's class replaces the old one)."""
    register("smt", config.SMTConfig, SMTModel, prefix="smt_")


register_folder(__name__)
