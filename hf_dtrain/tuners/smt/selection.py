"""Block selection for SMT, offered three ways:

* ``SMTSelectionCallback``: a Trainer callback that runs the warm-up and switches to sparse training inside one
  ``trainer.train()`` (single process; under DDP use ``smt_warmup`` before building the Trainer, because DDP cannot
  change parameter shapes once it has wrapped the model);
* ``smt_warmup(model, batches)`` for custom loops (all-reduces the scores when torch.distributed is initialised, so all
  ranks select the same blocks), or ``start_smt_scoring`` + your own backward passes + ``select_smt_blocks``;
* explicit precomputed indices: ``SMTConfig(block_indices=...)`` or ``set_smt_block_indices``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from tqdm.auto import tqdm
from transformers import TrainerCallback

from hf_dtrain.errors import RunFailure, SettingsError

from .._registry import register_folder
from .layer import SMTLayer
from .model import resolve_num_blocks

logger = logging.getLogger(__name__)


def _adapter_and_config(model, adapter_name: str | None):
    peft_configs = getattr(model, "peft_config", None)
    if not peft_configs:
        raise SettingsError("The model has no peft config; build it with get_peft_model(model, SMTConfig(...)).")
    if adapter_name is None:
        active = getattr(model, "active_adapter", None)
        adapter_name = active if isinstance(active, str) else next(iter(peft_configs))
    if adapter_name not in peft_configs or peft_configs[adapter_name].peft_type != "SMT":
        raise SettingsError(
            f"Adapter {adapter_name!r} is not an SMT adapter; SMT adapters: "
            f"{[k for k, c in peft_configs.items() if c.peft_type == 'SMT']}."
        )
    return adapter_name, peft_configs[adapter_name]


def _layers(model, adapter_name: str) -> list[SMTLayer]:
    layers = [m for m in model.modules() if isinstance(m, SMTLayer) and adapter_name in m.block_size]
    if not layers:
        raise SettingsError(f"No SMT layer holds adapter {adapter_name!r}.")
    return layers


def _swap_in_optimizer(optimizer, mapping: dict, old_params: dict, added: list) -> None:
    """Replace old block parameters by new ones inside an existing optimizer (also through Accelerate's wrapper):
    ``mapping`` old id -> new parameter (``None`` where no block is left), ``added``: blocks of targets that had
    none, which join the first parameter group."""
    inner = optimizer
    while hasattr(inner, "optimizer") and not isinstance(inner, torch.optim.Optimizer):
        inner = inner.optimizer
    held = {id(p) for group in inner.param_groups for p in group["params"]}
    for group in inner.param_groups:
        group["params"] = [mapping.get(id(p), p) for p in group["params"] if mapping.get(id(p), p) is not None]
    added = added + [new for old_id, new in mapping.items() if old_id not in held and new is not None]
    inner.param_groups[0]["params"].extend(p for p in added if p.requires_grad)
    for old in old_params.values():
        inner.state.pop(old, None)


def _refuse_sharded(model) -> None:
    """Selection installs new block parameters; an engine that has already sharded the model cannot take them in."""
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        engine = "FSDP2 (fully_shard)"
    elif any(hasattr(p, "ds_id") for p in model.parameters()):
        engine = "DeepSpeed ZeRO-3"
    else:
        return
    raise SettingsError(
        f"SMT block selection on a model already sharded by {engine}: selection installs new block "
        "parameters, which the engine cannot take in after sharding. Run smt_warmup before sharding "
        "(hf-dtrain finetune does), or pass the blocks of an earlier selection as "
        "SMTConfig(block_indices=...)."
    )


def start_smt_scoring(model, adapter_name: str | None = None) -> None:
    """Start summing the dense gradient of every SMT target; run backward passes, then ``select_smt_blocks``."""
    adapter_name, _ = _adapter_and_config(model, adapter_name)
    _refuse_sharded(model)
    for layer in _layers(model, adapter_name):
        layer.start_scoring(adapter_name)


def set_smt_block_indices(
    model, indices: dict[str, torch.Tensor | list], adapter_name: str | None = None, optimizer=None
) -> None:
    """Install explicit blocks ``{module_name: (k, 2) [row_block, col_block]}`` (modules not named get none).

    The new delta blocks start at zero. If ``optimizer`` is given, the new block parameters replace the old ones in
    it (blocks of targets that had none join its first parameter group), so training can continue with the same
    optimizer object.
    """
    adapter_name, config = _adapter_and_config(model, adapter_name)
    layers = _layers(model, adapter_name)
    by_key = {layer.smt_layer_key[adapter_name]: layer for layer in layers}
    unknown = sorted(set(indices) - set(by_key))
    if unknown:
        raise SettingsError(
            f"Not SMT targets of adapter {adapter_name!r}: {unknown[:5]}; known: {sorted(by_key)[:3]}..."
        )
    mapping, old_params = {}, {}
    added = []
    for key, layer in by_key.items():
        old = layer.smt_weight.get(adapter_name, None)
        new = layer.set_block_indices(adapter_name, torch.as_tensor(indices.get(key, []), dtype=torch.long))
        if old is not None:
            mapping[id(old)] = new
            old_params[id(old)] = old
        elif new is not None:
            added.append(new)
        layer.stop_scoring(adapter_name)
    config.block_indices = {
        k: layer.smt_indices[adapter_name].tolist()
        for k, layer in by_key.items()
        if len(layer.smt_indices[adapter_name])
    }
    if optimizer is not None:
        _swap_in_optimizer(optimizer, mapping, old_params, added)


def select_smt_blocks(
    model, adapter_name: str | None = None, optimizer=None, num_blocks: int | None = None
) -> dict[str, list[list[int]]]:
    """Select the globally top-scoring blocks from the gradients summed since ``start_smt_scoring`` and install them.

    Scores are all-reduced (summed) across ranks first when torch.distributed is initialised, so every rank selects
    the same blocks. Returns ``{module_name: [[row_block, col_block], ...]}`` (also stored in the adapter's config).
    """
    adapter_name, config = _adapter_and_config(model, adapter_name)
    layers = _layers(model, adapter_name)
    missing = [layer.smt_layer_key[adapter_name] for layer in layers if adapter_name not in layer._smt_grad_sum]
    if missing:
        raise RunFailure(
            "select_smt_blocks needs a warm-up: call start_smt_scoring(model) and run backward passes "
            f"first (no gradient was summed for {missing[:3]})."
        )
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    scores, shapes = [], []
    for layer in layers:
        if distributed:
            dist.all_reduce(layer._smt_grad_sum[adapter_name], op=dist.ReduceOp.SUM)
        s = layer.block_scores(adapter_name, config.score)
        scores.append(s.flatten().cpu())
        shapes.append(s.shape)
    flat = torch.cat(scores)
    n = num_blocks if num_blocks is not None else resolve_num_blocks(config, model)
    if n > flat.numel():
        raise SettingsError(f"Asked for {n} SMT blocks but the targets hold only {flat.numel()}; lower num_blocks.")
    # Stable descending sort: ties go to the earlier layer / block, identically on every rank.
    chosen = torch.sort(flat, descending=True, stable=True).indices[:n]
    offsets = torch.tensor([0] + [s[0] * s[1] for s in shapes]).cumsum(0)
    selection = {}
    for layer, shape, lo, hi in zip(layers, shapes, offsets[:-1], offsets[1:]):
        local = chosen[(chosen >= lo) & (chosen < hi)] - lo
        selection[layer.smt_layer_key[adapter_name]] = torch.stack([local // shape[1], local % shape[1]], dim=1)
    set_smt_block_indices(model, selection, adapter_name=adapter_name, optimizer=optimizer)
    logger.info("SMT selected %d blocks over %d target layers", n, sum(1 for v in selection.values() if len(v)))
    return dict(config.block_indices)


def smt_warmup(
    model,
    batches: Iterable,
    num_steps: int | None = None,
    adapter_name: str | None = None,
    loss_fn: Callable | None = None,
    optimizer=None,
    progress: bool = True,
) -> dict[str, list[list[int]]]:
    """Run the SMT warm-up for a custom loop: ``num_steps`` (default ``config.warmup_steps``) forward/backward passes
    over ``batches`` summing the dense gradients (no weight changes), then select the blocks.

    ``batches`` yields dicts passed as ``model(**batch)``; the loss is ``output.loss`` or ``loss_fn(output, batch)``.
    """
    adapter_name, config = _adapter_and_config(model, adapter_name)
    num_steps = config.warmup_steps if num_steps is None else num_steps
    device = next(model.parameters()).device
    start_smt_scoring(model, adapter_name)
    was_training = model.training
    model.train()
    done = 0
    with tqdm(total=num_steps, desc="SMT warm-up", disable=not progress) as bar:
        while done < num_steps:
            progressed = False
            for batch in batches:
                batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
                out = model(**batch)
                loss = loss_fn(out, batch) if loss_fn is not None else out.loss
                loss.backward()
                model.zero_grad(set_to_none=True)
                done += 1
                progressed = True
                bar.update(1)
                if done >= num_steps:
                    break
            if not progressed:
                raise SettingsError("smt_warmup got an empty batches iterable.")
    model.train(was_training)
    return select_smt_blocks(model, adapter_name=adapter_name, optimizer=optimizer)


class SMTSelectionCallback(TrainerCallback):
    """Runs the SMT warm-up inside ``trainer.train()``: the first ``warmup_steps`` optimizer steps only sum the target
    matrices' gradients (nothing changes the weights), then the globally top-scoring blocks are selected, installed,
    and swapped into the Trainer's optimizer; training continues on the selected blocks only.

    Adapters that already have blocks (``SMTConfig.block_indices``, or a resumed run) are left as they are.
    """

    def __init__(self, warmup_steps: int | None = None, adapter_name: str | None = None):
        self.warmup_steps = warmup_steps
        self.adapter_name = adapter_name
        self._active = False
        self._switch_at: int | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        adapter_name, config = _adapter_and_config(model, self.adapter_name)
        self.adapter_name = adapter_name
        if config.block_indices:
            return
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise RunFailure(
                "SMTSelectionCallback cannot switch blocks after DDP has wrapped the model (parameter shapes change). "
                "Under a multi-process launch call hf_dtrain.tuners.smt.smt_warmup(model, dataloader) before "
                "creating the Trainer, or pass precomputed SMTConfig(block_indices=...)."
            )
        steps = self.warmup_steps if self.warmup_steps is not None else config.warmup_steps
        if args.max_steps > 0 and steps >= args.max_steps:
            raise SettingsError(
                f"SMT warm-up ({steps} steps) would use all of max_steps={args.max_steps}; lower "
                "SMTConfig.warmup_steps or raise max_steps."
            )
        self._switch_at = state.global_step + steps
        start_smt_scoring(model, adapter_name)
        self._active = True

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self._active and state.global_step >= self._switch_at:
            select_smt_blocks(model, adapter_name=self.adapter_name, optimizer=optimizer)
            self._active = False


register_folder(__name__)
