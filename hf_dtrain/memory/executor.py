"""DELTA's executor: applies a plan to the planning units (decoder layers, or their sub-modules).

* **recompute**: the layer runs under non-reentrant ``torch.utils.checkpoint`` (only its input is kept; its forward
  runs again in backward);
* **offload**: what the layer saves for backward goes to the offload tier through ``saved_tensors_hooks`` and comes
  back when backward needs it. On a CPU-only host the tier is a file in a private directory, written and read at
  offsets of one reused region (the same scheduler, a slower tier);
* **keep**: as plain training.

Values are copied exactly and recomputation is deterministic on CPU, so losses and gradients equal plain training
bit for bit. ``stats`` counts, per step, the bytes saved in memory (unique storages, parameters excluded, the
inputs of recomputed layers included) and the bytes offloaded.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Cache

from .profiler import GroupProfile, Profile, decoder_layers, measure_tier_bandwidth


class FileTier:
    """Offload tier for CPU hosts: one file (mode 0600 in a 0700 directory) written and read with ``pwrite`` /
    ``preadv`` at offsets of a bump allocator reset every step. Not memory-mapped: the data lives in the page cache
    or on disk, outside the process's resident memory, which is the point of offloading on a host without a GPU."""

    def __init__(self, directory: str | None = None):
        self.dir = tempfile.mkdtemp(prefix="hf_dtrain_delta_", dir=directory)  # 0700
        self.path = os.path.join(self.dir, "tier.bin")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.offset = 0
        self.live: set = set()  # offsets stored and not yet loaded back (gradient accumulation keeps several)

    def reset(self) -> None:
        self.offset = 0
        self.live.clear()

    def store(self, t: torch.Tensor):
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        n = flat.numel()
        written = os.pwrite(self.fd, memoryview(flat.numpy()), self.offset)
        if written != n:
            raise OSError(f"DELTA offload tier: wrote {written} of {n} bytes to {self.path} (disk full?)")
        handle = (self.offset, n, tuple(t.shape), t.stride(), t.dtype)
        self.live.add(self.offset)
        self.offset += (n + 4095) // 4096 * 4096
        return handle

    def load(self, handle) -> torch.Tensor:
        offset, n, shape, stride, dtype = handle
        self.live.discard(offset)
        raw = torch.empty(n, dtype=torch.uint8)
        got = os.preadv(self.fd, [memoryview(raw.numpy())], offset)
        if got != n:
            raise OSError(f"DELTA offload tier: read {got} of {n} bytes from {self.path}")
        out = torch.empty_strided(shape, stride, dtype=dtype)
        out.copy_(raw.view(dtype).reshape(shape))
        return out

    def close(self) -> None:
        fd, self.fd = getattr(self, "fd", None), None
        if fd is None:  # closed already: never close the number again (another file may own it by now)
            return
        for release in (lambda: os.close(fd), lambda: os.unlink(self.path), lambda: os.rmdir(self.dir)):
            with contextlib.suppress(OSError):
                release()

    def __del__(self):
        self.close()


class PinnedTier:
    """Offload tier for CUDA devices: host memory from one pinned region reused across steps (a bump allocator; no
    per-tensor ``cudaHostAlloc``, which costs milliseconds each), device-to-host copies on a side stream that overlap
    the forward, and host-to-device copies that the executor starts one layer ahead during backward (``prefetch``).

    Stream rules: the side stream waits for the compute stream before copying a tensor out, and the tensor is
    recorded on the side stream so the caching allocator does not reuse its memory before the copy ends; a loaded
    tensor makes the compute stream wait for its copy and is recorded on the compute stream.
    Chosen at run time when the model is on a CUDA device (not exercised on CPU-only hosts)."""

    def __init__(self, device, capacity: int = 64 << 20):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self.capacity, self.offset, self.region = 0, 0, None
        self.live: set = set()
        self._prefetched: dict[int, torch.Tensor] = {}
        self._spills = 0
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        self.region = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        self.capacity = capacity

    def reset(self) -> None:
        self.offset = 0
        self.live.clear()
        self._prefetched.clear()

    def store(self, t: torch.Tensor):
        n = t.numel() * t.element_size()
        if self.offset + n > self.capacity:
            if self.offset == 0:
                self._grow(max(n, 2 * self.capacity))
                dst = self.region[:n]
            else:  # the region holds this step's earlier tensors: this one gets its own pinned buffer
                dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        else:
            dst = self.region[self.offset : self.offset + n]
        own = dst.data_ptr() != self.region[self.offset :].data_ptr()
        if own:
            self._spills += 1
        key = -self._spills if own else self.offset
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            dst.copy_(t.detach().contiguous().reshape(-1).view(torch.uint8), non_blocking=True)
        t.record_stream(self.stream)
        done = torch.cuda.Event()
        done.record(self.stream)
        if key >= 0:
            self.offset += (n + 511) // 512 * 512
        self.live.add(key)
        return (key, dst, tuple(t.shape), t.stride(), t.dtype, done)

    def prefetch(self, handle) -> None:
        key, dst, shape, stride, dtype, done = handle
        if key in self._prefetched:
            return
        out = torch.empty_strided(shape, stride, dtype=dtype, device=self.device)
        self.stream.wait_event(done)
        with torch.cuda.stream(self.stream):
            out.copy_(dst.view(dtype).reshape(shape), non_blocking=True)
        self._prefetched[key] = out

    def load(self, handle) -> torch.Tensor:
        key = handle[0]
        self.prefetch(handle)  # no-op if the executor already started it
        out = self._prefetched.pop(key)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(self.stream)
        out.record_stream(compute)
        self.live.discard(key)
        return out


