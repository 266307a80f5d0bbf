"""Lean training steps for adapters: one switch, the lean layers' shared pieces, and where a step's time goes.

* the switch: on by default where the lean path is exact; ``hf_dtrain.fast.set_enabled(False)``, ``with
  hf_dtrain.fast.disabled():``, ``HF_DTRAIN_FAST=0`` in the environment, or ``--fast false`` on the jobs turn it off;
* :mod:`~hf_dtrain.fast.lowrank`: ``y = x W^T + b + s (x A^T) B^T`` as one autograd function (LoRA-FA, Q-BaRA,
  peft's LoRA through :func:`apply`);
* :mod:`~hf_dtrain.fast.blocks`: a decoder's SwiGLU MLP with low-rank adapters on its three projections as one
  autograd function (the SwiGLU product computed again in backward rather than kept), and an attention's q, k and v
  projections as one function of their shared input (their ``A`` factors stacked: one product for three);
* :mod:`~hf_dtrain.fast.paths`: why a layer took the lean path or not, counted per layer (:func:`report`);
* :mod:`~hf_dtrain.fast.profile`: one step's ops, times and saved-for-backward bytes by op family;
* :func:`cpu_bf16`: whether this CPU computes bf16 natively (else the CPU paths that chose bf16 for speed take fp32).
"""

import contextlib
import os

import lazy_loader as lazy

_ENABLED = os.environ.get("HF_DTRAIN_FAST", "1").strip().lower() not in ("0", "false", "no", "off")


# set on a hook that only watches (the step profile's scopes), or on the object whose bound methods are such hooks (a
# memory trace's module tracker): a lean path that skips its layers' own calls stays lean under it
OBSERVER = "hf_dtrain_observer"


def observer(watcher):
    """Mark ``watcher`` (a hook, or the object whose bound methods are the hooks) as only watching the modules'
    calls: the lean paths, which skip the calls of the layers they fuse, stay lean under it."""
    setattr(watcher, OBSERVER, True)
    return watcher


def enabled() -> bool:
    """Whether layers that have a lean path take it (where it is exact)."""
    return _ENABLED


def set_enabled(on: bool) -> None:
    """Turn the lean paths on or off for the whole process."""
    global _ENABLED
    _ENABLED = bool(on)


@contextlib.contextmanager
def disabled():
    """The plain paths inside the block (the reference the lean ones are tested against)."""
    was = _ENABLED
    set_enabled(False)
    try:
        yield
    finally:
        set_enabled(was)


from hf_dtrain.precision import CPU_BF16_ENV, cpu_bf16  # noqa: E402  (their home; re-exported here)

__getattr__, __dir__, _lazy_all = lazy.attach(
    __name__,
    submod_attrs={
        "lowrank": ["LowRankLinear", "lowrank_linear", "compute_dtype", "FrozenLinear", "frozen_linear"],
        "blocks": ["SwiGLULowRank", "swiglu_lowrank", "SharedInputLowRank", "shared_input_lowrank"],
        "paths": ["apply", "report", "dense_base_reason", "adapter_reason", "record"],
        "profile": ["StepProfile", "FAMILIES"],
    },
)
__all__ = ["enabled", "set_enabled", "disabled", "cpu_bf16", "CPU_BF16_ENV", *_lazy_all]
