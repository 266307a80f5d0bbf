"""Group-wise asymmetric INT4 weights with floating-point zero-points, and the exact fold of a group-constant update.

Layout of one quantized ``out x in`` weight with group size ``g`` (groups run along ``in_features``, ``G = in / g``):

* ``qweight``: ``uint8`` ``(out, in / 2)``, two 4-bit codes per byte: column ``2k`` in the low nibble, ``2k+1`` in the
  high nibble; codes ``q`` in ``0..15``;
* ``scales``: ``(out, G)`` float, ``s > 0``;
* ``zeros``: ``(out, G)`` float zero-points ``z`` (not rounded to integers);
* the weight is ``W[o, i] = s[o, i // g] * (q[o, i] - z[o, i // g])``.

Because ``z`` is a float, any update ``c[o, j]`` that is constant over a group folds into it exactly:
``s (q - z) + c = s (q - (z - c / s))``. That is how a QA-HiRA (or QA-LoRA) adapter, whose input is average-pooled by
the group size, merges into the quantized model without re-quantizing: no weight code changes
(``fold_group_constant_update``). bitsandbytes NF4 has no zero-point (symmetric absmax per block), so it cannot
absorb such an update exactly. All tensors are plain tensors, saved with safetensors like any state dict.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_dtrain.errors import SettingsError

QMAX = 15


def _check_group(in_features: int, group_size: int) -> None:
    if not isinstance(group_size, int) or group_size < 2 or group_size % 2:
        raise SettingsError(f"group_size must be an even integer >= 2, got {group_size!r}.")
    if in_features % group_size:
        raise SettingsError(
            f"group_size={group_size} does not divide in_features={in_features}; choose a group size that divides "
            "the input dimension of every quantized layer (e.g. 32, 64 or 128 for LLaMA)."
        )


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """``(..., n)`` integer codes in 0..15 (``n`` even) -> ``(..., n / 2)`` uint8, low nibble first."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``(..., n / 2)`` uint8 -> ``(..., n)`` uint8 codes."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric INT4 per group: ``(qweight, scales, zeros)`` in the layout of this module.

    Each group's range ``[min, max]`` maps onto ``0..15``: ``s = (max - min) / 15``, ``z = -min / s``, so both ends are
    exact and every element's error is at most ``s / 2``. Constant groups get ``s = 1`` (exact).
    """
    out_f, in_f = weight.shape
    _check_group(in_f, group_size)
    w = weight.detach().float().view(out_f, in_f // group_size, group_size)
    wmin, wmax = w.amin(dim=-1), w.amax(dim=-1)
    scales = (wmax - wmin) / QMAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    zeros = -wmin / scales
    codes = torch.clamp(torch.round(w / scales[..., None] + zeros[..., None]), 0, QMAX)
    return pack_int4(codes.view(out_f, in_f)), scales, zeros


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype=torch.float32
) -> torch.Tensor:
    out_f, n_groups = scales.shape
    codes = unpack_int4(qweight).float().view(out_f, n_groups, -1)
    return (scales[..., None] * (codes - zeros[..., None])).view(out_f, -1).to(dtype)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach(), requires_grad=False)


class Int4Linear(nn.Module):
    """A linear layer with group-wise asymmetric INT4 weights (see the module docstring); the bias stays dense.

    The forward dequantizes the weight to the input's dtype and calls ``F.linear`` (portable, CPU and GPU).
    ``qweight``, ``scales`` and ``zeros`` are frozen parameters (so FSDP2 / ZeRO-3 shard them) and are the format:
    ``state_dict()`` / safetensors round-trip it.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group_size: int = 64,
        bias: bool = True,
        device=None,
        dtype=torch.float32,
    ) -> None:
        super().__init__()
        _check_group(in_features, group_size)
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        n_groups = in_features // group_size
        # frozen parameters, not buffers: FSDP2 and ZeRO-3 shard parameters only, and the packed weight is most of the
        # model; state_dict keys are the same either way
        self.qweight = _frozen(torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.scales = _frozen(torch.ones(out_features, n_groups, dtype=torch.float32, device=device))
        self.zeros = _frozen(torch.zeros(out_features, n_groups, dtype=torch.float32, device=device))
        self.bias = (
            nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype), requires_grad=False) if bias else None
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 64) -> Int4Linear:
        q = cls(
            linear.in_features,
            linear.out_features,
            group_size,
            bias=linear.bias is not None,
            device=linear.weight.device,
            dtype=linear.weight.dtype,
        )
        q.qweight, q.scales, q.zeros = (_frozen(t) for t in quantize_int4(linear.weight, group_size))
        if linear.bias is not None:
            q.bias.data.copy_(linear.bias.detach())
        return q

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (float32), for code that reads ``layer.weight``."""
        return dequantize_int4(self.qweight, self.scales, self.zeros)

    @weight.setter
    def weight(self, value: torch.Tensor) -> None:
        # peft's module swap re-assigns ``module.weight = module.weight`` when unloading; accept exactly that.
        if not (
            torch.is_tensor(value)
            and value.shape == (self.out_features, self.in_features)
            and torch.equal(value.to(torch.float32), self.weight)
        ):
            raise AttributeError(
                "Int4Linear.weight is derived from qweight/scales/zeros; build a new layer with "
                "Int4Linear.from_linear(...) to change it."
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize_int4(self.qweight, self.scales, self.zeros, dtype=x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    @torch.no_grad()
    def fold_group_constant_update(self, update: torch.Tensor, sign: float = 1.0) -> None:
        """Add ``sign * update`` to the weight exactly, where ``update`` is ``(out, in / group_size)``: one value per
        quantization group, constant over the group's columns. Only the zero-points change: ``z -= c / s``."""
        expected = (self.out_features, self.in_features // self.group_size)
        if tuple(update.shape) != expected:
            raise SettingsError(
                f"a group-constant update for this layer has shape {expected} (out, in / group_size), got "
                f"{tuple(update.shape)}; pool the adapter's input by the quantization group size."
            )
        self.zeros -= sign * update.to(self.zeros) / self.scales

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, bits=4"


def quantize_model_int4(model: nn.Module, group_size: int = 64, target_modules=None, skip=("lm_head",)) -> nn.Module:
    """Replace (in place) the ``nn.Linear`` modules of ``model`` whose name ends with one of ``target_modules``
    (default: every linear except those in ``skip``) by :class:`Int4Linear`; returns the model."""
    replaced = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if not isinstance(child, nn.Linear):
                continue
            if target_modules is not None and not any(full.endswith(t) for t in target_modules):
                continue
            if target_modules is None and any(full.endswith(s) for s in skip):
                continue
            setattr(module, child_name, Int4Linear.from_linear(child, group_size))
            replaced += 1
    if replaced == 0:
        raise SettingsError(f"quantize_model_int4 found no nn.Linear to quantize (target_modules={target_modules}).")
    return model
