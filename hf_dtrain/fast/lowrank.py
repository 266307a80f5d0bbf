"""The lean low-rank layer: ``y = x W^T + b + s (x A^T) B^T`` as one autograd function.

What peft's LoRA runs for that line, per layer: the base product, a cast of ``x`` for each of the two products under
autocast, ``x A^T``, ``h B^T``, a multiply by ``s`` and an add over the full output width, and in backward the same
again plus an add of the two input gradients; it keeps ``x`` (for ``A``'s gradient), ``h`` (for ``B``'s) and, under
autocast, a low-precision copy of ``W``. Here:

* forward: ``x`` cast once to the compute dtype (one copy shared by the layers reading the same input: q, k, v), the
  base product (``F.linear``), ``h = x A^T`` and
  ``y.addmm_(h, B^T, alpha=s)`` into the base product's own output (no full-width multiply or add);
* backward: ``g B`` (``s`` folded in, ``r`` values per token), ``B``'s gradient ``s g^T h``, ``A``'s ``(s g B)^T x``,
  and the input gradient ``g W`` with ``(s g B) A`` added in place;
* saved: ``h`` alone when ``A`` is frozen (LoRA-FA); ``x`` alone when ``A`` trains (``h`` is recomputed, ``r`` values
  per token); ``A`` and ``B`` in the compute dtype (``r``-sized); never a cast copy of ``W`` (cast again in backward
  where it is not in the compute dtype already: a weight-sized op, no activation).

The base is inside only when it is a dense, frozen ``nn.Linear`` (``weight`` given); otherwise (a 4-bit base, a base
the caller runs) the function takes the base output ``y`` and writes ``y`` plus the low-rank product in one ``addmm``.

Products run in the compute dtype: autocast's where it is on (as ``nn.Linear`` would), else the input's; ``A`` and
``B`` are cast to it (``r``-sized), their gradients returned in their own dtype (fp32 adapters stay fp32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakTensorKeyDictionary

# the compute-dtype copy of each input tensor, shared by the layers that read it (see cast_once)
_CASTS = WeakTensorKeyDictionary()


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer's product runs in for input ``x``: autocast's where it is on, else ``x``'s."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def cast_once(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``, made once per input tensor: the layers that read the same input (an attention block's q, k
    and v projections) share one cast copy, one op and one tensor kept for backward instead of one per layer. Keyed by
    the tensor object and its version (an in-place change makes a new copy); the entry goes with ``x``. Under
    ``torch.compile`` a plain cast (the graph shares it where it can)."""
    if x.dtype == dtype:
        return x
    if torch.compiler.is_compiling():
        return x.to(dtype)
    hit = _CASTS.get(x)
    if hit is not None and hit[0] == x._version and hit[1].dtype == dtype:
        return hit[1]
    out = x.to(dtype)
    _CASTS[x] = (x._version, out)
    return out


