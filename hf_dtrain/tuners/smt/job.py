"""SMT in ``hf-dtrain finetune``: ``smt.block_size`` blocks on the attention projections, as many as LoRA's trainable
count at the job's rank unless ``smt.num_blocks`` says otherwise. (The job runs the warm-up selection: through
``SMTSelectionCallback`` in one process, ``smt_warmup`` before DDP wraps the model otherwise.)"""

from dataclasses import dataclass, field

from hf_dtrain.settings import check_fields

from ..finetune_method import FinetuneMethod, linear_shapes, lora_budget, register_finetune_method
from .config import SMTConfig

SMT_TARGETS = ["q_proj", "k_proj", "v_proj"]


@dataclass
class SMTJobSettings:
    """SMT's settings in the fine-tuning job (``--smt.*``; YAML ``smt:``)."""

    section_key = "smt"

    block_size: int = field(default=64, metadata={"min": 1, "help": "Side of the square sub-matrices."})
    num_blocks: int | None = field(
        default=None,
        metadata={"min": 1, "help": "Blocks to train; default matches the trainable budget of lora at lora_r."},
    )
    warmup_steps: int = field(default=20, metadata={"min": 1, "help": "Gradient-scoring steps before selection."})

    def __post_init__(self):

        check_fields(self)


def _config(cfg, model):

    targets = cfg.target_modules or SMT_TARGETS
    b = cfg.smt.block_size
    shapes = linear_shapes(model, targets)
    available = sum((o // b) * (i // b) for o, i in shapes)
    if available == 0:
        raise ValueError(
            f"smt.block_size={b} does not fit any of {targets} (shapes {sorted(set(shapes))}); "
            "set --smt.block-size to a divisor of the hidden size."
        )
    num_blocks = cfg.smt.num_blocks
    if num_blocks is None:  # the lora budget at the same rank on the same targets
        num_blocks = max(1, round(lora_budget(cfg.lora_r, shapes) / (b * b)))
    num_blocks = min(num_blocks, available)
    return SMTConfig(target_modules=targets, block_size=b, num_blocks=num_blocks, warmup_steps=cfg.smt.warmup_steps)


METHOD = register_finetune_method(FinetuneMethod("smt", 2e-3, _config, settings=SMTJobSettings))
