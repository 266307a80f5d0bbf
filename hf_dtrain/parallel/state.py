"""Whole state dicts and ``save_pretrained`` from a sharded run: FSDP2 or tensor parallelism (DTensor parameters),
DeepSpeed ZeRO-3 (partitioned parameters) or an unsharded model, with one call on every rank.

A peft model gathers only its adapter's parameters (the frozen base is never gathered, so saving the adapter of a
70B QLoRA run costs the adapter's bytes); a full model is gathered one module at a time under ZeRO-3.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hf_dtrain.models import is_tuner_layer


def _unwrap(model: nn.Module) -> nn.Module:
    """A DeepSpeed engine or Accelerate / DDP wrapper -> the user's module."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def is_fsdp2(model: nn.Module) -> bool:
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _has_dtensors(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def is_zero3(model: nn.Module) -> bool:
    """Parameters partitioned by DeepSpeed ZeRO-3 carry a ``ds_id``."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def _adapter_names(model: nn.Module) -> set[str] | None:
    """Names of the parameters a peft model saves (its tuner layers' adapter containers and modules_to_save); None
    for a model without peft adapters."""
    parts = set()
    for m in model.modules():
        if is_tuner_layer(m):
            parts.update(m.adapter_layer_names)
            parts.update(getattr(m, "other_param_names", ()))
    if not parts or not hasattr(model, "peft_config"):
        return None
    parts.add("modules_to_save")
    return {n for n, _ in model.named_parameters() if any(f".{part}." in f".{n}." for part in parts)}


def _zero3_state(model: nn.Module, names: set[str] | None, rank0: bool) -> dict[str, torch.Tensor]:
    """Gather ZeRO-3 partitions module by module (bounded memory); rank 0 keeps CPU copies."""
    import deepspeed

    state: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        own = [
            (n, p)
            for n, p in module.named_parameters(recurse=False)
            if names is None or f"{prefix}.{n}".lstrip(".") in names
        ]
        if own:
            with deepspeed.zero.GatheredParameters([p for _, p in own], modifier_rank=None):
                if rank0:
                    for n, p in own:
                        state[f"{prefix}.{n}".lstrip(".")] = p.detach().cpu().clone()
    if not rank0:
        return {}
    for n, b in model.named_buffers():
        state[n] = b.detach().cpu().clone()
    # the state dict's own keys and order (persistent buffers only)
    return {k: state[k] for k in model.state_dict() if k in state}


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole (unsharded) state dict on the CPU on rank 0, an empty dict on other ranks. Every rank must call
    it: it gathers. FSDP2 goes through ``torch.distributed.checkpoint.state_dict``; ZeRO-3 through DeepSpeed's
    ``GatheredParameters``; for a peft model under ZeRO-3 only the adapter (and buffers) are gathered."""
    model = _unwrap(model)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if is_fsdp2(model) or _has_dtensors(model):  # FSDP2 shards, tensor-parallel shards, or both
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if is_zero3(model):
        return _zero3_state(model, _adapter_names(model), rank0)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()} if rank0 else {}


def save_pretrained(model: nn.Module, save_directory: str, **kwargs) -> None:
    """``model.save_pretrained`` from a sharded run (a peft model saves its adapter only: the files equal those of
    an unsharded run): gathers on every rank, writes on rank 0, then a barrier. Every rank must call it; it also
    takes a DeepSpeed engine or an Accelerate-prepared model."""
    model = _unwrap(model)
    state = full_state_dict(model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        model.save_pretrained(save_directory, state_dict=state, **kwargs)
    if dist.is_initialized():
        dist.barrier()


def local_param_bytes(model) -> int:
    """Bytes of parameters this process holds: the local shard of a DTensor (FSDP2), the partition of a ZeRO-3
    parameter, else the whole tensor."""
    total = 0
    for p in model.parameters():
        local = p.ds_tensor if hasattr(p, "ds_tensor") else p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total