def _without_cache(kwargs: dict) -> dict:
    """``kwargs`` with every KV cache replaced by None, found by type (``transformers.Cache``), not by name: the
    keyword changed across transformers releases (``past_key_value``, ``past_key_values``, ``cache`` in 5.24)."""
    return {k: None if isinstance(v, Cache) else v for k, v in kwargs.items()}


@dataclass
class StepStats:
    saved_bytes: int = 0
    offloaded_bytes: int = 0
    history: list = field(default_factory=list)


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (``weight.t()`` is what a Linear saves): under FSDP2 (and ZeRO-3) the layer runs
    with gathered parameters whose storages are not the model's, so the storage test alone would take them for
    activations, count them against the budget and offload them."""
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


def storage_key(storage: torch.UntypedStorage) -> int:
    """The identity of a storage while it lives (its ``StorageImpl``; a tensor's views share it): unlike the data
    pointer, it tells fake tensors' storages apart (all at address 0), so a step traced on fake tensors is profiled
    alike."""
    return storage._cdata


class DeltaExecutor:
    """Installs a plan on ``layers`` (name, module) of ``model``; ``remove()`` restores the model."""

    def __init__(self, model: nn.Module, layers: list[tuple[str, nn.Module]], tier):
        self.model, self.layers, self.tier = model, list(layers), tier
        self.actions = {name: "keep" for name, _ in layers}
        self.params = self._param_storages()
        self.current: str | None = None
        self.profiling = False
        self._storages: dict[int, int] = {}
        self._group_of: dict[int, str | None] = {}
        self._inputs: dict[str, int] = {}
        self._times: dict[str, float] = {}
        self._offloaded: dict[str, list] = {}  # layer -> its offloaded handles this step (for the prefetch)
        self._prefetch_started: set = set()
        self._first_call: dict[str, int] = {}
        self.stats = StepStats()
        self._orig = {}
        for name, layer in layers:
            self._orig[name] = layer.forward
            layer.forward = self._wrap(name, layer.forward)

    def _param_storages(self) -> dict:
        """Storages of the parameters as they are now (an FSDP2 parameter's local shard), by their key. Read again
        every step: sharding after ``apply_delta`` frees the old storages. The storages are held for the step: a key
        is an address, and ZeRO-3 replaces a partitioned parameter's (empty) storage when it gathers the layer, so a
        freed one's address could be an activation's the same step. The gathered parameters FSDP2 or ZeRO-3 hand a
        layer while it runs are recognised as parameters when saved (``_is_parameter``)."""
        storages = ((p.to_local() if hasattr(p, "to_local") else p).untyped_storage() for p in self.model.parameters())
        return {storage_key(st): st for st in storages}

    def set_plan(self, actions: dict[str, str]) -> None:
        self.actions = dict(actions)

    def _wrap(self, name, forward):
        layer = dict(self.layers)[name]

        def run(*args, **kwargs):
            action = self.actions.get(name, "keep") if torch.is_grad_enabled() else "keep"
            previous, self.current = self.current, name
            if self.profiling:
                self._first_call.setdefault(name, len(self._first_call))
                hidden = args[0] if args else kwargs.get("hidden_states")
                self._inputs[name] = hidden.untyped_storage().nbytes() if torch.is_tensor(hidden) else 0
                if torch.is_tensor(hidden) and hidden.is_cuda:  # time the kernels, not their launches
                    torch.cuda.synchronize(hidden.device)
                start = time.perf_counter()
            try:
                if action == "recompute":
                    # as transformers' own checkpointing: a layer that writes the KV cache must not run twice with it
                    # (the backward replay would append the keys again); the cache plays no part in the loss
                    if kwargs.get("use_cache"):
                        kwargs["use_cache"] = False
                    if not getattr(layer, "_can_checkpoint_with_cache", False):
                        kwargs = _without_cache(kwargs)
                    for a in list(args) + list(kwargs.values()):
                        if torch.is_tensor(a):
                            self._count(a)  # the checkpoint keeps its inputs
                    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
                return forward(*args, **kwargs)
            finally:
                self.current = previous
                if self.profiling:
                    if torch.cuda.is_available() and torch.cuda.is_initialized():
                        torch.cuda.synchronize()
                    self._times[name] = time.perf_counter() - start

        return run

    def _count(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        ptr = storage_key(st)
        if ptr not in self.params and not _is_parameter(t):
            if ptr not in self._storages:
                self._group_of[ptr] = self.current
            elif self._group_of.get(ptr) != self.current:
                # saved by more than one unit (the attention mask every layer reads): no single unit's action frees
                # it, so the planner must count it as always kept
                self._group_of[ptr] = None
            self._storages[ptr] = max(self._storages.get(ptr, 0), st.nbytes())

    def profile(self, shape: tuple, bandwidth: float) -> Profile:
        """The profile of the step just run with ``begin_step(profile=True)`` (everything kept): per layer the bytes
        first saved while it ran, its input bytes and its forward time."""
        # the units in the order they ran (sub-modules are registered in another order than LLaMA runs them);
        # the prefetch follows this order backwards
        self.layers.sort(key=lambda unit: self._first_call.get(unit[0], len(self._first_call)))
        per_group = {name: 0 for name, _ in self.layers}
        for ptr, nbytes in self._storages.items():
            group = self._group_of.get(ptr)
            if group is not None:
                per_group[group] += nbytes
        groups = [
            GroupProfile(name, per_group[name], self._inputs.get(name, 0), self._times.get(name, 0.0))
            for name, _ in self.layers
        ]
        return Profile(groups, sum(self._storages.values()), shape, bandwidth)

    def pack(self, t: torch.Tensor):
        if storage_key(t.untyped_storage()) in self.params or _is_parameter(t):
            return t
        tier_device = getattr(self.tier, "device", None)
        if tier_device is not None and t.device.type != tier_device.type:
            # a tensor saved on the host by a model on the GPU (an index or a mask built on the CPU) uses no device
            # memory: there is nothing to offload, and the pinned tier's streams only apply to device tensors
            return t
        if self.current is not None and self.actions.get(self.current) == "offload":
            self.stats.offloaded_bytes += t.numel() * t.element_size()
            handle = self.tier.store(t)
            self._offloaded.setdefault(self.current, []).append(handle)
            return ("delta-offload", handle, self.current)
        self._count(t)
        return t

    def unpack(self, packed):
        if isinstance(packed, tuple) and len(packed) == 3 and packed[0] == "delta-offload":
            _, handle, group = packed
            prefetch = getattr(self.tier, "prefetch", None)
            if prefetch is not None and group not in self._prefetch_started:
                # backward reached this layer: start bringing back the previous offloaded layer (the next one needed)
                self._prefetch_started.add(group)
                order = [name for name, _ in self.layers if name in self._offloaded]
                earlier = order[: order.index(group)] if group in order else []
                if earlier and earlier[-1] not in self._prefetch_started:
                    for h in self._offloaded[earlier[-1]]:
                        prefetch(h)
            return self.tier.load(handle)
        return packed

    def hooks(self):
        """The context to run a training forward in (the model-level saved-tensor hooks)."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def begin_step(self, profile: bool = False) -> None:
        self.profiling = profile
        self.params = self._param_storages()
        if not getattr(self.tier, "live", None):
            self._offloaded, self._prefetch_started = {}, set()
        self._storages, self._group_of, self._inputs, self._times, self._first_call = {}, {}, {}, {}, {}
        self.stats.saved_bytes = self.stats.offloaded_bytes = 0
        if not getattr(self.tier, "live", None):  # nothing offloaded is still waiting for its backward
            self.tier.reset()

    def end_step(self) -> None:
        self.stats.saved_bytes = sum(self._storages.values())
        self.stats.history.append(
            {
                "saved_bytes": self.stats.saved_bytes,
                "offloaded_bytes": self.stats.offloaded_bytes,
                "profiling": self.profiling,
            }
        )

    def remove(self) -> None:
        for name, layer in self.layers:
            layer.forward = self._orig[name]


def profile_step(model: nn.Module, batch: dict, tier, layers: list | None = None) -> Profile:
    """Run one forward + backward of ``model`` on ``batch`` keeping everything, and measure: the executor's own
    profiling step (one accounting for both), outside a scheduler. Gradients are left as they were (the step is for
    measuring only)."""
    executor = DeltaExecutor(model, layers or decoder_layers(model), tier)
    grads = {p: p.grad for p in model.parameters()}
    try:
        executor.begin_step(profile=True)
        with executor.hooks():
            loss = model(**batch).loss
        executor.end_step()
        loss.backward()
    finally:
        executor.remove()
        for p, g in grads.items():
            p.grad = g
    ids = batch.get("input_ids")
    return executor.profile(tuple(ids.shape) if torch.is_tensor(ids) else (), measure_tier_bandwidth(tier))
