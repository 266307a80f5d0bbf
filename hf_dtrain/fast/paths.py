"""Which path a tuner layer takes, and why: the checks every lean layer shares, the per-layer record, the report,
and :func:`apply` for a user's own peft LoRA model.

A layer records its last forward's path in ``layer.hf_dtrain_path``: ``"lean"`` (base and adapter in one function),
``"lean adapter"`` (the adapter's product added in one function to the output of a base that runs itself: a 4-bit
base), or the reason it took the plain path. :func:`report` counts them over a model, so a benchmark or ``gpu_check``
says how many layers took the lean path and why the others did not."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from . import enabled
from .lowrank import lowrank_linear, pooled_delta

LEAN, LEAN_ADAPTER = "lean", "lean adapter"
COMPILED_PLAIN = "compiled: inductor fuses the plain path"
ATTRIBUTE = "hf_dtrain_path"  # the path of the layer's last forward
TRAINING = "hf_dtrain_training_path"  # of its last training forward (in training mode, with gradients on)


def _hooked(module: nn.Module) -> bool:
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or nn.modules.module._global_forward_hooks
        or nn.modules.module._global_forward_pre_hooks
    )


def _plain_tensor(t) -> bool:
    return t is None or type(t.data) is torch.Tensor


def adapter_reason(layer, args, kwargs, adapters) -> str | None:
    """Why the tuner ``layer`` must run its plain path whatever its base (None: it may take a lean one): the switch,
    extra call arguments, disabled or merged adapters, several active adapters, adapter tensors that are not plain
    (DTensor, a ZeRO-3 partition), or ``torch.compile`` tracing a layer kind whose plain path inductor runs faster
    (``lean_when_compiled = False`` on the layer's class: SMT, Q-BaRA, QA-HiRA, measured per layer in docs/fast.md)."""
    if not enabled():
        return "switched off"
    if not getattr(layer, "lean_when_compiled", True) and torch.compiler.is_compiling():
        return COMPILED_PLAIN
    if args or kwargs:
        return "extra call arguments"
    if layer.disable_adapters:
        return "adapters disabled"
    if layer.merged:
        return "merged"
    if len(layer.active_adapters) != 1:
        return "several active adapters"
    if not all(_plain_tensor(t) and not hasattr(t, "ds_id") for t in adapters):
        return "sharded adapter (DTensor or ZeRO-3)"
    return None


def dense_base_reason(base: nn.Module) -> str | None:
    """Why ``base`` cannot run inside a lean function (None: a plain frozen ``nn.Linear`` of plain tensors): a
    quantized or other layer type, a hooked layer (ZeRO-3's parameter gathering, a user's hook), a trained weight, or
    a tensor subclass (DTensor under tensor parallelism, a ZeRO-3 partition)."""
    if type(base) is not nn.Linear:
        return f"base is {type(base).__name__}"
    if _hooked(base):
        return "hooks on the base layer"
    weight, bias = base.weight, base.bias
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        return "base weights train"
    if not (_plain_tensor(weight) and _plain_tensor(bias)) or hasattr(weight, "ds_id"):
        return "sharded base (DTensor or ZeRO-3)"
    return None


def _no_dropout(dropout) -> bool:
    return (
        dropout is None
        or isinstance(dropout, nn.Identity)
        or (isinstance(dropout, nn.Dropout) and (dropout.p == 0 or not dropout.training))
    )


def record(layer: nn.Module, path: str) -> None:
    """Note the path ``layer`` took in this forward (for :func:`report`), and apart the path of a training forward:
    an evaluation after training (dropout off) must not make a plain training step read as lean."""
    layer.__dict__[ATTRIBUTE] = path
    if layer.training and torch.is_grad_enabled():
        layer.__dict__[TRAINING] = path


def lowrank_forward(layer, x, args, kwargs, a, b, scale, dropout=None, repeat: int = 1):
    """The lean forward of a low-rank tuner layer (``y = base(x) + scale * (x a^T) b^T``), or None where the plain one
    must run (the reason recorded). ``dropout``: the adapter's dropout module (lean only when it is the identity or a
    zero-rate dropout); ``repeat``: see :func:`~hf_dtrain.fast.lowrank.lowrank_linear`."""
    reason = adapter_reason(layer, args, kwargs, (a, b))
    if reason is None and not _no_dropout(dropout):
        reason = "dropout"
    base = layer.get_base_layer()
    if reason is None and type(base) is nn.Linear:
        reason = dense_base_reason(base)  # a dense base that cannot come inside keeps its own call whole
        if reason is None:
            record(layer, LEAN)
            return lowrank_linear(x, a, b, scale, weight=base.weight, bias=base.bias, repeat=repeat)
    if reason is not None:
        record(layer, reason)
        return None
    record(layer, LEAN_ADAPTER)  # a base of its own kind (4-bit): it runs itself, the adapter is added in one op
    return lowrank_linear(x, a, b, scale, y=layer.base_layer(x), repeat=repeat)


def pooled_forward(layer, x, args, kwargs, a, b, g: int, lam: int, scale: float):
    """QA-HiRA's lean forward (the base runs itself; its update added in one add), or None where the plain one must
    run (the reason recorded)."""
    reason = adapter_reason(layer, args, kwargs, (a,) if b is None else (a, b))
    if reason is not None:
        record(layer, reason)
        return None
    record(layer, LEAN_ADAPTER)
    return pooled_delta(layer.base_layer(x), x, a, b, g, lam, scale)


def report(model: nn.Module, training: bool = False) -> dict:
    """``{"layers": n, "lean": n, "lean adapter": n, "plain": {reason: n}}`` over the tuner layers of ``model``
    that ran a forward since they were built: each layer's last forward, or with ``training=True`` its last training
    forward (the layers that never trained are left out)."""
    key = TRAINING if training else ATTRIBUTE
    paths = Counter(m.__dict__[key] for m in model.modules() if key in m.__dict__)
    return {
        "layers": sum(paths.values()),
        LEAN: paths.pop(LEAN, 0),
        LEAN_ADAPTER: paths.pop(LEAN_ADAPTER, 0),
        "plain": dict(sorted(paths.items())),
    }


def _lora_lean_forward(self, x, *args, **kwargs):
    """peft ``lora.Linear.forward`` through the lean function where it applies (installed by :func:`apply`)."""
    names = self.active_adapters
    name = names[0] if len(names) == 1 else None
    out = None
    if name is not None and name in self.lora_variant:
        record(self, "a LoRA variant (DoRA...)")
    elif name is not None and self.lora_bias.get(name, False):
        record(self, "LoRA bias")
    elif name is not None and name not in self.lora_A:
        record(self, "no such adapter")
    elif name is not None:
        a, b = self.lora_A[name].weight, self.lora_B[name].weight
        out = lowrank_forward(self, x, args, kwargs, a, b, self.scaling[name], dropout=self.lora_dropout[name])
    else:
        record(self, "several active adapters")
    return type(self).forward(self, x, *args, **kwargs) if out is None else out


def apply(model: nn.Module) -> dict:
    """Run a peft LoRA model's ``lora.Linear`` layers (no DoRA, dropout 0, no LoRA bias, one active adapter)
    through the lean function; the adapter is still peft's (saved and loaded by peft unchanged). Layers that do not
    qualify at a forward take peft's own path, counted. Returns the count of layers it installed on; see
    :func:`report` after a forward for the paths taken. ``hf_dtrain.fast.set_enabled(False)`` undoes it for every
    layer at once."""
    from peft.tuners.lora import Linear as LoraLinear

    installed = 0
    for module in model.modules():
        if type(module) is LoraLinear and "forward" not in module.__dict__:
            module.forward = _lora_lean_forward.__get__(module)
            installed += 1
    return {"installed": installed}
