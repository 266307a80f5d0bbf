"""DELTA's executor: applies a plan to the decoder layers.

* **recompute**: the layer runs under non-reentrant ``torch.utils.checkpoint`` (only its input is kept; its forward
  runs again in backward);
* **offload**: what the layer saves for backward goes to the offload tier through ``saved_tensors_hooks`` and comes
  back when backward needs it. On a CPU-only host the tier is a memory-mapped file in a private directory (the same
  scheduler, a slower tier); buffers are one reused allocation, not one per tensor;
* **keep**: as plain training.

Values are copied exactly and recomputation is deterministic on CPU, so losses and gradients equal plain training
bit for bit. ``stats`` counts, per step, the bytes saved in memory (unique storages, parameters excluded, the
inputs of recomputed layers included) and the bytes offloaded.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class FileTier:
    """Offload tier for CPU hosts: one memory-mapped file (mode 0600 in a 0700 directory), used as a bump allocator
    that is reset every step; it grows (a new mapping) when a step needs more."""

    def __init__(self, capacity: int = 64 << 20, directory: Optional[str] = None):
        self.dir = tempfile.mkdtemp(prefix="hf_dtrain_delta_", dir=directory)  # 0700
        self.path = os.path.join(self.dir, "tier.bin")
        self.capacity, self.offset, self.buffer = 0, 0, None
        self.live: set = set()  # offsets stored and not yet loaded back (gradient accumulation keeps several)
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, capacity)
        os.close(fd)
        self.buffer = torch.from_file(self.path, shared=True, size=capacity, dtype=torch.uint8)
        self.capacity = capacity

    def reset(self) -> None:
        self.offset = 0
        self.live.clear()

    def store(self, t: torch.Tensor):
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        n = flat.numel()
        if self.offset + n > self.capacity:
            if self.offset == 0:
                self._grow(max(n, 2 * self.capacity))
            else:  # stored tensors live in the current mapping: spill this one to its own file-backed buffer
                return ("own", t.detach().clone(), None, None, None)
        self.buffer[self.offset:self.offset + n].copy_(flat)
        handle = ("tier", self.offset, tuple(t.shape), t.stride(), t.dtype)
        self.live.add(self.offset)
        self.offset += (n + 63) // 64 * 64
        return handle

    def load(self, handle) -> torch.Tensor:
        kind, a, shape, stride, dtype = handle
        if kind == "own":
            return a
        self.live.discard(a)
        numel = 1
        for d in shape:
            numel *= d
        n = torch.empty((), dtype=dtype).element_size() * numel
        data = self.buffer[a:a + n].view(dtype).reshape(shape)
        out = torch.empty_strided(shape, stride, dtype=dtype)
        out.copy_(data)
        return out

    def close(self) -> None:
        try:
            os.unlink(self.path)
            os.rmdir(self.dir)
        except OSError:
            pass


@dataclass
class StepStats:
    saved_bytes: int = 0
    offloaded_bytes: int = 0
    history: list = field(default_factory=list)


class DeltaExecutor:
    """Installs a plan on ``layers`` (name, module) of ``model``; ``remove()`` restores the model."""

    def __init__(self, model: nn.Module, layers: list[tuple[str, nn.Module]], tier):
        self.model, self.layers, self.tier = model, layers, tier
        self.actions = {name: "keep" for name, _ in layers}
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.current: Optional[str] = None
        self._storages: dict[int, int] = {}
        self.stats = StepStats()
        self._orig = {}
        for name, layer in layers:
            self._orig[name] = layer.forward
            layer.forward = self._wrap(name, layer.forward)

    def set_plan(self, actions: dict[str, str]) -> None:
        self.actions = dict(actions)

    def _wrap(self, name, forward):
        def run(*args, **kwargs):
            action = self.actions.get(name, "keep") if torch.is_grad_enabled() else "keep"
            previous, self.current = self.current, name
            try:
                if action == "recompute":
                    for a in list(args) + list(kwargs.values()):
                        if torch.is_tensor(a):
                            self._count(a)  # the checkpoint keeps its inputs
                    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
                return forward(*args, **kwargs)
            finally:
                self.current = previous

        return run

    def _count(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self.params:
            self._storages[ptr] = max(self._storages.get(ptr, 0), st.nbytes())

    def pack(self, t: torch.Tensor):
        if t.untyped_storage().data_ptr() in self.params:
            return t
        if self.current is not None and self.actions.get(self.current) == "offload":
            self.stats.offloaded_bytes += t.numel() * t.element_size()
            return ("delta-offload", self.tier.store(t))
        self._count(t)
        return t

    def unpack(self, packed):
        if isinstance(packed, tuple) and len(packed) == 2 and packed[0] == "delta-offload":
            return self.tier.load(packed[1])
        return packed

    def hooks(self):
        """The context to run a training forward in (the model-level saved-tensor hooks)."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def begin_step(self) -> None:
        self._storages = {}
        self.stats.saved_bytes = self.stats.offloaded_bytes = 0
        if not getattr(self.tier, "live", None):  # nothing offloaded is still waiting for its backward
            self.tier.reset()

    def end_step(self) -> None:
        self.stats.saved_bytes = sum(self._storages.values())
        self.stats.history.append({"saved_bytes": self.stats.saved_bytes,
                                   "offloaded_bytes": self.stats.offloaded_bytes})

    def remove(self) -> None:
        for name, layer in self.layers:
            layer.forward = self._orig[name]
