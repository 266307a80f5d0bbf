"""What hf_dtrain's distributed pieces share: byte accounting of what goes on the wire, and checks that every rank
agrees before the first collective of a method (a mismatch is a clear error, not a hang)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass
class WireStats:
    """Bytes this rank hands to collectives, per optimizer step.

    Counted as the payload of each collective call (``numel * element_size`` of the tensor this rank contributes),
    the same way for every method and for the dense baseline, so ratios between methods are exact. (A ring all-reduce
    moves ``2 (N - 1) / N`` times its payload over each link; that factor is common to all all-reduce methods.)
    """

    steps: list[int] = field(default_factory=list)  # payload bytes of every finished step
    current: int = 0
    collectives: int = 0  # collective calls in the current step

    def add(self, tensor: torch.Tensor) -> None:
        self.current += tensor.numel() * tensor.element_size()
        self.collectives += 1

    def end_step(self) -> None:
        self.steps.append(self.current)
        self.current = 0
        self.collectives = 0

    @property
    def last_step_bytes(self) -> Optional[int]:
        return self.steps[-1] if self.steps else None


def unwrap_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` / DeepSpeed's wrappers (or the optimizer)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


# bit i of a byte holds position i (little-endian bit order)
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A boolean vector as uint8, 8 positions per byte (little-endian bit order, zero-padded): the bitmaps of the
    S2 Reducer and the signs of 1-bit LAMB."""
    n = mask.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask.reshape(-1)
    return (padded.view(-1, 8) * _BIT_WEIGHTS.to(mask.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` positions as a boolean vector."""
    bits = packed.unsqueeze(1).bitwise_and(_BIT_WEIGHTS.to(packed.device)).ne(0)
    return bits.reshape(-1)[:n]


def keep_gradients_local(ddp_model) -> None:
    """Register torch's ``noop_hook`` on a DDP model: DDP sends nothing and each rank keeps its own gradients, for
    optimizers that exchange gradients or parameters themselves (1-bit LAMB, the decentralized optimizers)."""
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"keep_gradients_local() needs the DistributedDataParallel model that accelerator.prepare "
                        f"(or DDP(model)) returns, got {type(ddp_model).__name__}.")
    ddp_model.register_comm_hook(None, noop_hook)


def world_size_of(process_group=None) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(process_group)


def check_same_across_ranks(value: Any, what: str, process_group=None) -> None:
    """Raise a ``ValueError`` on every rank unless ``value`` (JSON-serialisable) is the same on all ranks. Uses one
    small all-gather, bounded by the process group's timeout."""
    if world_size_of(process_group) == 1:
        return
    digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
    gathered: list = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, (digest, value), group=process_group)
    if len({d for d, _ in gathered}) > 1:
        per_rank = {r: v for r, (_, v) in enumerate(gathered)}
        raise ValueError(f"{what} differs across ranks: {per_rank}. Give every rank the same {what} (the same recipe "
                         "or config file on every host).")


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """``all_gather_single`` (torch >= 2.13), else ``all_gather_into_tensor`` (its old name, deprecated in 2.13)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """``reduce_scatter_single`` (torch >= 2.13), else ``reduce_scatter_tensor`` (its old name)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)


def release_process_group() -> None:
    """End a distributed run cleanly: collect what still references DDP models, then destroy the default process
    group. Freeing a DDP model after its gloo group is gone (or at interpreter exit) can abort or hang the process
    (pytorch/pytorch#56297); call this after the last collective, once the DDP model's own references are dropped
    (``del model`` in the caller)."""
    import gc

    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
