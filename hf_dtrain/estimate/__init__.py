"""Will it fit? One training step traced through the real modules on fake tensors: per-rank peak memory split into
parameters, gradients, optimizer state, activations and temporaries, and the step's FLOPs, with no weight read or
allocated.

* :mod:`~hf_dtrain.estimate.trace`: :func:`trace_step` under torch's ``MemTracker`` (on fake tensors: the estimate;
  on real ones: the measurement it is checked against), :func:`fake_tensors` (a model built on the meta device
  made fake by ``to_empty``), :func:`fake_world` for one rank of many (FSDP2 over torch's fake process group).
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    submod_attrs={
        "config": ["EstimateConfig"],
        "trace": ["StepMemory", "StepTracker", "trace_step", "fake_tensors", "fake_world", "make_fake", "CATEGORIES"],
    },
)