class LowRankLinear(torch.autograd.Function):
    """``out = base + scale * (x @ a.T) @ b.T`` with ``base = F.linear(x, weight, bias)`` (``weight`` given: a dense
    frozen base) or ``base = y`` (the base's output, computed by the caller); with ``repeat`` > 1, ``a`` and ``b`` with
    each column / row repeated that many times. See the module's docstring."""

    @staticmethod
    def forward(ctx, x, weight, bias, y, a, b, scale: float, dtype: torch.dtype, repeat: int = 1):
        shape = x.shape
        x2 = cast_once(x, dtype).reshape(-1, shape[-1])
        if repeat == 1:
            ac, bc = a.to(dtype), b.to(dtype)
        else:  # each column of A and row of B ``repeat`` times: one op each, the copy and the cast together
            ac = a.unsqueeze(-1).expand(*a.shape, repeat).to(dtype).reshape(a.shape[0], -1)
            bc = b.unsqueeze(1).expand(b.shape[0], repeat, b.shape[1]).to(dtype).reshape(-1, b.shape[1])
        h = torch.mm(x2, ac.t())
        if weight is not None:  # the base product is this function's own buffer: add in place
            out = F.linear(x2, weight.to(dtype), None if bias is None else bias.to(dtype))
            out.addmm_(h, bc.t(), alpha=scale)
        else:  # the caller's base output, in its own dtype: one op reads it and writes the sum
            y2 = y.reshape(-1, y.shape[-1])
            out = torch.addmm(y2, h.to(y2.dtype), bc.t().to(y2.dtype), alpha=scale)
        keep_x = a.requires_grad
        # the factors in the compute dtype (r-sized: kept rather than cast again in backward)
        ctx.save_for_backward(x2 if keep_x else h, weight, ac, bc)
        ctx.keep_x, ctx.scale, ctx.dtype, ctx.shape, ctx.repeat = keep_x, scale, dtype, shape, repeat
        ctx.x_dtype, ctx.y_dtype, ctx.a_dtype, ctx.b_dtype = x.dtype, (None if y is None else y.dtype), a.dtype, b.dtype
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        saved, weight, ac, bc = ctx.saved_tensors
        dtype, scale = ctx.dtype, ctx.scale
        g = grad.reshape(-1, grad.shape[-1])
        if g.dtype != dtype:
            g = g.to(dtype)
        need_x, need_y = ctx.needs_input_grad[0], ctx.needs_input_grad[3]
        gh = torch.mm(g, bc).mul_(scale)  # the gradient at h, s folded in: (tokens, r)
        grad_a = grad_b = grad_x = grad_y = None
        if ctx.needs_input_grad[5]:
            h = torch.mm(saved, ac.t()) if ctx.keep_x else saved
            grad_b = torch.mm(g.t(), h).mul_(scale)
            grad_b = (
                grad_b.to(ctx.b_dtype)
                if ctx.repeat == 1
                else grad_b.view(-1, ctx.repeat, grad_b.shape[1]).sum(1, dtype=ctx.b_dtype)  # over the copies
            )
        if ctx.needs_input_grad[4]:
            grad_a = torch.mm(gh.t(), saved)
            grad_a = (
                grad_a.to(ctx.a_dtype)
                if ctx.repeat == 1
                else grad_a.view(grad_a.shape[0], -1, ctx.repeat).sum(-1, dtype=ctx.a_dtype)
            )
        if need_x:
            if weight is not None:
                grad_x = torch.mm(g, weight.to(dtype)).addmm_(gh, ac)
            else:
                grad_x = torch.mm(gh, ac)
            grad_x = grad_x.view(ctx.shape).to(ctx.x_dtype)
        if need_y:
            grad_y = grad.to(ctx.y_dtype)
        return grad_x, None, None, grad_y, grad_a, grad_b, None, None, None


def lowrank_linear(x, a, b, scale: float, *, weight=None, bias=None, y=None, repeat: int = 1) -> torch.Tensor:
    """``F.linear(x, weight, bias) + scale * F.linear(F.linear(x, a), b)`` (or ``y + ...``) through
    :class:`LowRankLinear`, in the compute dtype of ``x``. ``repeat``: ``A``'s columns and ``B``'s rows each stand for
    ``repeat`` consecutive ones (Q-BaRA's pooled input and repeated output; their gradients summed over the copies)."""
    return LowRankLinear.apply(x, weight, bias, y, a, b, float(scale), compute_dtype(x), int(repeat))


class FrozenLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` for a frozen dense base, in the compute dtype: keeps the weight itself (a
    parameter, no memory of its own) for the input gradient and casts it again in backward, where autocast's linear
    keeps a cast copy of the weight (and the cast input, which a frozen weight never needs). The layers of a tuner
    whose adapter has nothing there (an SMT target with no selected block) run this."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype: torch.dtype):
        out = F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
        ctx.save_for_backward(weight)
        ctx.dtype, ctx.x_dtype = dtype, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.matmul(grad.to(ctx.dtype), weight.to(ctx.dtype)).to(ctx.x_dtype)
        return grad_x, None, None, None


def frozen_linear(x, weight, bias=None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a frozen ``weight`` through :class:`FrozenLinear`."""
    return FrozenLinear.apply(x, weight, bias, compute_dtype(x))


def _sum_groups(t: torch.Tensor) -> torch.Tensor:
    """``t.sum(-1)`` as a new tensor: over a short last dimension (QA-HiRA's output groups, 1-8) as adds of its
    strided slices, which run many times faster on CPU than a reduction over a dimension of 2."""
    n = t.shape[-1]
    if n > 8:
        return t.sum(-1)
    out = t[..., 0].clone() if n == 1 else torch.add(t[..., 0], t[..., 1])
    for j in range(2, n):
        out.add_(t[..., j])
    return out


class PooledDelta(torch.autograd.Function):
    """``out = y + scale * repeat_out(mean_g(x) @ a.T [@ b.T])``: QA-HiRA's update (one value per output group of
    ``lam`` rows and input group of ``g`` columns) repeated over its output groups and added to the base output ``y``
    in one plain add, without the up-cast activations or the separate multiply of the plain path. Keeps the pooled
    input (``in / g`` values per token), with a rank also ``mean_g(x) @ a.T`` (``r`` per token), and the factors in
    the compute dtype."""

    @staticmethod
    def forward(ctx, y, x, a, b, g: int, lam: int, scale: float, dtype: torch.dtype):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        # (tokens, in / g), in x's dtype: cast g times fewer values
        pooled = _sum_groups(x2.view(x2.shape[0], -1, g)).mul_(1.0 / g)
        if pooled.dtype != dtype:
            pooled = pooled.to(dtype)
        ac = a.to(dtype)
        bc = None if b is None else b.to(dtype)
        h_a = torch.mm(pooled, ac.t())
        h = h_a if bc is None else torch.mm(h_a, bc.t())  # (tokens, out / lam)
        # y + scale * repeat(h): a broadcast add over a short last dimension runs several times slower on CPU than
        # repeating h (out / lam values per token) and one plain add
        h = h.to(y.dtype)
        out = torch.add(y, (h if lam == 1 else h.repeat_interleave(lam, dim=-1)).view(y.shape), alpha=scale)
        # with a rank, x A^T too (r values per token, kept rather than computed again for B's gradient)
        ctx.save_for_backward(pooled, ac, bc, None if bc is None or not b.requires_grad else h_a)
        ctx.g, ctx.lam, ctx.scale, ctx.shape = g, lam, scale, shape
        ctx.x_dtype, ctx.a_dtype, ctx.b_dtype, ctx.dtype = x.dtype, a.dtype, None if b is None else b.dtype, dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        pooled, ac, bc, h_a = ctx.saved_tensors
        dtype, tokens = ctx.dtype, pooled.shape[0]
        gh = _sum_groups(grad.reshape(tokens, -1, ctx.lam))
        if gh.dtype != dtype:
            gh = gh.to(dtype)
        gh.mul_(ctx.scale)  # the gradient at the (tokens, out / lam) update
        grad_a = grad_b = grad_x = None
        if bc is not None:
            if ctx.needs_input_grad[3]:
                grad_b = torch.mm(gh.t(), h_a).to(ctx.b_dtype)
            gh = torch.mm(gh, bc)  # at h = pooled @ a.T
        if ctx.needs_input_grad[2]:
            grad_a = torch.mm(gh.t(), pooled).to(ctx.a_dtype)
        if ctx.needs_input_grad[1]:
            gp = torch.mm(gh, ac).div_(ctx.g)  # at the pooled input, the mean's 1/g folded in
            grad_x = gp.unsqueeze(-1).expand(tokens, gp.shape[1], ctx.g).reshape(ctx.shape).to(ctx.x_dtype)
        return grad, grad_x, grad_a, grad_b, None, None, None, None


def pooled_delta(y, x, a, b, g: int, lam: int, scale: float) -> torch.Tensor:
    """``y + scale * repeat_interleave(mean_g(x) @ a.T [@ b.T], lam)`` through :class:`PooledDelta`."""
    return PooledDelta.apply(y, x, a, b, int(g), int(lam), float(scale), compute_dtype(x))
