"""Persisted snapshots that reshard: every ``persist_every``-th snapshot is also written as a
``torch.distributed.checkpoint`` (DCP) checkpoint, in DCP's Hugging Face safetensors layout
(``HuggingFaceStorageWriter(save_distributed=True)``: one safetensors file per rank, each tensor's global offsets in
its header), so ``dcp.load`` can read it into any sharding and any world size, and no file is ever unpickled.

Layout of ``<persist_dir>/snapshot-<step>/``:

* ``rank<r>.safetensors`` + ``rank<r>.json``: the rank's whole snapshot slot (the exact, checksummed same-world
  restore, written by :class:`~hf_dtrain.fault.SnapshotEngine` as before);
* ``dcp/shard-*.safetensors``: the model's and the optimizer's tensors by fully qualified name (FQN), each rank
  writing its own shards (``model.<fqn>``, ``optim.state.<fqn>.<key>``), as ``get_state_dict`` names them;
* ``replicated.safetensors``: what is not sharded, from rank 0 (scheduler, scaler, RNGs, the caller's ``extra``,
  the optimizer's param groups by FQN), with the run identity and the world size in its metadata. Written last,
  after every rank's shards: its presence marks the DCP checkpoint complete.

The shards are written from the snapshot's bytes (not from the live model, which has moved on), by the engine's
persist thread over a process group of its own, so training does not wait for the disk.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint._hf_utils import CUSTOM_METADATA_KEY, SAVED_OFFSETS_KEY
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from hf_dtrain.errors import SettingsError

from .state import flatten_state, unflatten_state

DCP_DIR = "dcp"
REPLICATED = "replicated.safetensors"
# module wrappers that put a name into parameter paths but not into get_state_dict's FQNs
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_fqn(name: str) -> str:
    """``name`` as ``torch.distributed.checkpoint.state_dict`` names it (wrapper modules' prefixes removed)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _meta(t: torch.Tensor) -> tuple | None:
    if isinstance(t, DTensor):
        return (t.device_mesh, tuple(t.placements), t.shape, t.stride(), tuple(t.to_local().shape))
    return None


def _as_global(local: torch.Tensor, meta: tuple | None) -> torch.Tensor:
    """A local shard from the snapshot as the DTensor it was (no communication), or a replicated tensor as is."""
    if meta is None:
        return local

    mesh, placements, shape, stride, _ = meta
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _global_offset(t: torch.Tensor) -> list[int] | None:
    """Where this rank's shard of a DTensor starts in the global tensor; None for a tensor every rank holds whole."""
    if not isinstance(t, DTensor):
        return None
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return [int(o) for o in offset]


class NotReshardable(ValueError):
    """What a DCP copy cannot place: an optimizer that holds a tensor that is not one of the model's parameters, or
    keys its state by its own names, not by parameter (peft's ``LoraFAOptimizer`` does both). The disk copy is then
    each rank's exact one only, for a restart on the same world size."""


def _index(idx) -> int:
    try:
        return int(idx)
    except ValueError:
        raise NotReshardable(
            f"the optimizer keys its state by its own names ({idx!r}), not by parameter, so a copy for another world "
            "size cannot lay its state out"
        ) from None


class ShardMap:
    """How a snapshot's tensors map to DCP's FQNs and global tensors, read once from the live model and optimizer:
    the model state's keys, each optimizer parameter index's FQN, and the DTensor layout (mesh, placements, global
    shape and stride) of every sharded one."""

    def __init__(self, model_state: dict[str, torch.Tensor], model: nn.Module, optimizer=None):
        self.model_keys = {k: canonical_fqn(k) for k in model_state}
        self.model_meta = {k: _meta(t) for k, t in model_state.items()}
        # where this rank's shard of each sharded tensor starts, by FQN (recorded in every snapshot: another world
        # size can then read the snapshots of the ranks that took them as a DCP checkpoint, see ``write_chunks``)
        self.offsets = {self.model_keys[k]: o for k, t in model_state.items() if (o := _global_offset(t)) is not None}
        names = {id(p): canonical_fqn(n) for n, p in model.named_parameters()}
        self.param_fqns: list[str] = []
        self.param_meta: list[tuple | None] = []
        if optimizer is not None:
            for g in optimizer.param_groups:
                for p in g["params"]:
                    if id(p) not in names:
                        raise NotReshardable(
                            f"the optimizer holds a tensor ({tuple(p.shape)}) that is not one of the model's "
                            "parameters, so its state has no name a copy for another world size could use"
                        )
                    self.param_fqns.append(names[id(p)])
                    self.param_meta.append(_meta(p))

    def split(self, state: dict) -> tuple[dict, dict]:
        """``state`` (a snapshot, unflattened) as ``(sharded, replicated)``: the tensors DCP writes, with local shards
        made DTensors again, and everything else (JSON-able or small tensors) for ``replicated.safetensors``."""
        sharded: dict[str, Any] = {
            "model": {self.model_keys[k]: _as_global(t, self.model_meta[k]) for k, t in state["model"].items()}
        }
        replicated = self.replicated(state)
        if "optimizer" in state:
            opt_state = {}
            for idx, st in state["optimizer"].get("state", {}).items():
                fqn, meta = self.param_fqns[_index(idx)], self.param_meta[_index(idx)]
                local_shape = meta[4] if meta is not None else None
                tensors = {}
                for key, v in st.items():
                    if torch.is_tensor(v):
                        # state shaped like the parameter's shard is sharded like it; scalars (AdamW's step) replicate
                        tensors[key] = _as_global(v, meta if v.dim() and tuple(v.shape) == local_shape else None)
                opt_state[fqn] = tensors
            sharded["optim"] = {"state": opt_state}
        return sharded, replicated

    def replicated(self, state: dict) -> dict:
        """What of a snapshot ``state`` is not sharded: scheduler, scaler, RNGs, ``extra``, and the optimizer's
        param groups (by FQN) and non-tensor state (``replicated.safetensors``)."""
        replicated: dict[str, Any] = {k: state[k] for k in ("rng", "extra", "scheduler", "scaler") if k in state}
        if "optimizer" in state:
            other: dict = {}
            for idx, st in state["optimizer"].get("state", {}).items():
                for key, v in st.items():
                    if not torch.is_tensor(v):
                        other.setdefault(self.param_fqns[_index(idx)], {})[key] = v
            groups = []
            start = 0
            for g in state["optimizer"].get("param_groups", []):
                n = len(g["params"])
                groups.append(
                    {**{k: v for k, v in g.items() if k != "params"}, "params": self.param_fqns[start : start + n]}
                )
                start += n
            replicated["optimizer"] = {"param_groups": groups, "other": other}
        return replicated

    def chunks(self, state: dict, offsets: dict[str, list[int]], whole: bool) -> dict[str, tuple]:
        """Another rank's snapshot ``state`` (unflattened) as DCP's flat keys -> ``(tensor, global offset)``, with the
        offsets that rank recorded: its shards of sharded tensors, and with ``whole`` the tensors every rank holds
        (written once, by one rank). Parameter names come from this run's model and optimizer (the same job: the
        same parameters in the same order)."""
        out: dict[str, tuple] = {}
        local_shapes = {}
        for key, t in state["model"].items():
            fqn = self.model_keys[key]
            local_shapes[fqn] = tuple(t.shape)
            if fqn in offsets or whole:
                out[f"model.{fqn}"] = (t, offsets.get(fqn, [0] * t.dim()))
        for idx, st in state.get("optimizer", {}).get("state", {}).items():
            fqn = self.param_fqns[_index(idx)]
            for k, v in st.items():
                if not torch.is_tensor(v):
                    continue
                sharded = fqn in offsets and v.dim() and tuple(v.shape) == local_shapes.get(fqn)
                if sharded or whole:
                    out[f"optim.state.{fqn}.{k}"] = (v, offsets[fqn] if sharded else [0] * v.dim())
        return out


def write_chunks(path: str, chunks: dict[str, tuple], write) -> None:
    """``chunks`` (from :meth:`ShardMap.chunks`) as one file of a DCP checkpoint in DCP's Hugging Face safetensors
    layout (what ``HuggingFaceStorageWriter(save_distributed=True)`` writes: each tensor's global offsets in the
    header), written by ``write(path, bytes)``. Empty shards are left out."""
    from safetensors.torch import save

    kept = {k: (t, o) for k, (t, o) in chunks.items() if t.numel()}
    tensors = {k: t.detach().cpu().contiguous() for k, (t, _) in kept.items()}
    info = {k: {SAVED_OFFSETS_KEY: list(o)} for k, (_, o) in kept.items()}
    write(path, save(tensors, metadata={CUSTOM_METADATA_KEY: json.dumps(info), "DCP_VERSION": "1.0"}))


def save(directory: str, sharded: dict, process_group=None) -> None:
    """Write ``sharded`` (from :meth:`ShardMap.split`) as a DCP checkpoint in ``directory`` (owner-only)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    dcp.save(
        sharded, storage_writer=HuggingFaceStorageWriter(directory, save_distributed=True), process_group=process_group
    )
    for name in os.listdir(directory):
        os.chmod(os.path.join(directory, name), 0o600)


def write_replicated(path: str, replicated: dict, metadata: dict[str, str], write) -> None:
    """``replicated`` as one safetensors file at ``path`` (tensors plus a JSON skeleton in its metadata), written by
    ``write(path, bytes)`` (atomically, owner-only)."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    skeleton = flatten_state(replicated, tensors)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    write(path, save(tensors, metadata={**metadata, "skeleton": json.dumps(skeleton, separators=(",", ":"))}))


def read_replicated(path: str) -> tuple[dict[str, str], dict]:
    """Metadata and state of a ``replicated.safetensors``."""
    with safe_open(path, framework="pt") as f:
        metadata = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    return metadata, unflatten_state(json.loads(metadata["skeleton"]), tensors)


def template(model: nn.Module, optimizer, model_keys: list[str]) -> tuple[dict, dict]:
    """What DCP loads into: this run's model and optimizer state (``get_state_dict``: its own sharding, the
    optimizer's state initialised if empty) restricted to the snapshot's model keys; and the optimizer state dict
    whose ``state`` it fills."""
    msd, osd = get_state_dict(model, optimizer if optimizer is not None else [])
    target: dict[str, Any] = {"model": {k: msd[k] for k in model_keys if k in msd}}
    if optimizer is not None:
        target["optim"] = {"state": osd["state"]}
    return target, osd


def stored_model_keys(directory: str) -> list[str]:
    """The model's names in the DCP checkpoint in ``directory``, every rank's (the stages of a pipeline each wrote
    their own)."""
    stored = HuggingFaceStorageReader(directory).read_metadata().state_dict_metadata
    return sorted(k[len("model.") :] for k in stored if k.startswith("model."))


def differences(target: dict, directory: str, model_keys: list[str]) -> list[str]:
    """What keeps the checkpoint in ``directory`` from loading into ``target``: names it lacks or holds beyond this
    run's, and global shapes that differ (a sharding DCP cannot map)."""
    stored = HuggingFaceStorageReader(directory).read_metadata().state_dict_metadata
    flat, _ = flatten_state_dict(target)
    out = [f"model.{k}: in the snapshot, not in this model" for k in model_keys if f"model.{k}" not in flat]
    for key, t in flat.items():
        if key not in stored:
            out.append(f"{key}: in this run, not in the snapshot")
        elif tuple(stored[key].size) != tuple(t.shape):
            out.append(f"{key}: shape {tuple(stored[key].size)} in the snapshot, {tuple(t.shape)} here")
    out += [f"{key}: in the snapshot, not in this run" for key in stored if key not in flat]
    return out


def load(model: nn.Module, optimizer, directory: str, target: dict, osd: dict, replicated: dict) -> None:
    """Load the DCP checkpoint in ``directory`` into ``target`` (any sharding: DCP reads the overlapping parts of
    each rank's file), then into the model and the optimizer (param groups by FQN from ``replicated``)."""
    dcp.load(target, storage_reader=HuggingFaceStorageReader(directory))
    optim_sd = None
    if optimizer is not None:
        state = target["optim"]["state"]
        for fqn, values in replicated.get("optimizer", {}).get("other", {}).items():
            state.setdefault(fqn, {}).update(values)
        # the hyper-parameters of each group as stored, its parameters as this run names them: rank 0 wrote the
        # groups, and a pipeline's rank 0 holds only its own stages' parameters
        stored = replicated.get("optimizer", {}).get("param_groups") or []
        if stored and len(stored) != len(osd["param_groups"]):
            raise SettingsError(
                f"the snapshot's optimizer has {len(stored)} parameter groups and this run's has "
                f"{len(osd['param_groups'])}: build the optimizer as the run that took it did"
            )
        groups = [{**(stored[i] if stored else {}), "params": g["params"]} for i, g in enumerate(osd["param_groups"])]
        optim_sd = {"state": state, "param_groups": groups}
    set_state_dict(
        model,
        optimizer if optimizer is not None else [],
        model_state_dict=target["model"],
        optim_state_dict=optim_sd or {},
        options=StateDictOptions(strict=False),
    )
