"""Training state as bytes without pickle: nested state dicts are split into tensors and a JSON skeleton, and written
in the safetensors layout (8-byte header length, JSON header, raw tensor data), so a snapshot slot in memory is
byte for byte a ``.safetensors`` file (``safetensors.torch.load_file`` reads a persisted one) and nothing is ever
unpickled. The header is padded to a reserved size so the data offsets stay fixed from one snapshot to the next.
"""

from __future__ import annotations

import functools
import json
import random
import struct
from typing import Any

import numpy as np
import torch

from hf_dtrain.errors import SettingsError

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
TORCH_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
ALIGN = 64


SHARD_LAYOUT = "_hf_dtrain_dtensor_layout"


def flatten_state(obj: Any, tensors: dict[str, torch.Tensor], path: str = "state") -> Any:
    """The JSON skeleton of ``obj``; its tensors (and numpy arrays) go into ``tensors`` under their path. Keeps the
    types JSON loses (int dict keys, tuples). Anything else is a ``TypeError`` naming where it is."""
    if isinstance(obj, torch.Tensor):
        from torch.distributed.tensor import DTensor

        if isinstance(obj, DTensor):  # an FSDP2 shard (optimizer state): this rank's part, and the layout it had
            tensors[path] = obj.to_local()
            return {"__t": path, "__layout": dtensor_layout(obj)}
        tensors[path] = obj
        return {"__t": path}
    if isinstance(obj, np.ndarray):
        tensors[path] = torch.from_numpy(np.ascontiguousarray(obj))
        return {"__np": path}
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(
                    f"snapshot state: key {k!r} at {path} is a {type(k).__name__}; only str and int keys are stored"
                )
            items.append([k, flatten_state(v, tensors, f"{path}.{k}")])
        return {"__d": items}
    if isinstance(obj, (list, tuple)):
        if all(
            type(v) is int for v in obj
        ):  # Python's RNG state: 625 ints, stored as they are (one pass, no recursion)
            return {"__tu": list(obj)} if isinstance(obj, tuple) else list(obj)
        out = [flatten_state(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]
        return {"__tu": out} if isinstance(obj, tuple) else out
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        if isinstance(obj, float) and not np.isfinite(obj):
            return {"__f": repr(obj)}
        return obj
    if isinstance(obj, torch.dtype):
        return {"__dt": str(obj).replace("torch.", "")}
    raise TypeError(
        f"snapshot state: {path} is a {type(obj).__name__}, which is not stored (tensors, numbers, "
        "strings, lists, tuples and dicts are); keep it out of the state or convert it"
    )


def dtensor_layout(t) -> str:
    """A DTensor's layout as text: global shape and stride, placements, the mesh's ranks and dimension names. A
    restored shard is made a DTensor again on the layout of a parameter with the same text (``fsdp.as_shards``)."""
    return f"{tuple(t.shape)}|{tuple(t.stride())}|{tuple(t.placements)}|{_mesh_text(t.device_mesh)}"


@functools.lru_cache(maxsize=16)
def _mesh_text(mesh) -> str:  # once per mesh, not once per state tensor per snapshot
    return f"{mesh.mesh.flatten().tolist()}|{mesh.mesh_dim_names}"


def unflatten_state(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``flatten_state``'s inverse. A tensor that was a DTensor's local shard comes back as that shard with the
    DTensor's layout in ``SHARD_LAYOUT`` (an attribute): the restore turns it back into a DTensor."""
    if isinstance(skeleton, list):
        return [unflatten_state(v, tensors) for v in skeleton]
    if isinstance(skeleton, dict):
        if "__t" in skeleton:
            t = tensors[skeleton["__t"]]
            if "__layout" in skeleton:
                setattr(t, SHARD_LAYOUT, skeleton["__layout"])
            return t
        if "__np" in skeleton:
            return tensors[skeleton["__np"]].numpy()
        if "__d" in skeleton:
            return {k: unflatten_state(v, tensors) for k, v in skeleton["__d"]}
        if "__tu" in skeleton:
            return tuple(unflatten_state(v, tensors) for v in skeleton["__tu"])
        if "__f" in skeleton:
            return float(skeleton["__f"])
        if "__dt" in skeleton:
            return getattr(torch, skeleton["__dt"])
    return skeleton


def rng_state() -> dict:
    """Every RNG a training step draws from: Python, NumPy, torch CPU and (when initialised) every CUDA device."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(tuple(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Layout:
    """Where each tensor lives in a snapshot slot: the safetensors header (padded to ``header_capacity``, a multiple
    of 64) then the tensors back to back, widest dtype first. Built once per set of tensor shapes."""

    def __init__(self, tensors: dict[str, torch.Tensor], header_capacity: int = 0):
        self.entries: dict[str, tuple[str, list[int], int, int]] = {}
        for key, t in tensors.items():
            if t.dtype not in SAFETENSORS_DTYPES:
                raise TypeError(f"snapshot state: {key} has dtype {t.dtype}, which safetensors does not store")
        # safetensors wants the tensors back to back; widest elements first keeps every tensor naturally aligned
        offset = 0
        for key in sorted(tensors, key=lambda k: -tensors[k].element_size()):
            t = tensors[key]
            n = t.numel() * t.element_size()
            self.entries[key] = (SAFETENSORS_DTYPES[t.dtype], list(t.shape), offset, offset + n)
            offset += n
        self.data_bytes = offset
        self.header_capacity = header_capacity

    def matches(self, tensors: dict[str, torch.Tensor]) -> bool:
        return (
            len(tensors) == len(self.entries)
            and all(k in self.entries for k in tensors)
            and all(
                self.entries[k][0] == SAFETENSORS_DTYPES.get(t.dtype) and self.entries[k][1] == list(t.shape)
                for k, t in tensors.items()
            )
        )

    def header(self, metadata: dict[str, str]) -> bytes:
        """The safetensors header bytes (length prefix included), padded with spaces to the reserved capacity; grows
        the capacity (a new layout for the slot) when the metadata outgrows it."""
        head = {k: {"dtype": d, "shape": s, "data_offsets": [a, b]} for k, (d, s, a, b) in self.entries.items()}
        head["__metadata__"] = metadata
        raw = json.dumps(head, separators=(",", ":")).encode()
        need = -(-(len(raw) + 8) // ALIGN) * ALIGN
        if need > self.header_capacity:
            self.header_capacity = need + 4096  # room for counters and RNG states to grow
        raw += b" " * (self.header_capacity - 8 - len(raw))
        return struct.pack("<Q", len(raw)) + raw

    @property
    def total_bytes(self) -> int:
        return self.header_capacity + self.data_bytes


def parse(buf) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Metadata and tensors (views into ``buf``, not copies) of a slot in the safetensors layout."""
    mv = memoryview(buf)
    if len(mv) < 8:
        raise SettingsError("snapshot slot is shorter than a safetensors header")
    (n,) = struct.unpack("<Q", mv[:8])
    if n > len(mv) - 8:
        raise SettingsError(f"snapshot slot header claims {n} bytes but the slot has {len(mv) - 8}")
    head = json.loads(bytes(mv[8 : 8 + n]))
    metadata = head.pop("__metadata__", {})
    base = 8 + n
    tensors = {}
    for key, e in head.items():
        a, b = e["data_offsets"]
        dtype = TORCH_DTYPES[e["dtype"]]
        raw = (
            torch.frombuffer(mv[base + a : base + b], dtype=torch.uint8) if b > a else torch.empty(0, dtype=torch.uint8)
        )
        tensors[key] = raw.view(dtype).reshape(e["shape"])
    return metadata, tensors
