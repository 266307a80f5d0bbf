"""SMT in ``hf-dtrain finetune``: ``smt_block_size`` blocks on the attention projections, as many as LoRA's trainable
count at the job's rank unless ``smt_num_blocks`` says otherwise. (The job runs the warm-up selection: through
``SMTSelectionCallback`` in one process, ``smt_warmup`` before DDP wraps the model otherwise.)"""

from ..finetune_method import FinetuneMethod, linear_shapes, lora_budget

SMT_TARGETS = ["q_proj", "k_proj", "v_proj"]


def _config(cfg, model):
    from .config import SMTConfig

    targets = cfg.target_modules or SMT_TARGETS
    b = cfg.smt_block_size
    shapes = linear_shapes(model, targets)
    available = sum((o // b) * (i // b) for o, i in shapes)
    if available == 0:
        raise ValueError(f"smt_block_size={b} does not fit any of {targets} (shapes {sorted(set(shapes))}); "
                         "set --smt-block-size to a divisor of the hidden size.")
    num_blocks = cfg.smt_num_blocks
    if num_blocks is None:  # the lora budget at the same rank on the same targets
        num_blocks = max(1, round(lora_budget(cfg.lora_r, shapes) / (b * b)))
    num_blocks = min(num_blocks, available)
    return SMTConfig(target_modules=targets, block_size=b, num_blocks=num_blocks,
                     warmup_steps=cfg.smt_warmup_steps)


METHOD = FinetuneMethod("smt", 2e-3, _config)
