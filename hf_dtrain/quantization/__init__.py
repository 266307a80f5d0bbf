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
    return bnb.nn.Linear4bit


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
    exactly. (transformers 5.23's ``HqqConfig`` loader raises ``NotImplementedError``, so this calls hqq directly.)"""
    hqq = _hqq_linear()
    if hqq is None:
        raise ImportError("quantize='hqq4' needs the hqq package: pip install 'hf-dtrain[quant]' (or pip install hqq).")
    from hqq.core.quantize import BaseQuantizeConfig

    qcfg = BaseQuantizeConfig(nbits=4, group_size=group_size, quant_zero=False, quant_scale=False, axis=1)
    replaced = 0
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if not isinstance(child, nn.Linear) or any(full.endswith(s) for s in skip):
                continue
            if child.in_features % group_size:
                raise SettingsError(
                    f"group_size={group_size} does not divide in_features={child.in_features} of "
                    f"{full!r}; choose a divisor of every quantized layer's input dimension."
                )
            device = str(child.weight.device)
            setattr(parent, child_name, hqq(child, qcfg, compute_dtype=compute_dtype, device=device))
            replaced += 1
    if replaced == 0:
        raise SettingsError("quantize_model_hqq found no nn.Linear to quantize.")
    return model


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
