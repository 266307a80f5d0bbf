"""What ``hf-dtrain finetune`` knows of each method, pushed here by the method itself.

A method registers a :class:`FinetuneMethod` with :func:`register_finetune_method` when its ``job.py`` is imported
(peft's ``register_peft_method`` and torchtitan's train-spec registry have this shape): its name, its default
learning rate, the 4-bit bases it trains on, the peft config it builds from the job's settings (with the trainable
budget matched to LoRA's at the same rank), an optional optimizer of its own, and an optional settings dataclass
that becomes its own section of the job (``--smt.block-size``, YAML ``smt: {block_size: 16}``).

This module imports no tuner; ``hf_dtrain.tuners`` imports each tuner's ``job.py``, which registers it. A tuner
outside hf_dtrain registers the same way before ``hf_dtrain.finetune`` is imported.

The builders receive the job's config and read the shared adapter settings (``lora_r``, ``lora_alpha``,
``lora_dropout``, ``target_modules``, ``quant_group_size``) and their own section by name; this package does not
import the job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from peft import LoraConfig

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class FinetuneMethod:
    name: str
    default_lr: float
    build_config: Callable[[Any, Any], Any]  # (job config, base model) -> peft config, or None (full fine-tuning)
    quantized_bases: tuple[str, ...] = ()  # the --quantize values it trains on
    build_optimizer: Callable[[Any, Any, float, float], Any] | None = None  # (cfg, model, lr, wd) -> optimizer
    settings: type | None = None  # its own section of the job config (a dataclass), named after the method


# name -> method, in registration order
FINETUNE_METHODS: dict[str, FinetuneMethod] = {}


def register_finetune_method(method: FinetuneMethod) -> FinetuneMethod:
    """Make ``method`` known to the fine-tuning jobs (idempotent: registering a name again replaces it, so a
    reloaded tuner module points the job at its new classes)."""
    if not isinstance(method, FinetuneMethod):
        raise TypeError(f"register_finetune_method takes a FinetuneMethod, got {type(method).__name__}.")
    if not method.name.isidentifier() or method.name != method.name.lower():
        raise ValueError(
            f"FinetuneMethod.name must be a lower-case identifier (it is a flag section), got {method.name!r}."
        )
    FINETUNE_METHODS[method.name] = method
    return method


def linear_shapes(model, targets) -> list[tuple[int, int]]:
    """``(out, in)`` of every linear (dense or 4-bit) whose name ends with one of ``targets``."""
    shapes = []
    for name, mod in model.named_modules():
        if name.split(".")[-1] in targets and hasattr(mod, "in_features") and hasattr(mod, "out_features"):
            shapes.append((mod.out_features, mod.in_features))
    return shapes


def lora_budget(rank: int, shapes) -> int:
    """Trainable parameters of LoRA at ``rank`` on linears of ``shapes``: what the other methods are matched to."""
    return sum(rank * (o + i) for o, i in shapes)


def _lora(cfg, model, dora=False):

    return LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=cfg.target_modules or LORA_TARGETS,
        use_dora=dora,
        task_type="CAUSAL_LM",
    )


# peft's own methods and full fine-tuning (hf_dtrain's tuners register from their job.py)
register_finetune_method(FinetuneMethod("lora", 4e-3, _lora, quantized_bases=("nf4", "hqq4")))
register_finetune_method(
    FinetuneMethod("dora", 4e-3, lambda cfg, model: _lora(cfg, model, dora=True), quantized_bases=("nf4",))
)
register_finetune_method(FinetuneMethod("full", 5e-4, lambda cfg, model: None))
