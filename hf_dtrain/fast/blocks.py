"""The block-level lean paths. A decoder's SwiGLU MLP (``down(silu(gate(x)) * up(x))``) whose three projections carry
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


class SharedInputLowRank(torch.autograd.Function):
    """``out_i = x W_i^T + s_i (x A_i^T) B_i^T`` for the projections ``i`` that read one input (a decoder attention's
    q, k and v), frozen ``W_i``, as one autograd function.

    Run layer by layer, each projection computes its own ``x A_i^T``, ``A_i``'s gradient and its share of the input
    gradient, and autograd adds the shares (``n - 1`` full-width adds). Here the factors ``A_i`` are stacked (``R =
    sum r_i`` rows): forward computes ``H = x [A_1; ...; A_n]^T`` in one product and adds each ``H_i B_i^T`` into its
    base product in place; backward computes every ``A_i``'s gradient in one product ``G^T x`` (``G`` the gradients
    at ``H``, ``s_i`` folded in) and the input gradient ``dx = sum_i g_i W_i + G [A_1; ...; A_n]`` in one buffer.
    Keeps ``x`` once in the compute dtype (or, when no ``A_i`` trains, as LoRA-FA, ``H``: ``R`` values per token,
    never ``x``) and the factors in the compute dtype."""

    @staticmethod
    def forward(ctx, x, scales: tuple, dtype: torch.dtype, *tensors):
        shape = x.shape
        n = len(scales)
        ws, as_, bs = tensors[0::3], tensors[1::3], tensors[2::3]
        x2 = cast_once(x, dtype).reshape(-1, shape[-1])
        a_all = torch.cat(as_).to(dtype)  # (R, in): one cast of the stacked factors
        bcs = [b.to(dtype) for b in bs]
        h = torch.mm(x2, a_all.t())  # (tokens, R)
        ranks = [a.shape[0] for a in as_]
        hs = h.split(ranks, dim=1)
        outs = [F.linear(x2, w.to(dtype)).addmm_(hi, bc.t(), alpha=s) for w, hi, bc, s in zip(ws, hs, bcs, scales)]
        keep_x = any(a.requires_grad for a in as_)
        # the stacked factors where a cast made them (the layers keep their casts too), else the factors themselves
        # (stacked again in backward: an r-sized op rather than a copy kept)
        cast = any(a.dtype != dtype for a in as_)
        ctx.save_for_backward(x2 if keep_x else h, *((a_all,) if cast else as_), *ws, *bcs)
        ctx.keep_x, ctx.scales, ctx.dtype, ctx.shape, ctx.ranks = keep_x, scales, dtype, shape, ranks
        ctx.x_dtype = x.dtype
        ctx.factor_dtypes = [(a.dtype, b.dtype) for a, b in zip(as_, bs)]
        ctx.n = n
        return tuple(o.view(*shape[:-1], o.shape[-1]) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        n, dtype, scales = ctx.n, ctx.dtype, ctx.scales
        saved, *rest = ctx.saved_tensors
        ws, bcs = rest[-2 * n : -n], rest[-n:]
        factors = rest[: -2 * n]
        a_all = factors[0] if len(factors) == 1 else torch.cat(factors)
        need = ctx.needs_input_grad  # x, scales, dtype, then (w, a, b) per projection
        gos = []
        for g in grads:
            g = g.reshape(-1, g.shape[-1])
            gos.append(g if g.dtype == dtype else g.to(dtype))
        # the gradient at H, each s_i folded in: (tokens, R)
        gh = torch.cat([torch.mm(g, bc).mul_(s) for g, bc, s in zip(gos, bcs, scales)], dim=1)
        out = [None] * (3 * n)
        if any(need[3 + 3 * i + 2] for i in range(n)):
            h = torch.mm(saved, a_all.t()) if ctx.keep_x else saved
            for i, hi in enumerate(h.split(ctx.ranks, dim=1)):
                if need[3 + 3 * i + 2]:
                    out[3 * i + 2] = torch.mm(gos[i].t(), hi).mul_(scales[i]).to(ctx.factor_dtypes[i][1])
        if any(need[3 + 3 * i + 1] for i in range(n)):
            grad_a = torch.mm(gh.t(), saved)  # (R, in): every A_i's gradient in one product
            for i, gi in enumerate(grad_a.split(ctx.ranks, dim=0)):
                if need[3 + 3 * i + 1]:
                    out[3 * i + 1] = gi.to(ctx.factor_dtypes[i][0])
        dx = None
        if need[0]:
            dx = torch.mm(gh, a_all)
            for g, w in zip(gos, ws):
                dx.addmm_(g, w.to(dtype))
            dx = dx.view(ctx.shape).to(ctx.x_dtype)
        return (dx, None, None, *out)


def shared_input_lowrank(x, projections, dtype: torch.dtype) -> tuple:
    """``(p(x) for p in projections)`` through :class:`SharedInputLowRank`; each projection ``(weight, a, b,
    scale)``."""
    scales = tuple(float(p[3]) for p in projections)
    tensors = [t for w, a, b, _ in projections for t in (w, a, b)]
    return SharedInputLowRank.apply(x, scales, dtype, *tensors)
