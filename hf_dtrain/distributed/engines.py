"""Which engine holds a parameter, and the guards for optimizers that need whole replicas: a sharded engine
(FSDP2, DeepSpeed ZeRO) is refused with the reason; DDP made to keep its gradients local; the optimizer inside
Accelerate's and DeepSpeed's wrappers."""

from __future__ import annotations

import torch
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from hf_dtrain.errors import SettingsError


def sharded_engine_of(p) -> str | None:
    """Which sharded engine holds ``p``, if any: an FSDP2 DTensor shard, or a DeepSpeed ZeRO-3 partition."""
    if isinstance(p, DTensor):
        return "FSDP2 (a DTensor shard)"
    if hasattr(p, "ds_id"):
        return "DeepSpeed ZeRO-3 (a partitioned parameter)"
    return None


class WholeReplicaGuard:
    """For optimizers that exchange whole gradients or parameters between replicas (1-bit LAMB, gossip): refuse
    sharded engines with the reason. ``check_construction`` at ``__init__`` (FSDP2 and ZeRO-3 hand it shards),
    ``check_step`` at each ``step`` (DeepSpeed ZeRO-1/2 swap the parameters for flat fp32 partitions after
    construction)."""

    def __init__(self, optimizer: torch.optim.Optimizer, who: str):
        self.who = who
        self.ids = [id(p) for g in optimizer.param_groups for p in g["params"]]
        for g in optimizer.param_groups:
            for p in g["params"]:
                engine = sharded_engine_of(p)
                if engine is not None:
                    raise SettingsError(self._message(engine))

    def _message(self, engine: str) -> str:
        return (
            f"{self.who} exchanges whole gradients or parameters between replicas, and its parameters are held by "
            f"{engine}: each rank holds a shard, not a replica, so there is nothing whole to exchange. Train it "
            "with DDP (no --fsdp / --deepspeed, or ZeRO stage 0), or keep the sharded engine with AdamW or Eva."
        )

    def check_step(self, optimizer: torch.optim.Optimizer) -> None:
        if [id(p) for g in optimizer.param_groups for p in g["params"]] != self.ids:
            raise SettingsError(
                self._message(
                    "an engine that replaced them after construction (DeepSpeed ZeRO stage "
                    ">= 1 hands its client optimizer flat fp32 partitions)"
                )
            )


def unwrap_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` / DeepSpeed's wrappers (or the optimizer)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def keep_gradients_local(ddp_model) -> None:
    """Register torch's ``noop_hook`` on a DDP model: DDP sends nothing and each rank keeps its own gradients, for
    optimizers that exchange gradients or parameters themselves (1-bit LAMB, the decentralized optimizers)."""
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"keep_gradients_local() needs the DistributedDataParallel model that accelerator.prepare "
            f"(or DDP(model)) returns, got {type(ddp_model).__name__}."
        )
    ddp_model.register_comm_hook(None, noop_hook)
