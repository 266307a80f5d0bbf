"""Per-job optimisation of fused parameters (leading dim K): AdamW with each job's own learning rate, weight decay
and schedule, gradient clipping per job, and a stop mask for jobs that diverged.

:class:`FusedAdamW` computes, slice by slice, what ``torch.optim.AdamW`` (the Trainer's default; its single-tensor
path on CPU) computes for one job, with the per-job scalars as ``(K, 1, ...)`` tensors; ``rule="lorafa"`` is peft's
``LoraFAOptimizer`` instead (LoRA-FA v2's correction ``g_B <- g_B (A A^T + 1e-8 I)^+ / s^2`` and its Adam variant).
The schedules are transformers' own (``get_scheduler``), one per job, so each job's learning rate at every step is
the one the Trainer would use.
"""

from __future__ import annotations

import math

import torch
from transformers import get_scheduler

from hf_dtrain.errors import SettingsError


def _per_job(values, like: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
    """``(K,)`` float64 values -> ``(K, 1, ..., 1)`` in ``like``'s dtype and device (cast once, as a Python float
    scalar is cast by an in-place op). ``cache`` keeps one converted vector per (key, dtype, device) for a step."""
    key = (id(values), like.dtype, like.device)
    t = None if cache is None else cache.get(key)
    if t is None:
        t = torch.as_tensor(values, dtype=torch.float64).to(device=like.device, dtype=like.dtype)
        if cache is not None:
            cache[key] = t
    return t.view(-1, *([1] * (like.dim() - 1)))


class FusedAdamW:
    """AdamW over fused parameters, each job with its own hyper-parameters.

    ``params``: fused tensors whose dim 0 is the job; ``decay``: per-parameter flags (the Trainer decays every weight
    but biases and norms); ``lr`` is set each step by :meth:`step` (``lrs``), ``weight_decay`` is per job.
    ``pairs`` (``rule="lorafa"``): ``{id(B): (A, scaling (K,))}`` for the LoRA-FA correction.
    """

    def __init__(
        self,
        params,
        num_jobs: int,
        weight_decay,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        decay=None,
        rule: str = "adamw",
        pairs=None,
    ) -> None:
        if rule not in ("adamw", "lorafa"):
            raise SettingsError(f"FusedAdamW rule={rule!r}: use 'adamw' or 'lorafa'.")
        self.params = list(params)
        self.num_jobs = num_jobs
        for p in self.params:
            if p.shape[0] != num_jobs:
                raise SettingsError(
                    f"fused parameter of shape {tuple(p.shape)} does not lead with the {num_jobs} jobs."
                )
        self.weight_decay = [float(w) for w in weight_decay]
        self.betas, self.eps, self.rule = betas, eps, rule
        self.decay = list(decay) if decay is not None else [True] * len(self.params)
        self.pairs = pairs or {}
        self.state = [dict(m=torch.zeros_like(p), v=torch.zeros_like(p)) for p in self.params]
        self._inverses: dict[int, torch.Tensor] = {}  # LoRA-FA: (A A^T + 1e-8 I)^+ per B (A is frozen)
        self.steps = [0] * num_jobs  # per job: a stopped job's count stops too

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Each job's gradients clipped to ``max_norm`` as ``torch.nn.utils.clip_grad_norm_`` clips one job's;
        returns the ``(K,)`` total norms before clipping."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return torch.zeros(self.num_jobs)
        norms = torch.stack([torch.linalg.vector_norm(g.reshape(self.num_jobs, -1), 2, dim=1) for g in grads])
        total = torch.linalg.vector_norm(norms, 2, dim=0)  # (K,)
        if max_norm and max_norm > 0:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.to(g.dtype).view(-1, *([1] * (g.dim() - 1))))
        return total

    @torch.no_grad()
    def step(self, lrs, active=None) -> None:
        """One update with learning rates ``lrs`` (K floats); jobs with ``active[k]`` False are left unchanged."""
        active = [True] * self.num_jobs if active is None else list(active)
        for k in range(self.num_jobs):
            if active[k]:
                self.steps[k] += 1
        b1, b2 = self.betas
        steps = [max(s, 1) for s in self.steps]
        lrs = [float(lr) if a else 0.0 for lr, a in zip(lrs, active)]
        mask = None if all(active) else torch.tensor(active)
        # this step's per-job scalars, each converted once per dtype and device
        c = self._coefficients = dict(
            decay=[1 - lr * wd for lr, wd in zip(lrs, self.weight_decay)],
            neg_step_size=[-(lr / (1 - b1**s)) for lr, s in zip(lrs, steps)],
            bc2_sqrt=[math.sqrt(1 - b2**s) for s in steps],
            lorafa_neg_step=[-(lr * math.sqrt(1 - b2**s) / (1 - b1**s)) for lr, s in zip(lrs, steps)],
            lorafa_decay=[lr * wd for lr, wd in zip(lrs, self.weight_decay)],
        )
        cache: dict = {}
        for p, st, decay in zip(self.params, self.state, self.decay):
            if p.grad is None:
                continue
            g = p.grad
            if mask is not None:
                keep = mask.to(p.device).view(-1, *([1] * (p.dim() - 1)))
                g = torch.where(keep, g, torch.zeros((), dtype=g.dtype, device=g.device))
            if self.rule == "lorafa":
                self._lorafa(p, g, st, c, cache, mask)
                continue
            if decay and any(wd != 0 for wd in self.weight_decay):
                p.mul_(_per_job(c["decay"], p, cache))
            m, v = st["m"], st["v"]
            if mask is None:  # in place, as torch's AdamW
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
            else:  # a stopped job's moments stay as they were
                m.copy_(torch.where(keep, m.lerp(g, 1 - b1), m))
                v.copy_(torch.where(keep, (v * b2).addcmul_(g, g, value=1 - b2), v))
            denom = v.sqrt().div_(_per_job(c["bc2_sqrt"], p, cache)).add_(self.eps)
            # param.addcdiv_(m, denom, value=-step_size) computes (value * m) / denom: the same rounding, per job
            p.add_(torch.mul(m, _per_job(c["neg_step_size"], p, cache)).div_(denom))

    def _lorafa(self, p, g, st, c, cache, mask) -> None:
        """peft's ``LoraFAOptimizer`` step (peft 0.21), per job."""
        b1, b2 = self.betas
        pair = self.pairs.get(id(p))
        if pair is not None:
            a, scaling = pair
            inv = self._inverses.get(id(p))
            if inv is None:  # peft recomputes it every step; A never changes, so once is the same value
                eye = torch.eye(a.shape[1], dtype=a.dtype, device=a.device)
                inv = self._inverses[id(p)] = torch.linalg.pinv(a @ a.transpose(1, 2) + 1e-8 * eye)
            from peft.optimizers import lorafa as peft_lorafa

            # as peft computes it: in bf16 autocast wherever accelerate reports bf16 (CPUs included)
            with torch.autocast(p.device.type, dtype=torch.bfloat16, enabled=peft_lorafa.is_bf16_available()):
                corrected = (1 / scaling.view(-1, 1, 1) ** 2) * (g @ inv)
            g = corrected.to(g.dtype)
        m, v = st["m"], st["v"]
        m_new = (m * b1).add_(g, alpha=1 - b1)
        v_new = (v * b2).addcmul_(g, g, value=1 - b2)
        if mask is not None:
            keep = mask.to(p.device).view(-1, *([1] * (p.dim() - 1)))
            m_new, v_new = torch.where(keep, m_new, m), torch.where(keep, v_new, v)
        m.copy_(m_new)
        v.copy_(v_new)
        denom = v.sqrt().add_(self.eps)
        p.add_(
            torch.mul(m, _per_job(c["lorafa_neg_step"], p, cache)).div_(denom)
        )  # as B.addcdiv_(m, denom, value=-step)
        if any(wd > 0 for wd in self.weight_decay):
            p.sub_(p * _per_job(c["lorafa_decay"], p, cache))


class JobSchedules:
    """One transformers learning-rate schedule per job (``get_scheduler(name, ...)`` on a one-parameter optimizer
    holding the job's peak rate): :meth:`lrs` is what the Trainer's scheduler would give each job this step."""

    def __init__(self, peak_lrs, warmup_steps, total_steps: int, name: str = "linear") -> None:
        self._opts = [torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr) for lr in peak_lrs]
        self._scheds = [
            get_scheduler(name, o, num_warmup_steps=w, num_training_steps=total_steps)
            for o, w in zip(self._opts, warmup_steps)
        ]

    def lrs(self) -> list[float]:
        return [s.get_last_lr()[0] for s in self._scheds]

    def step(self) -> None:
        for o, s in zip(self._opts, self._scheds):
            o.step()  # a no-op (no gradient): the schedule's order check wants optimizer.step() first
            s.step()
