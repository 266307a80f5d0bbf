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
from torch._subclasses.fake_tensor import FakeTensor

from hf_dtrain.models import is_tuner_layer

from . import OBSERVER, enabled
from .blocks import shared_input_lowrank, swiglu_lowrank
from .lowrank import compute_dtype, lowrank_linear, pooled_delta

LEAN, LEAN_ADAPTER = "lean", "lean adapter"
COMPILED_PLAIN = "compiled: inductor fuses the plain path"
ATTRIBUTE = "hf_dtrain_path"  # the path of the layer's last forward
TRAINING = "hf_dtrain_training_path"  # of its last training forward (in training mode, with gradients on)
LEAN_BLOCK = "lean block"
BLOCK = "hf_dtrain_block_path"  # a block's (a decoder MLP's) path in its last forward
BLOCK_TRAINING = "hf_dtrain_block_training_path"


def _hooked(module: nn.Module) -> bool:
    """Whether a forward hook (a user's, ZeRO-3's parameter gathering) would see this module's call: the lean paths
    that skip the call then fall back. Hooks marked as observers (:func:`hf_dtrain.fast.observer`), or bound to an
    object so marked, do not count."""
    hooks = (
        *module._forward_hooks.values(),
        *module._forward_pre_hooks.values(),
        *nn.modules.module._global_forward_hooks.values(),
        *nn.modules.module._global_forward_pre_hooks.values(),
    )
    return any(
        not (getattr(h, OBSERVER, False) or getattr(getattr(h, "__self__", None), OBSERVER, False)) for h in hooks
    )


def _plain_tensor(t) -> bool:
    """Not a tensor subclass (a DTensor, a ZeRO-3 partition), or a fake tensor (a memory trace) standing for a plain
    one: the trace takes the path the run would."""
    return t is None or type(t.data) in _PLAIN


_PLAIN = (torch.Tensor, FakeTensor)  # checked per layer per forward: the type tuple built once


def adapter_reason(layer, args, kwargs, adapters) -> str | None:
    """Why the tuner ``layer`` must run its plain path whatever its base (None: it may take a lean one): the switch,
    extra call arguments, disabled or merged adapters, several active adapters, adapter tensors that are not plain
    (DTensor, a ZeRO-3 partition), or ``torch.compile`` tracing a layer whose plain path inductor runs faster
    (:func:`lean_when_compiled`)."""
    if not enabled():
        return "switched off"
    if torch.compiler.is_compiling() and not lean_when_compiled(layer):
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


def lean_when_compiled(layer) -> bool:
    """Whether ``layer`` keeps its lean path under ``torch.compile``: ``layer.lean_when_compiled`` where set on the
    layer; else not for a layer kind whose plain path inductor fused into a faster layer on a dense base
    (``compiled_plain_on_dense_base`` on its class: SMT, Q-BaRA, QA-HiRA) when its base is a dense ``nn.Linear``. On
    a 4-bit base their lean path stays: there inductor's plain path measured slower (docs/fast.md)."""
    if "lean_when_compiled" in layer.__dict__:
        return bool(layer.__dict__["lean_when_compiled"])
    dense = type(layer.get_base_layer()) is nn.Linear
    return not (getattr(layer, "compiled_plain_on_dense_base", False) and dense)


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


def record(layer: nn.Module, path: str, attribute: str = ATTRIBUTE, training: str = TRAINING) -> None:
    """Note the path ``layer`` took in this forward (for :func:`report`), and apart the path of a training forward:
    an evaluation after training (dropout off) must not make a plain training step read as lean."""
    layer.__dict__[attribute] = path
    if layer.training and torch.is_grad_enabled():
        layer.__dict__[training] = path


def lowrank_forward(layer, x, args, kwargs, a, b, scale, dropout=None, repeat: int = 1):
    """The lean forward of a low-rank tuner layer (``y = base(x) + scale * (x a^T) b^T``), or None where the plain one
    must run (the reason recorded). ``dropout``: the adapter's dropout module (lean only when it is the identity or a
    zero-rate dropout); ``repeat``: see :func:`~hf_dtrain.fast.lowrank.lowrank_linear`."""
    given = _given(layer, x, args, kwargs)  # its attention block's output
    if given is not None:
        record(layer, LEAN)
        return given
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
    """``{"layers": n, "lean": n, "lean adapter": n, "plain": {reason: n}, "blocks": {"lean block": n, reason: n}}``
    over the tuner layers of ``model`` that ran a forward since they were built (and the decoder MLPs :func:`apply`
    installed the block path on): each one's last forward, or with ``training=True`` its last training forward (those
    that never trained are left out). A layer run inside a lean block counts as lean."""
    key = TRAINING if training else ATTRIBUTE
    paths = Counter(m.__dict__[key] for m in model.modules() if key in m.__dict__)
    block_key = BLOCK_TRAINING if training else BLOCK
    blocks = Counter(m.__dict__[block_key] for m in model.modules() if block_key in m.__dict__)
    return {
        "layers": sum(paths.values()),
        LEAN: paths.pop(LEAN, 0),
        LEAN_ADAPTER: paths.pop(LEAN_ADAPTER, 0),
        "plain": dict(sorted(paths.items())),
        "blocks": dict(sorted(blocks.items())),
    }


