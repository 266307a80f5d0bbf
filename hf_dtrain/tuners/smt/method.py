"""SMT in the jobs: ``smt.block_size`` blocks on the attention projections, as many as LoRA's trainable count at the
job's rank unless ``smt.num_blocks`` says otherwise; its prepare step selects the blocks from warm-up gradients
(``smt_warmup`` before the Trainer, before DDP / FSDP2 / DeepSpeed or the fused sweep wrap the model: they cannot
change parameter shapes afterwards; the warm-up is not counted in ``max_steps``); fused, each job keeps its own
blocks."""

from dataclasses import dataclass

from hf_dtrain.errors import SettingsError
from hf_dtrain.settings import check_fields, setting

from ..finetune_method import BlockSparseForm, FinetuneMethod, linear_shapes, lora_budget, register_finetune_method

SMT_TARGETS = ["q_proj", "k_proj", "v_proj"]


@dataclass
class SMTJobSettings:
    """SMT's settings in the fine-tuning job (``--smt.*``; YAML ``smt:``)."""

    section_key = "smt"

    block_size: int = setting(64, "Side of the square sub-matrices.", min=1)
    num_blocks: int | None = setting(
        None, "Blocks to train; default matches the trainable budget of lora at lora_r.", min=1
    )
    warmup_steps: int = setting(20, "Gradient-scoring steps before selection.", min=1)

    def __post_init__(self):
        check_fields(self)


def _config(adapter, settings, model):
    from .config import SMTConfig

    targets = adapter.targets(SMT_TARGETS)
    b = settings.block_size
    shapes = linear_shapes(model, targets)
    available = sum((o // b) * (i // b) for o, i in shapes)
    if available == 0:
        raise SettingsError(
            f"smt.block_size={b} does not fit any of {targets} (shapes {sorted(set(shapes))}); "
            "set --smt.block-size to a divisor of the hidden size."
        )
    num_blocks = settings.num_blocks
    if num_blocks is None:  # the lora budget at the same rank on the same targets
        num_blocks = max(1, round(lora_budget(adapter.r, shapes) / (b * b)))
    num_blocks = min(num_blocks, available)
    return SMTConfig(target_modules=targets, block_size=b, num_blocks=num_blocks, warmup_steps=settings.warmup_steps)


def _prepare(model, settings, data) -> list:
    """Select the blocks before the job trains: ``warmup_steps`` scoring passes over this rank's share of the data
    (under the job's autocast; the summed gradients are all-reduced, so every rank selects the same blocks), then
    ``max_steps`` updates of the selected blocks. The same in one process and under DDP / FSDP2 / DeepSpeed / the fused
    sweep (which cannot change parameter shapes after they wrap the model): the warm-up never takes updates from
    ``max_steps``, as it did when a Trainer callback scored during the first steps (0.80 against 0.85 on CR with 10 of
    24 steps scoring: ``benchmarks/results/real_llama_probes.jsonl``). Returns no callbacks."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    from .selection import smt_warmup

    if data.adapter_name is not None:
        model.set_adapter(data.adapter_name)
    config = model.peft_config[data.adapter_name or model.active_adapter]
    if config.block_indices:  # given (or saved): nothing to select
        return []
    sampler = DistributedSampler(data.train, num_replicas=data.world_size, rank=data.rank, shuffle=True, seed=data.seed)
    loader = DataLoader(data.train, batch_size=data.batch_size, sampler=sampler, collate_fn=data.collator)
    device = next(model.parameters()).device
    with torch.autocast(device.type, dtype=data.autocast_dtype, enabled=data.autocast_dtype is not None):
        smt_warmup(model, loader, num_steps=config.warmup_steps, adapter_name=data.adapter_name, progress=data.progress)
    return []


def _without_data(model, settings, seed: int) -> None:
    """The selection's stand-in when no data is read (a trace on fake tensors): the same number of blocks, spread
    over the targets as a global top-k of random scores (seeded) spreads them, so the shapes are the run's."""
    import torch

    from .layer import SMTLayer
    from .model import resolve_num_blocks

    adapter = model.active_adapter
    config = model.peft_config[adapter]
    layers = [m for m in model.modules() if isinstance(m, SMTLayer) and adapter in m.block_size]
    grids = [(m.out_features // m.block_size[adapter], m.in_features // m.block_size[adapter]) for m in layers]
    total = sum(r * c for r, c in grids)
    n = min(resolve_num_blocks(config, model), total)
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(total, generator=generator)[:n]
    selection, start = {}, 0
    for layer, (rows, cols) in zip(layers, grids):
        local = chosen[(chosen >= start) & (chosen < start + rows * cols)] - start
        indices = torch.stack([local // cols, local % cols], dim=1)
        layer.set_block_indices(adapter, indices)
        layer.stop_scoring(adapter)
        if len(indices):
            selection[layer.smt_layer_key[adapter]] = indices.tolist()
        start += rows * cols
    config.block_indices = selection


def _blocks(layer, name):
    return (
        layer.smt_indices[name].cpu(),
        layer.smt_weight.get(name),
        layer.block_size[name],
    )


def _write_back(layer, name, weight) -> None:
    if name in layer.smt_weight:
        layer.smt_weight[name].copy_(weight)


def _check_fusable(layer, names) -> None:
    missing = [n for n in names if n not in layer.block_size]
    if missing:
        raise SettingsError(f"SMT layer has no adapter {missing}")
    unselected = [n for n in names if layer._smt_unselected.get(n)]
    if unselected:
        raise SettingsError(
            f"SMT adapters {unselected} have no block selection yet: run smt_warmup (or give block_indices) before "
            "fusing."
        )
    sizes = {layer.block_size[n] for n in names}
    if len(sizes) > 1:
        raise SettingsError(f"SMT jobs with different block sizes {sorted(sizes)} cannot be fused; use one block_size.")


def _delta():
    from .layer import BlockSparseDelta

    return BlockSparseDelta.apply


METHOD = register_finetune_method(
    FinetuneMethod(
        "smt",
        2e-3,
        _config,
        settings=SMTJobSettings,
        peft_type="SMT",
        prepare=_prepare,
        without_data=_without_data,
        fused=BlockSparseForm(blocks=_blocks, delta=_delta, write_back=_write_back, check=_check_fusable),
        sweep_settings=("num_blocks", "warmup_steps"),
        sweep_axes={"num_blocks": (int, "blocks")},
        order=20,
    )
)
