"""FSDP2 shards in a snapshot: each rank stores and restores its own part of every DTensor parameter (and of the
optimizer state on it), in place. The DCP copy that reshards them onto another world size is ``reshard.py``."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from hf_dtrain.distributed.engines import unwrap_optimizer


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of an FSDP2 DTensor (a view that writes through), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def as_shards(optimizer, state: dict) -> dict:
    """A restored optimizer state dict with each DTensor parameter's state tensors (stored as this rank's local
    shards) made DTensors again, with the parameter's mesh and placements: what the optimizer held when it was
    snapshotted. Scalars (AdamW's ``step``) stay as they are."""
    params = [p for g in unwrap_optimizer(optimizer).param_groups for p in g["params"]]
    out = dict(state)
    out["state"] = {}
    for idx, st in state.get("state", {}).items():
        # torch's optimizers key the state by index; some (hf_dtrain's own) by parameter name: no DTensor there
        i = int(idx) if isinstance(idx, int) or (isinstance(idx, str) and idx.isdigit()) else None
        p = params[i] if i is not None and i < len(params) else None
        if isinstance(p, DTensor):
            local = p.to_local().shape
            st = {
                k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
                if torch.is_tensor(v) and v.dim() and v.shape == local
                else v
                for k, v in st.items()
            }
        out["state"][idx] = st
    return out
