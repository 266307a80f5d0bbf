"""FSDP2 shards in a snapshot: each rank stores and restores its own part of every DTensor parameter (and of the
optimizer state on it), in place. The DCP copy that reshards them onto another world size is ``reshard.py``."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from hf_dtrain.distributed.engines import unwrap_optimizer

from .errors import SnapshotMismatch
from .state import SHARD_LAYOUT, dtensor_layout


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of an FSDP2 DTensor (a view that writes through), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def as_shards(optimizer, state: dict) -> dict:
    """A restored optimizer state dict with each state tensor that was a DTensor (stored as this rank's local shard,
    with its layout) made a DTensor again, on the mesh and placements of an optimizer parameter with that layout:
    what the optimizer held when it was snapshotted, however the optimizer keys its state (torch's by parameter
    index, peft's LoRA-FA by module name). A shard whose layout no parameter has is a ``SnapshotMismatch`` naming it,
    before any step. Scalars (AdamW's ``step``) stay as they are. A state stored without layouts (an earlier
    snapshot) is matched by parameter index."""
    params = [p for g in unwrap_optimizer(optimizer).param_groups for p in g["params"]]
    layouts = {dtensor_layout(p): p for p in params if isinstance(p, DTensor)}
    out = dict(state)
    out["state"] = {}
    for idx, st in state.get("state", {}).items():
        i = int(idx) if isinstance(idx, int) or (isinstance(idx, str) and idx.isdigit()) else None
        by_index = params[i] if i is not None and i < len(params) else None
        out["state"][idx] = {k: _as_shard(v, layouts, by_index, f"{idx}.{k}") for k, v in st.items()}
    return out


def _as_shard(v, layouts: dict, by_index, where: str):
    if not torch.is_tensor(v) or not v.dim():
        return v
    layout = getattr(v, SHARD_LAYOUT, None)
    if layout is not None:
        p = layouts.get(layout)
        if p is None:
            raise SnapshotMismatch(
                f"optimizer state {where} was a shard laid out as {layout}, which no parameter of this optimizer "
                "is: the run was built differently from the one that took the snapshot (sharding, world size or "
                "method); relaunch with the same settings, or --fault-tolerance.fresh-start true"
            )
    elif isinstance(by_index, DTensor) and v.shape == by_index.to_local().shape:
        p = by_index
    else:
        return v
    return DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