def _lora_factors(layer, name):
    """``((a, b, scale, dropout), None)`` for peft LoRA adapter ``name`` of ``layer``, or ``(None, reason)``."""
    if name in layer.lora_variant:
        return None, "a LoRA variant (DoRA...)"
    if layer.lora_bias.get(name, False):
        return None, "LoRA bias"
    if name not in layer.lora_A:
        return None, "no such adapter"
    return (layer.lora_A[name].weight, layer.lora_B[name].weight, layer.scaling[name], layer.lora_dropout[name]), None


def _lora_lean_forward(self, x, *args, **kwargs):
    """peft ``lora.Linear.forward`` through the lean function where it applies (installed by :func:`apply`)."""
    names = self.active_adapters
    out = None
    if len(names) != 1:
        record(self, "several active adapters")
    else:
        factors, reason = _lora_factors(self, names[0])
        if factors is None:
            record(self, reason)
        else:
            a, b, scale, dropout = factors
            out = lowrank_forward(self, x, args, kwargs, a, b, scale, dropout=dropout)
    return type(self).forward(self, x, *args, **kwargs) if out is None else out


def _projection(layer):
    """``((weight, a, b, scale), None)`` when tuner ``layer`` can run inside a lean block: one active adapter that is
    a plain low-rank product (peft LoRA, LoRA-FA) on a frozen dense ``nn.Linear`` without bias, no dropout, no hooks;
    else ``(None, reason)``."""
    from peft.tuners.lora import Linear as LoraLinear

    names = getattr(layer, "active_adapters", None)
    if names is None:
        return None, "not an adapter layer"
    if len(names) != 1:
        return None, "several active adapters"
    if isinstance(layer, LoraLinear):
        factors, reason = _lora_factors(layer, names[0])
    else:
        lean = getattr(layer, "_lean_factors", None)
        factors = lean(names[0]) if lean is not None and layer._has_adapter(names[0]) else None
        reason = "no low-rank factors"
        if factors is not None and len(factors) > 4:
            factors, reason = (factors[:4], None) if factors[4] == 1 else (None, "repeated factors")
    if factors is None:
        return None, reason
    a, b, scale, dropout = factors
    base = layer.get_base_layer()
    reason = (
        adapter_reason(layer, (), {}, (a, b))
        or (None if _no_dropout(dropout) else "dropout")
        or ("hooks on the adapter layer" if _hooked(layer) else None)
        or dense_base_reason(base)
        or ("base bias" if base.bias is not None else None)
    )
    return (None, reason) if reason else ((base.weight, a, b, scale), None)


def _silu(act) -> bool:
    from transformers.activations import SiLUActivation

    return type(act) in (nn.SiLU, SiLUActivation) and "forward" not in act.__dict__ and not _hooked(act)


def _block_projections(block: nn.Module, names) -> tuple[list, str | None]:
    """``(projections, None)`` when the tuner layers ``names`` of ``block`` can all run inside a lean block
    (:func:`_projection`), else ``([], "name: reason")`` of the first that cannot."""
    projections = []
    for name in names:
        projection, why = _projection(getattr(block, name))
        if why is not None:
            return [], f"{name}: {why}"
        projections.append(projection)
    return projections, None


MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def _mlp_lean_forward(self, x, *args, **kwargs):
    """A decoder MLP's ``down(silu(gate(x)) * up(x))`` as one lean block where its three projections qualify
    (:func:`_projection`; installed by :func:`apply`), else its own forward (the layers' own lean paths still apply),
    the reason recorded."""
    reason = "extra call arguments" if args or kwargs else None
    if reason is None and not _silu(self.act_fn):
        reason = f"activation is {type(self.act_fn).__name__}"
    projections = []
    if reason is None:
        projections, reason = _block_projections(self, MLP_PROJECTIONS)
    if reason is not None:
        record(self, reason, BLOCK, BLOCK_TRAINING)
        return type(self).forward(self, x, *args, **kwargs)
    record(self, LEAN_BLOCK, BLOCK, BLOCK_TRAINING)
    for name in MLP_PROJECTIONS:
        record(getattr(self, name), LEAN)
    return swiglu_lowrank(x, *projections, compute_dtype(x))


