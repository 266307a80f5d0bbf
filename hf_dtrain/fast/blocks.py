"""The block-level lean path: a decoder's SwiGLU MLP (``down(silu(gate(x)) * up(x))``) whose three projections carry
low-rank adapters on frozen dense bases, as one autograd function.

Per projection ``p`` the output is ``x W_p^T + s_p (x A_p^T) B_p^T`` (peft LoRA, LoRA-FA). Run layer by layer, even
through :class:`~hf_dtrain.fast.lowrank.LowRankLinear`, autograd keeps for backward: the input cast for the gate and
again for the up projection (two copies of ``x``), the gate output (for the SiLU), ``silu(gate)`` and the up output
(for the product), and the product ``h`` (the down projection's input, for its adapter): ``2 in + 4 inter`` values
per token. Here it keeps ``x`` once in the compute dtype (or, when neither ``A`` trains, as LoRA-FA, only ``x A^T`` of
the gate and the up projection: ``2 r`` values, never ``x``), the gate and the up outputs: ``in + 2 inter``. In
backward ``silu(gate)`` and ``h`` are computed again from them (two elementwise passes), the SiLU's gradient by the
same kernel autograd runs (``aten.silu_backward``), and the input gradient of the two input projections is summed in
place: ``dx = dg W_g + du W_u + s_g (dg B_g) A_g + s_u (du B_u) A_u``.

Products run in the compute dtype (autocast's where it is on, else the input's); the factors' gradients are returned
in their own dtype (fp32 adapters stay fp32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .lowrank import cast_once


class SwiGLULowRank(torch.autograd.Function):
    """``out = down(silu(gate(x)) * up(x))`` with ``p(x) = x W_p^T + s_p (x A_p^T) B_p^T`` for ``p`` in gate, up,
    down, frozen ``W_p``. See the module's docstring."""

    @staticmethod
    def forward(ctx, x, wg, ag, bg, wu, au, bu, wd, ad, bd, sg: float, su: float, sd: float, dtype: torch.dtype):
        shape = x.shape
        x2 = cast_once(x, dtype).reshape(-1, shape[-1])  # the one cast of x, shared as the layers' paths share it
        agc, bgc, auc, buc, adc, bdc = (t.to(dtype) for t in (ag, bg, au, bu, ad, bd))
        hg, hu = torch.mm(x2, agc.t()), torch.mm(x2, auc.t())
        g = F.linear(x2, wg.to(dtype)).addmm_(hg, bgc.t(), alpha=sg)
        u = F.linear(x2, wu.to(dtype)).addmm_(hu, buc.t(), alpha=su)
        h = F.silu(g).mul_(u)
        out = F.linear(h, wd.to(dtype)).addmm_(torch.mm(h, adc.t()), bdc.t(), alpha=sd)
        keep_x = ag.requires_grad or au.requires_grad
        ctx.save_for_backward(
            x2 if keep_x else None,
            None if keep_x else hg,
            None if keep_x else hu,
            g,
            u,
            wg,
            wu,
            wd,
            agc,
            bgc,
            auc,
            buc,
            adc,
            bdc,
        )
        ctx.scales, ctx.dtype, ctx.shape, ctx.x_dtype = (sg, su, sd), dtype, shape, x.dtype
        ctx.factor_dtypes = tuple(t.dtype for t in (ag, bg, au, bu, ad, bd))
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x2, hg, hu, g, u, wg, wu, wd, agc, bgc, auc, buc, adc, bdc = ctx.saved_tensors
        (sg, su, sd), dtype = ctx.scales, ctx.dtype
        need = ctx.needs_input_grad
        go = grad.reshape(-1, grad.shape[-1])
        if go.dtype != dtype:
            go = go.to(dtype)
        silu = F.silu(g)  # again, rather than kept
        h = silu * u
        grads = dict.fromkeys(("ag", "bg", "au", "bu", "ad", "bd"))
        # the down projection (input h)
        ghd = torch.mm(go, bdc).mul_(sd)  # the gradient at h A_d^T, s folded in: (tokens, r)
        if need[9]:
            grads["bd"] = torch.mm(go.t(), torch.mm(h, adc.t())).mul_(sd)
        if need[8]:
            grads["ad"] = torch.mm(ghd.t(), h)
        dh = torch.mm(go, wd.to(dtype)).addmm_(ghd, adc)
        # the product and the SiLU, by the kernels autograd runs for them
        du = dh * silu
        dg = torch.ops.aten.silu_backward(dh.mul_(u), g)
        # the gate and the up projections (input x)
        if hg is None:  # A trains: x A^T again (r values per token) rather than kept
            hg, hu = torch.mm(x2, agc.t()), torch.mm(x2, auc.t())
        ghg, ghu = torch.mm(dg, bgc).mul_(sg), torch.mm(du, buc).mul_(su)
        if need[3]:
            grads["bg"] = torch.mm(dg.t(), hg).mul_(sg)
        if need[6]:
            grads["bu"] = torch.mm(du.t(), hu).mul_(su)
        if need[2]:
            grads["ag"] = torch.mm(ghg.t(), x2)
        if need[5]:
            grads["au"] = torch.mm(ghu.t(), x2)
        dx = None
        if need[0]:
            dx = torch.mm(dg, wg.to(dtype)).addmm_(du, wu.to(dtype)).addmm_(ghg, agc).addmm_(ghu, auc)
            dx = dx.view(ctx.shape).to(ctx.x_dtype)
        out = {k: None if v is None else v.to(d) for (k, v), d in zip(grads.items(), ctx.factor_dtypes)}
        return (
            dx,
            None,
            out["ag"],
            out["bg"],
            None,
            out["au"],
            out["bu"],
            None,
            out["ad"],
            out["bd"],
            None,
            None,
            None,
            None,
        )


def swiglu_lowrank(x, gate, up, down, dtype: torch.dtype) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` through :class:`SwiGLULowRank`; ``gate``, ``up``, ``down``: ``(weight, a, b,
    scale)`` of each projection."""
    (wg, ag, bg, sg), (wu, au, bu, su), (wd, ad, bd, sd) = gate, up, down
    return SwiGLULowRank.apply(x, wg, ag, bg, wu, au, bu, wd, ad, bd, float(sg), float(su), float(sd), dtype)
