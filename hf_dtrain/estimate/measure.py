"""The job's own step, measured: what ``--estimate.measure`` holds the estimate against.

The measurement shares no code with the estimator (which counts fake tensors' storages through torch's
``MemTracker``). It runs inside the job as it trains, through the Trainer (a callback) or a plain loop (the run's
``after_prepare`` / ``after_step``), over the job's last two optimizer steps:

* on a GPU, the CUDA caching allocator's own statistic: ``torch.cuda.max_memory_allocated()`` after
  ``reset_peak_memory_stats()`` at the first step's start;
* on CPU (whose allocator keeps no statistics), the profiler's memory events (``profile_memory=True``: every
  allocation and free the CPU allocator reports) summed in time order, on top of the storages the model and the
  optimizer hold when the profiler starts (:func:`held_storage_bytes`). A block allocated before the profiler started
  and freed during it is not reported by the profiler (it says so once), so the figure can only be high by such
  blocks, never low.
"""

from __future__ import annotations

import torch
from torch import nn


def held_storage_bytes(model: nn.Module, optimizer=None, device_type: str = "cpu") -> int:
    """The bytes of the distinct tensor storages on ``device_type`` that ``model`` and ``optimizer`` hold: every
    module's parameters, buffers and the tensors in its attributes (a 4-bit layer's scales and zero-points, in dicts
    or in its weight's quantization state), and the optimizer's state. A data set or a cache held elsewhere by the
    job is not the step's (on a GPU it stays in host memory)."""
    sizes: dict[int, int] = {}
    seen: set[int] = set()

    def add(obj, depth: int = 0) -> None:
        if id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            local = obj.to_local() if hasattr(obj, "to_local") else obj  # a DTensor: this rank's shard
            try:
                if local.device.type == device_type:
                    storage = local.untyped_storage()
                    if storage.data_ptr() and storage.nbytes():
                        sizes[storage.data_ptr()] = max(storage.nbytes(), sizes.get(storage.data_ptr(), 0))
            except (RuntimeError, NotImplementedError):
                pass
            for value in getattr(obj, "__dict__", {}).values():  # a 4-bit weight's quantization state
                add(value, depth + 1)
        elif isinstance(obj, dict):
            for value in obj.values():
                add(value, depth + 1)
        elif isinstance(obj, (list, tuple, set)):
            for value in obj:
                add(value, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, type)):
            for value in vars(obj).values():
                add(value, depth + 1)

    for module in model.modules():
        for value in module.__dict__.values():
            if not isinstance(value, nn.Module):
                add(value)
    if optimizer is not None:
        add(getattr(optimizer, "optimizer", optimizer).state)  # Accelerate's wrapper: the optimizer inside
    return sum(sizes.values())


class StepPeak:
    """Measures the peak of the tensors alive over a window of training steps (see the module's docstring):
    ``start()`` before the first, ``stop()`` after the last returns the peak in bytes (also ``peak``)."""

    def __init__(self, device: torch.device | str | None = None):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.peak: int | None = None
        self.how = ""
        self._profiler = None
        self._base = 0
        self.running = False

    def start(self, model: nn.Module, optimizer=None) -> None:
        self.running = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        from torch.profiler import ProfilerActivity, profile

        self._base = held_storage_bytes(model, optimizer, self.device.type)
        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profiler.__enter__()

    def stop(self) -> int:
        if not self.running:
            raise RuntimeError("StepPeak.stop() before start()")
        self.running = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = int(torch.cuda.max_memory_allocated(self.device))
            self.how = "torch.cuda.max_memory_allocated"
            return self.peak
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        events = sorted(
            (e.start_ns(), e.nbytes())
            for e in profiler.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
        )
        live = highest = 0
        for _, nbytes in events:
            live += nbytes
            highest = max(highest, live)
        self.peak = self._base + highest
        self.how = "profiler memory events over the storages the model and optimizer hold"
        return self.peak
