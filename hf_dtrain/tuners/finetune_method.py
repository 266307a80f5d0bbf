"""What ``hf-dtrain finetune`` needs to know of one method, kept in the method's own folder (``<method>/job.py``):
its name, its default learning rate, the 4-bit bases it trains on, the peft config it builds from the job's settings
(with the trainable budget matched to LoRA's at the same rank), and an optional optimizer of its own. A new tuner
adds its ``job.py`` and one line to :data:`FINETUNE_METHODS`; the job reads everything from there.

The builders receive the job's config (``FinetuneConfig``) and read its fields by name; this package does not import
the job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class FinetuneMethod:
    name: str
    default_lr: float
    build_config: Callable[[Any, Any], Any]  # (job config, base model) -> peft config, or None (full fine-tuning)
    quantized_bases: tuple[str, ...] = ()  # the --quantize values it trains on
    build_optimizer: Optional[Callable[[Any, Any, float, float], Any]] = None  # (cfg, model, lr, wd) -> optimizer


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
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=cfg.target_modules or LORA_TARGETS, use_dora=dora, task_type="CAUSAL_LM")


LORA = FinetuneMethod("lora", 4e-3, _lora, quantized_bases=("nf4", "hqq4"))
DORA = FinetuneMethod("dora", 4e-3, lambda cfg, model: _lora(cfg, model, dora=True), quantized_bases=("nf4",))
FULL = FinetuneMethod("full", 5e-4, lambda cfg, model: None)


def _registry() -> dict[str, FinetuneMethod]:
    from .lorafa.job import METHOD as lorafa
    from .qahira.job import METHOD as qahira
    from .qbara.job import METHOD as qbara
    from .smt.job import METHOD as smt

    return {m.name: m for m in (LORA, DORA, lorafa, smt, qbara, qahira, FULL)}


FINETUNE_METHODS: dict[str, FinetuneMethod] = _registry()