class _Shared:
    """The outputs of an attention's q, k and v projections for one call of the attention: the first projection
    called with the attention's input computes the three (:class:`~hf_dtrain.fast.blocks.SharedInputLowRank`, inside
    that layer's own call: its hooks and profile scope see it), each takes its own once."""

    def __init__(self, x: torch.Tensor, projections: list):
        self.x, self.projections, self.outs = x, projections, None

    def take(self, i: int, x: torch.Tensor):
        """Projection ``i``'s output for input ``x``, or None (another input, or taken already)."""
        if x is not self.x:
            return None
        if self.outs is None:
            self.outs = list(shared_input_lowrank(x, self.projections, compute_dtype(x)))
        out, self.outs[i] = self.outs[i], None
        return out


GIVEN = "hf_dtrain_given"  # ``(shared, i)`` on a projection while its attention block runs (see _Shared)


def _given(layer, x, args, kwargs):
    """The output an attention block computed for ``layer`` and input ``x`` (None: the layer computes its own)."""
    given = layer.__dict__.get(GIVEN)
    if given is None or args or kwargs:
        return None
    shared, i = given
    return shared.take(i, x)


def _attention_lean_forward(self, hidden_states, *args, **kwargs):
    """A decoder attention whose q, k and v projections qualify (:func:`_projection`; installed by :func:`apply`):
    the attention's own forward, its three projections computed from one read of their input (:class:`_Shared`,
    handed to each projection's lean forward through :data:`GIVEN`). Else its own forward (the layers' own lean paths
    still apply), the reason recorded."""
    projections, reason = _block_projections(self, ATTENTION_PROJECTIONS)
    if reason is not None:
        record(self, reason, BLOCK, BLOCK_TRAINING)
        return type(self).forward(self, hidden_states, *args, **kwargs)
    record(self, LEAN_BLOCK, BLOCK, BLOCK_TRAINING)
    shared = _Shared(hidden_states, projections)
    layers = [getattr(self, name) for name in ATTENTION_PROJECTIONS]
    for i, layer in enumerate(layers):
        layer.__dict__[GIVEN] = (shared, i)
    try:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    finally:
        for layer in layers:
            layer.__dict__[GIVEN] = None


def _has_tuner(module: nn.Module, names) -> bool:
    return any(is_tuner_layer(getattr(module, n, None)) for n in names)


def _is_mlp(module: nn.Module) -> bool:
    return hasattr(module, "act_fn") and _has_tuner(module, MLP_PROJECTIONS)


def _is_attention(module: nn.Module) -> bool:
    return all(hasattr(module, n) for n in ATTENTION_PROJECTIONS) and _has_tuner(module, ATTENTION_PROJECTIONS)


def apply(model: nn.Module) -> dict:
    """Run a peft LoRA model's ``lora.Linear`` layers (no DoRA, dropout 0, no LoRA bias, one active adapter)
    through the lean function, and the decoder blocks whose projections carry such adapters (peft LoRA or LoRA-FA)
    through the lean blocks (:mod:`~hf_dtrain.fast.blocks`): every MLP (``gate_proj``, ``up_proj``, ``down_proj``, a
    SiLU) as one function, every attention's ``q_proj``, ``k_proj`` and ``v_proj`` as one function of their shared
    input. The adapters are still peft's (saved and loaded by peft unchanged). Layers and blocks that do not qualify
    at a forward take their own path, counted. Returns the counts installed (``installed`` layers, ``blocks``: MLPs
    and attentions); see :func:`report` after a forward for the paths taken. ``hf_dtrain.fast.set_enabled(False)``
    undoes it for every layer at once."""
    from peft.tuners.lora import Linear as LoraLinear

    installed = blocks = 0
    for module in model.modules():
        if "forward" in module.__dict__:
            continue
        if type(module) is LoraLinear:
            module.forward = _lora_lean_forward.__get__(module)
            installed += 1
        elif _is_mlp(module):
            module.forward = _mlp_lean_forward.__get__(module)
            blocks += 1
        elif _is_attention(module):
            module.forward = _attention_lean_forward.__get__(module)
            blocks += 1
    return {"installed": installed, "blocks": blocks}
