"""4-bit base models for Q-BaRA, QA-HiRA and QLoRA-style training: loading, recognising and preparing them.

Three 4-bit formats are supported as base layers:

* ``"nf4"``: bitsandbytes ``Linear4bit`` (NF4, symmetric absmax per block of 64, **no zero-point**), loaded through
  transformers' ``BitsAndBytesConfig(load_in_4bit=True)``: the QLoRA habit. Adapters train on it; a merge into it has
  to re-quantize and rounds.
* ``"hqq4"``: HQQ's ``HQQLinear`` (the maintained ``hqq`` library, 4 bits, ``axis=1``: groups along ``in_features``,
  ``W = s (q - z)`` with floating-point zero-points ``z``). A group-constant update (QA-HiRA, QA-LoRA) folds exactly
  into ``z``; peft's LoRA supports it too (merge by re-quantizing).
* ``"int4"``: hf_dtrain's dependency-free ``Int4Linear`` (round-to-nearest, same ``s (q - z)`` layout, plain buffers
  saved with safetensors); see :mod:`hf_dtrain.quantization.int4`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from hf_dtrain.errors import SettingsError
from hf_dtrain.quantization.int4 import Int4Linear

QUANTIZE_CHOICES = ("nf4", "hqq4", "int4")


def _bnb_linear4bit():
    try:
        import bitsandbytes as bnb
    except ImportError:
        return None
    _count_bnb_gemm_flops()
    return bnb.nn.Linear4bit


_FLOPS_REGISTERED = []


def _count_bnb_gemm_flops() -> None:
    """Teach torch's FLOP counter bitsandbytes' 4-bit GEMM (a custom op it does not know, so a QLoRA step's forward
    products were left out of the step's FLOPs): ``2 * tokens * in * out``, as ``aten.mm``."""
    if _FLOPS_REGISTERED:
        return
    _FLOPS_REGISTERED.append(True)
    op = getattr(getattr(torch.ops, "bitsandbytes", None), "gemm_4bit", None)
    if op is None:
        return
    import math

    from torch.utils.flop_counter import register_flop_formula

    @register_flop_formula(op)
    def _gemm_4bit_flops(a_shape, *args, out_shape=None, **kwargs) -> int:
        return 2 * math.prod(out_shape) * a_shape[-1]


def _hqq_linear():
    try:
        from hqq.core.quantize import HQQLinear
    except ImportError:
        return None
    return HQQLinear


def quantized_base_types() -> tuple[type, ...]:
    """Quantized linear classes an adapter may wrap besides ``nn.Linear`` (bitsandbytes' ``Linear4bit`` already is
    an ``nn.Linear`` subclass): ``Int4Linear`` and, when ``hqq`` is installed, ``HQQLinear``."""
    hqq = _hqq_linear()
    return (Int4Linear,) if hqq is None else (Int4Linear, hqq)


def quantized_kind(module: nn.Module) -> str | None:
    """``"nf4"`` (any bitsandbytes 4-bit layer), ``"hqq4"``, ``"int4"`` or None for a dense layer."""
    if isinstance(module, Int4Linear):
        return "int4"
    hqq = _hqq_linear()
    if hqq is not None and isinstance(module, hqq):
        return "hqq4"
    bnb4 = _bnb_linear4bit()
    if bnb4 is not None and isinstance(module, bnb4):
        return "nf4"
    return None


def adapter_dtype_and_device(base: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The floating dtype and the device an adapter's parameters should have next to ``base``: the weight's dtype
    for a dense layer, the compute dtype (float32 when unset) for a quantized one."""
    kind = quantized_kind(base)
    if kind is None:
        w = base.weight
        return (w.dtype if w.dtype.is_floating_point else torch.float32), w.device
    if kind == "int4":
        return torch.float32, base.qweight.device
    if kind == "hqq4":
        return base.compute_dtype, base.W_q.device
    dtype = base.compute_dtype if base.compute_dtype is not None else torch.float32
    return dtype, base.weight.device


def check_quantized_base(base: nn.Module, config_name: str, layer_key: str) -> None:
    """The ``ValueError`` for ``require_quantized_base=True`` on a dense target."""
    if quantized_kind(base) is None:
        raise SettingsError(
            f"{config_name}.require_quantized_base=True but {layer_key!r} is a dense {type(base).__name__}. Load the "
            "base in 4 bits first (hf_dtrain.quantization.load_quantized_model(path, 'nf4' | 'hqq4' | 'int4'), "
            "transformers' BitsAndBytesConfig(load_in_4bit=True), or quantize_model_int4(model, group_size)), or set "
            "require_quantized_base=False to adapt dense layers."
        )


def prepare_bnb_4bit_for_training(module: nn.Module) -> int:
    """Keep bitsandbytes 4-bit layers differentiable on CPU; returns how many layers were seen.

    bitsandbytes (checked 0.50.2) repacks a ``Linear4bit`` weight for AVX512-BF16 inference the first time the layer
    runs in eval mode under ``no_grad`` on a CPU that has the instruction set; afterwards it uses ``gemv_4bit``, which
    has no autograd kernel, so gradients through the layer are silently dropped (torch only warns). This turns that
    repack off (``support_avx512bf16_for_cpu = False``), which keeps evaluation correct and training possible. A layer
    already repacked cannot be restored: that raises a ``ValueError``.
    """
    bnb4 = _bnb_linear4bit()
    if bnb4 is None:
        return 0
    seen = 0
    for name, m in module.named_modules():
        if not isinstance(m, bnb4):
            continue
        state = getattr(m.weight, "quant_state", None)
        if state is not None and getattr(state, "packing_format_for_cpu", False):
            raise SettingsError(
                f"bitsandbytes layer {name or type(m).__name__} was already repacked for CPU inference (it ran in "
                "eval mode under no_grad); gradients through it would be silently dropped. Load the 4-bit model again "
                "and call hf_dtrain.quantization.prepare_bnb_4bit_for_training(model) (get_peft_model with an "
                "hf_dtrain method does it) before any evaluation."
            )
        m.support_avx512bf16_for_cpu = False
        seen += 1
    return seen


def quantize_model_hqq(
    model: nn.Module, group_size: int = 64, compute_dtype: torch.dtype = torch.float32, skip=("lm_head",)
) -> nn.Module:
    """Replace (in place) every ``nn.Linear`` except those in ``skip`` by HQQ 4-bit ``HQQLinear`` layers with groups
    along ``in_features`` (``axis=1``) and unquantized floating-point zero-points: the layout QA-HiRA merges into
    exactly. (transformers 5.23's ``HqqConfig`` loader raises ``NotImplementedError``, so this calls hqq directly.)

    On the meta device (a model built from its config for a memory trace) HQQ's optimisation of the zero-points,
    which reads the error back each iteration, is skipped: the layers have the same tensors, shapes and dtypes."""
    hqq = _hqq_linear()
    if hqq is None:
        raise ImportError("quantize='hqq4' needs the hqq package: pip install 'hf-dtrain[quant]' (or pip install hqq).")
    from hqq.core.quantize import BaseQuantizeConfig

    qcfg = BaseQuantizeConfig(nbits=4, group_size=group_size, quant_zero=False, quant_scale=False, axis=1)
    if _on_meta(model):
        qcfg["weight_quant_params"]["optimize"] = False

    def make(full: str, child: nn.Linear) -> nn.Module:
        if child.in_features % group_size:
            raise SettingsError(
                f"group_size={group_size} does not divide in_features={child.in_features} of "
                f"{full!r}; choose a divisor of every quantized layer's input dimension."
            )
        return hqq(child, qcfg, compute_dtype=compute_dtype, device=str(child.weight.device))

    return _replace_linears(model, make, skip, "quantize_model_hqq")


def _replace_linears(model: nn.Module, make, skip, what: str) -> nn.Module:
    """Every dense ``nn.Linear`` of ``model`` whose name does not end with one of ``skip`` replaced, in place, by
    ``make(name, layer)``; none found is a ``SettingsError`` naming ``what`` looked."""
    replaced = 0
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is not nn.Linear or any(full.endswith(s) for s in skip):
                continue
            setattr(parent, child_name, make(full, child))
            replaced += 1
    if replaced == 0:
        raise SettingsError(f"{what} found no nn.Linear to quantize.")
    return model


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def quantize_model_nf4(
    model: nn.Module,
    compute_dtype: torch.dtype = torch.float32,
    quant_storage: torch.dtype = torch.uint8,
    skip=("lm_head",),
) -> nn.Module:
    """Replace (in place) every ``nn.Linear`` except those in ``skip`` by bitsandbytes' NF4 ``Linear4bit`` as
    transformers' ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`` loads them (blocks of 64, no
    double quantization, ``compute_dtype``), quantized where the weights are: on the meta device (a model built from
    its config) the packed weight and its block scales get their shapes and dtypes from bitsandbytes' own kernels'
    shape functions, and nothing is computed."""
    bnb4 = _bnb_linear4bit()
    if bnb4 is None:
        raise ImportError("quantize='nf4' needs bitsandbytes>=0.46.1: pip install 'hf-dtrain[quant]'.")
    from bitsandbytes.nn import Params4bit

    def make(full: str, child: nn.Linear) -> nn.Module:
        layer = bnb4(
            child.in_features,
            child.out_features,
            bias=child.bias is not None,
            compute_dtype=compute_dtype,
            quant_type="nf4",
            quant_storage=quant_storage,
            device="meta",
        )
        layer.weight = Params4bit(
            child.weight.data,
            requires_grad=False,
            quant_type="nf4",
            compress_statistics=False,
            quant_storage=quant_storage,
            module=layer,
        )
        layer.weight._quantize(child.weight.device)  # Params4bit.to() leaves a meta weight unquantized
        if child.bias is not None:
            layer.bias = nn.Parameter(child.bias.data, requires_grad=False)
        return layer

    return _replace_linears(model, make, skip, "quantize_model_nf4")


def quantize_model(
    model: nn.Module, quantize: str, group_size: int = 64, compute_dtype: torch.dtype = torch.float32
) -> nn.Module:
    """``model``'s linear layers (except ``lm_head``) in 4 bits, in place, in the format ``quantize`` names and the
    layout :func:`load_quantized_model` loads: the one place a model built from its config (on the meta device for a
    memory trace, or initialised for the measurement the trace is checked against) becomes the 4-bit base a job
    trains on."""
    if quantize == "nf4":
        quantize_model_nf4(model, compute_dtype=compute_dtype)
        prepare_bnb_4bit_for_training(model)
    elif quantize == "hqq4":
        quantize_model_hqq(model, group_size=group_size, compute_dtype=compute_dtype)
    elif quantize == "int4":
        from hf_dtrain.quantization.int4 import quantize_model_int4

        quantize_model_int4(model, group_size=group_size)
    else:
        raise SettingsError(f"quantize={quantize!r} is unknown; use one of {', '.join(QUANTIZE_CHOICES)}.")
    return model


def quantized_state(model: nn.Module) -> list[torch.Tensor]:
    """The tensors ``model``'s 4-bit layers hold besides their parameters and buffers: bitsandbytes' block scales and
    code table (on the weight's ``quant_state``), HQQ's scales and zero-points (in the layer's ``meta``). A memory
    trace counts them with the weights."""
    found = []
    for module in model.modules():
        kind = quantized_kind(module)
        if kind == "nf4":
            found += _quant_state_tensors(getattr(module.weight, "quant_state", None))
        elif kind == "hqq4":
            found += [t for t in module.meta.values() if isinstance(t, torch.Tensor)]
    return found


def _quant_state_tensors(state) -> list[torch.Tensor]:
    if state is None:
        return []
    own = [t for t in (state.absmax, state.code, state.offset) if isinstance(t, torch.Tensor)]
    return own + _quant_state_tensors(state.state2)


# the first torch whose fake tensors copy bitsandbytes' 4-bit weight (``Params4bit``, a Parameter subclass with its
# own ``__torch_function__``): torch 2.11's FakeTensorMode returns NotImplemented for its empty_like (2.12 untried)
FAKE_PARAMS4BIT_FROM = (2, 13)


def to_empty(model: nn.Module, device) -> nn.Module:
    """``model.to_empty(device=device)`` that keeps the 4-bit layers whole: ``to_empty`` makes each parameter anew
    and knows nothing of the tensors a 4-bit layer holds elsewhere (bitsandbytes' ``quant_state`` on its weight,
    HQQ's ``meta``); those are made empty on ``device`` too and given back to the new weight and the layer."""
    import copy

    def emptied(value):
        return torch.empty_like(value, device=device) if isinstance(value, torch.Tensor) else value

    def state_on(state):
        if state is None:
            return None
        moved = copy.copy(state)
        for key in ("absmax", "code", "offset"):
            setattr(moved, key, emptied(getattr(state, key)))
        moved.state2 = state_on(state.state2)
        return moved

    kept = {}
    for module in model.modules():
        kind = quantized_kind(module)
        if kind == "nf4" and _fake() and torch.__version__ < FAKE_PARAMS4BIT_FROM:
            raise SettingsError(
                f"an NF4 base (bitsandbytes) cannot be traced on fake tensors with torch {torch.__version__}: its "
                f"4-bit weights are copied by torch {'.'.join(map(str, FAKE_PARAMS4BIT_FROM))} and later; upgrade "
                "torch, or give --estimate.skip true."
            )
        if kind == "nf4":
            weight = module.weight
            kept[module] = {k: getattr(weight, k) for k in _PARAMS4BIT_ATTRIBUTES if hasattr(weight, k)}
        elif kind == "hqq4":
            module.meta = {k: emptied(v) for k, v in module.meta.items()}
    model = model.to_empty(device=device)
    for module, attributes in kept.items():  # the new weight is a plain parameter: Params4bit's own fields again
        attributes["quant_state"] = state_on(attributes.get("quant_state"))
        for key, value in attributes.items():
            setattr(module.weight, key, value)
        module.quant_state = attributes["quant_state"]
    return model


def _fake() -> bool:
    """Whether ``to_empty`` runs inside a fake mode (an estimate), not on a real device."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode() is not None


@contextlib.contextmanager
def on_fake_tensors():
    """bitsandbytes' ``Linear4bit`` traced on fake tensors. When a sharding engine hands the layer a new weight
    tensor (FSDP2's gathered parameter), bitsandbytes wraps it in its ``Params4bit`` subclass again to give it back its
    quantization state; a fake tensor cannot be wrapped in a subclass, so while this is on a fake weight gets the state
    as an attribute, which is all the layer's forward reads. Real tensors take bitsandbytes' own path."""
    try:
        import bitsandbytes.nn.modules as bnb_modules
    except ImportError:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor

    original = bnb_modules.fix_4bit_weight_quant_state_from_module

    def fix(module):
        weight = module.weight
        if isinstance(weight, FakeTensor) and getattr(weight, "quant_state", None) is None:
            weight.quant_state = module.quant_state
            return
        original(module)

    bnb_modules.fix_4bit_weight_quant_state_from_module = fix
    try:
        yield
    finally:
        bnb_modules.fix_4bit_weight_quant_state_from_module = original


_PARAMS4BIT_ATTRIBUTES = (
    "blocksize",
    "compress_statistics",
    "quant_type",
    "quant_state",
    "quant_storage",
    "bnb_quantized",
    "module",
)


def load_quantized_model(
    path: str,
    quantize: str | None,
    group_size: int = 64,
    compute_dtype: torch.dtype = torch.float32,
    quant_storage: torch.dtype | None = None,
    **from_pretrained_kwargs,
):
    """``AutoModelForCausalLM.from_pretrained(path)`` with its linear layers (except ``lm_head``) in 4 bits.

    ``quantize``: None (dense), ``"nf4"`` (bitsandbytes through ``BitsAndBytesConfig``), ``"hqq4"`` or ``"int4"``
    (group-wise with zero-points, ``group_size`` along ``in_features``). bitsandbytes layers are prepared for training
    (:func:`prepare_bnb_4bit_for_training`). ``quant_storage``: bitsandbytes' ``bnb_4bit_quant_storage`` (the dtype
    the packed 4-bit codes are stored in; peft's FSDP-QLoRA guide sets it to the compute dtype so FSDP1's flat
    parameters have one dtype; FSDP2 shards each parameter on its own and takes the default uint8 too).
    """
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise SettingsError(f"quantize={quantize!r} is unknown; use one of {', '.join(QUANTIZE_CHOICES)} or None.")
    if quantize == "nf4":
        from transformers import BitsAndBytesConfig

        if _bnb_linear4bit() is None:
            raise ImportError("quantize='nf4' needs bitsandbytes>=0.46.1: pip install 'hf-dtrain[quant]'.")
        bnb_config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=compute_dtype,
            bnb_4bit_quant_storage=quant_storage or torch.uint8,
        )
        kwargs = dict(device_map="cpu") if not torch.cuda.is_available() else {}
        kwargs.update(from_pretrained_kwargs)
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb_config, **kwargs)
        prepare_bnb_4bit_for_training(model)
        return model
    model = AutoModelForCausalLM.from_pretrained(path, dtype=compute_dtype, **from_pretrained_kwargs)
    if quantize == "hqq4":
        quantize_model_hqq(model, group_size=group_size, compute_dtype=compute_dtype)
    elif quantize == "int4":
        from hf_dtrain.quantization.int4 import quantize_model_int4

        quantize_model_int4(model, group_size=group_size)
    return model


@torch.no_grad()
def hqq_fold_group_constant_update(layer: nn.Module, update: torch.Tensor, sign: float = 1.0) -> None:
    """Add ``sign * update`` (shape ``(out, in / group_size)``, one value per quantization group) to an HQQ layer's
    weight exactly by moving its zero-points: ``z -= c / s``. Needs ``axis=1`` and unquantized zero-points."""
    meta = layer.meta
    if meta.get("axis") != 1 or meta.get("quant_zero") or meta.get("quant_scale"):
        raise SettingsError(
            "an exact merge into HQQ needs axis=1 with unquantized scales and zero-points "
            "(BaseQuantizeConfig(nbits=4, group_size=g, axis=1, quant_zero=False, quant_scale=False)); "
            f"this layer has axis={meta.get('axis')}, quant_zero={meta.get('quant_zero')}."
        )
    out_f, in_f = layer.out_features, layer.in_features
    g = int(meta["group_size"])
    if tuple(update.shape) != (out_f, in_f // g):
        raise SettingsError(
            f"a group-constant update for this HQQ layer has shape {(out_f, in_f // g)}, got "
            f"{tuple(update.shape)}; pool the adapter's input by the quantization group size {g}."
        )
    zero, scale = meta["zero"], meta["scale"]
    c = update.reshape(zero.shape).to(torch.float32)
    meta["zero"] = (zero.float() - sign * c / scale.float()).to(zero.dtype)
