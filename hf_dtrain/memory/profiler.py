"""DELTA's profiler pass: one measured training step recording, per planning unit (a decoder layer, or with
``granularity="submodule"`` each of its sub-modules: attention, MLP, norms), the bytes autograd saves for backward
(unique storages, parameters excluded), the bytes of the unit's input (what a recomputed unit keeps), and the forward
time; plus the measured bandwidth of the offload tier."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from hf_dtrain.errors import SettingsError

from .config import GRANULARITIES


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of a transformers model (``...layers.N``: the ModuleList the decoder iterates)."""
    best: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module) > len(best)
            and name.split(".")[-1] in ("layers", "h", "blocks")
        ):
            best = [(f"{name}.{i}", m) for i, m in enumerate(module)]
    if not best:
        raise SettingsError(
            f"No decoder layers found in {type(model).__name__} (a ModuleList named layers / h / blocks); "
            "DELTA plans per decoder layer."
        )
    return best


def plan_units(model: nn.Module, granularity: str = "layer") -> list[tuple[str, nn.Module]]:
    """The modules the planner decides on: the decoder layers, or (``"submodule"``) each layer's direct children that
    hold parameters (for LLaMA: ``self_attn``, ``mlp``, ``input_layernorm``, ``post_attention_layernorm``), in
    registration order (the scheduler reorders them by execution order after its profiling step)."""
    if granularity not in GRANULARITIES:
        raise SettingsError(f"DELTA granularity must be one of {GRANULARITIES}, got {granularity!r}.")
    layers = decoder_layers(model)
    if granularity == "layer":
        return layers
    units = []
    for name, layer in layers:
        children = [
            (f"{name}.{child}", m) for child, m in layer.named_children() if next(m.parameters(), None) is not None
        ]
        if not children:
            raise SettingsError(
                f"Decoder layer {name} ({type(layer).__name__}) has no sub-modules with parameters; use "
                "granularity='layer'."
            )
        units.extend(children)
    return units


@dataclass
class GroupProfile:
    name: str
    saved_bytes: int  # saved for backward while the layer runs (unique storages, parameters excluded)
    input_bytes: int  # the layer's input hidden states: what a recomputed (checkpointed) layer keeps
    forward_seconds: float


@dataclass
class Profile:
    groups: list[GroupProfile]
    total_saved_bytes: int  # the whole model's step, groups included
    shape: tuple
    tier_bandwidth: float  # bytes/s, one direction
    groups_saved_bytes: int = field(init=False)

    def __post_init__(self):
        self.groups_saved_bytes = sum(g.saved_bytes for g in self.groups)

    @property
    def other_bytes(self) -> int:
        """Saved outside the decoder layers (embeddings, final norm, the loss on the logits): always kept."""
        return max(0, self.total_saved_bytes - self.groups_saved_bytes)


def measure_tier_bandwidth(tier, nbytes: int = 8 << 20) -> float:
    """Bytes/s of a write plus read through ``tier`` (the mean of the two directions), on a scratch buffer."""
    device = torch.device(getattr(tier, "device", "cpu"))  # the pinned tier stores device tensors
    x = torch.randn(nbytes // 4, device=device)
    best = float("inf")
    for _ in range(2):  # the first pass also grows the tier (file blocks, pinned pages): steady state is the second
        tier.reset()
        t0 = time.perf_counter()
        handle = tier.store(x)
        y = tier.load(handle)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the copies run on streams: time them, not their launches
        best = min(best, time.perf_counter() - t0)
        tier.reset()
        assert torch.equal(x, y)
    return 2 * nbytes / max(best, 1e-9)
