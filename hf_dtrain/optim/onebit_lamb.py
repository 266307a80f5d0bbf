"""1-bit LAMB: large-batch LAMB with 1-bit compressed momentum exchange and error feedback.

Li et al., arXiv 2104.06069; the algorithm of DeepSpeed's implementation (``runtime/fp16/onebit/lamb.py``, removed in
2026 and CUDA-only before), re-done on ``torch.distributed`` so it runs on gloo and NCCL:

1. **Warm-up** (``step <= freeze_step``): LAMB on gradients all-reduced by this optimizer; the layer-wise trust ratio
   ``coeff = clip(‖p‖ / ‖update‖, min_coeff, max_coeff)`` is tracked as an EMA (``coeff_beta``).
2. **Compression stage**: the variance ``v`` is frozen; each rank updates its momentum with its *local* gradient,
   scales it per tensor (``scaling_coeff``, fixed at the first compressed step), and the momenta are averaged by a
   1-bit all-reduce with error feedback:

   - worker: ``x += e_w``; ``x`` is cut into N chunks (chunk k belongs to rank k) and each chunk into blocks of
     ``scale_block`` elements (2048; None: the whole chunk); ``s_w`` = each block's RMS; ``e_w = x - s_w sign(x)``;
     signs packed 8 per byte, chunk k of the signs and its scales go to rank k (``all_to_all``);
   - server (rank k, chunk k): ``y = mean_i(s_w,i sign_i) + e_s``; ``s_s`` = per-block RMS of ``y``;
     ``e_s = y - s_s sign(y)``; signs and scales ``all_gather``-ed back: ``m = concat_k(s_s,k sign_k)``.

   DeepSpeed used one worker scale for the whole buffer; a scale per chunk (or per block) keeps the sign messages
   and costs 4 bytes per block.

   The update is ``m / (sqrt(v) + eps) (+ wd p)`` times the frozen trust ratio, corrected by how far a fresh
   variance estimate drifted (``factor``, clamped to ``[factor_min, factor_max]`` and to ``±factor_threshold`` of the
   previous factor).

Wire bytes per compressed step and rank: ``n / 8`` (phase 1) ``+ n / (8 N)`` (phase 2) plus 4-byte scales
(:func:`onebit_lamb_step_bytes`), against
``4 n`` for an fp32 all-reduce; the packed messages are 1/32 of the fp32 payload.

Gradients must reach the optimizer **un-averaged**: under DDP register ``noop_hook`` (:meth:`OneBitLamb.attach_ddp`),
with DeepSpeed turn the engine's all-reduce off (``engine.enable_backward_allreduce = False``).
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.distributed as dist

from hf_dtrain.errors import SettingsError
from hf_dtrain.settings import config_from

from ..distributed.collectives import check_same_across_ranks, onebit_allreduce, world_size_of
from ..distributed.counters import WireStats
from ..distributed.engines import WholeReplicaGuard, keep_gradients_local
from ..optimizer_wrapper import closure_loss
from .config import OneBitLambConfig, config_kwargs


class OneBitLamb(torch.optim.Optimizer):
    """1-bit LAMB over ``torch.distributed`` (defaults: DeepSpeed's, with a shorter ``freeze_step``)."""

    exchanges_gradients_itself = True  # DDP must not average (noop hook), and a Trainer must not clip local grads

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        freeze_step: int = 100,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        mask_threshold: float = 1e-4,
        scale_block: int | None = 2048,
        process_group=None,
    ):
        if not lr > 0:
            raise SettingsError(f"OneBitLamb lr must be > 0, got {lr!r}.")
        self.config = config_from(OneBitLambConfig, locals())
        self.world = world_size_of(process_group)
        if self.world < 2:
            raise SettingsError(
                "OneBitLamb compresses the gradient exchange between processes and needs a world of >= 2 "
                "(launch with accelerate launch / torchrun / deepspeed); for one process use LAMB."
            )
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_coeff=max_coeff, min_coeff=min_coeff
        )
        super().__init__(params, defaults)
        self._replica_guard = WholeReplicaGuard(self, "OneBitLamb")
        self.freeze_step, self.coeff_beta = freeze_step, coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        self.mask_threshold = mask_threshold
        self.scale_block = scale_block
        self.process_group = process_group
        self.stats = WireStats()
        params = self._params()

        shapes = hashlib.sha256(str([tuple(p.shape) for p in params]).encode()).hexdigest()[:16]
        values = hashlib.sha256(str([round(float(p.detach().double().sum()), 6) for p in params]).encode()).hexdigest()
        check_same_across_ranks(
            {"tensors": len(params), "shapes_sha256": shapes, "values_sha256": values[:16]},
            "OneBitLamb parameters (shapes and values; load or seed the model identically on every rank)",
            process_group,
        )
        n = sum(p.numel() for p in params)
        self.numel = n
        self.padded = math.ceil(n / (8 * self.world)) * 8 * self.world
        self.global_state = {
            "step": 0,
            "worker_error": torch.zeros(self.padded),
            "server_error": torch.zeros(self.padded // self.world),
        }

    @classmethod
    def from_config(
        cls, params, config: OneBitLambConfig, lr: float = 1e-3, weight_decay: float = 0.0, process_group=None
    ) -> OneBitLamb:
        """``OneBitLamb`` with every setting from ``config`` (what the jobs pass down)."""
        return cls(params, lr=lr, weight_decay=weight_decay, process_group=process_group, **config_kwargs(config))

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    # -- DDP / DeepSpeed ---------------------------------------------------------------------------------------------
    @staticmethod
    def attach_ddp(ddp_model) -> None:
        """Keep DDP from averaging the gradients (this optimizer exchanges them itself): DDP's ``noop_hook``, as
        ``hf_dtrain.comm.register(ddp_model, "noop")``; with the Trainer, ``CommHookCallback.attach(trainer,
        "noop")``."""
        keep_gradients_local(ddp_model)

    # -- the 1-bit all-reduce ----------------------------------------------------------------------------------------
    def compressed_allreduce(self, x: torch.Tensor) -> torch.Tensor:
        """Average ``x`` (padded, flat fp32) over ranks with 1-bit messages and worker/server error feedback."""
        return onebit_allreduce(x, self.global_state, self.process_group, self.scale_block, self.stats)

    # -- the step ----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        self._replica_guard.check_step(self)
        gs = self.global_state
        gs["step"] += 1
        step = gs["step"]
        params = [p for p in self._params() if p.grad is not None]
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        for p in params:
            st = self.state[p]
            if not st:
                st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                st["lamb_coeff_freeze"] = torch.tensor(0.0)
                st["last_factor"] = torch.tensor(1.0)
        if step <= self.freeze_step:
            flat = torch.cat([p.grad.float().reshape(-1) for p in params])
            self.stats.add(flat)
            dist.all_reduce(flat, group=self.process_group)
            flat /= self.world
            offset = 0
            for p in params:
                g = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                group = group_of[id(p)]
                st = self.state[p]
                b1, b2 = group["betas"]
                st["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                update = st["exp_avg"] / (st["exp_avg_sq"].sqrt() + group["eps"])
                if group["weight_decay"]:
                    update = update + group["weight_decay"] * p.float()
                w_norm, u_norm = float(p.float().norm()), float(update.norm())
                coeff = 1.0 if w_norm == 0 or u_norm == 0 else w_norm / u_norm
                coeff = min(max(coeff, group["min_coeff"]), group["max_coeff"])
                if step > 1:
                    st["lamb_coeff_freeze"].mul_(self.coeff_beta).add_(coeff * (1 - self.coeff_beta))
                else:
                    st["lamb_coeff_freeze"].fill_(coeff)
                p.add_((-group["lr"] * coeff * update).to(p.dtype))
            self.stats.end_step()
            return loss
        # compression stage
        if step == self.freeze_step + 1:  # fix the per-tensor scaling of the momenta, keep a fresh variance
            norms = [float(self.state[p]["exp_avg"].norm()) / math.sqrt(p.numel()) for p in params]
            united = sum(norms) / len(norms)
            for p, nrm in zip(params, norms):
                st = self.state[p]
                st["scaling_coeff"] = torch.tensor(united / nrm if nrm > 0 else 1.0)
                st["exp_avg_sq_fresh"] = st["exp_avg_sq"].clone()
                # a 1-bit momentum gives every element +-scale; over the frozen sqrt(v) of an element that (almost)
                # never had a gradient in the warm-up (embedding rows of unseen tokens, output rows of tokens never
                # predicted) that blows up. DeepSpeed asked users for an exp_avg_mask; here the mask is the elements
                # whose frozen variance is above mask_threshold x the tensor's mean variance (0: exact zeros only).
                v = st["exp_avg_sq"]
                st["exp_avg_mask"] = (v > self.mask_threshold * v.mean()).to(st["exp_avg"].dtype)
        previous = []
        pieces = []
        for p in params:
            st = self.state[p]
            b1 = group_of[id(p)]["betas"][0]
            previous.append(st["exp_avg"].clone())
            st["exp_avg"].mul_(b1).add_(p.grad.float(), alpha=1 - b1)
            pieces.append((st["exp_avg"] * st["scaling_coeff"]).reshape(-1))
        flat = torch.zeros(self.padded)
        flat[: self.numel] = torch.cat(pieces)
        averaged = self.compressed_allreduce(flat)
        offset = 0
        for p, prev in zip(params, previous):
            st = self.state[p]
            group = group_of[id(p)]
            b1, b2 = group["betas"]
            m = averaged[offset : offset + p.numel()].view_as(p) / st["scaling_coeff"] * st["exp_avg_mask"]
            offset += p.numel()
            st["exp_avg"].copy_(m)
            grad_est = (m - b1 * prev) / (1 - b1)
            st["exp_avg_sq_fresh"].mul_(b2).addcmul_(grad_est, grad_est, value=1 - b2)
            denom = st["exp_avg_sq"].sqrt() + group["eps"]
            update_prelim = m / denom
            update = update_prelim + group["weight_decay"] * p.float() if group["weight_decay"] else update_prelim
            factor = float(
                ((st["exp_avg_sq"].sqrt() + group["eps"]) / (st["exp_avg_sq_fresh"].sqrt() + group["eps"])).max()
            )
            if group["weight_decay"]:
                ratio = min(1.0, float(update_prelim.norm()) / max(float(update.norm()), 1e-30))
                factor = factor * ratio + (1.0 - ratio)
            factor = min(max(factor, self.factor_min), self.factor_max)
            last = float(st["last_factor"])
            factor = min(max(factor, last * (1 - self.factor_threshold)), last * (1 + self.factor_threshold))
            st["last_factor"].fill_(factor)
            coeff = float(st["lamb_coeff_freeze"]) * factor
            p.add_((-group["lr"] * coeff * update).to(p.dtype))
        self.stats.end_step()
        return loss

    # -- checkpoints: the error-feedback buffers and the step travel with the optimizer state ------------------------
    # The moments, trust ratios and masks are the same on every rank; the two error-feedback buffers are not (each
    # rank's compression error). The Trainer, Accelerate and DeepSpeed (stage 0) write the optimizer state of rank 0
    # only, so, as torch's ZeroRedundancyOptimizer, ``consolidate_state_dict(to=0)`` (a collective, on every rank)
    # gathers every rank's buffers onto rank ``to`` first; its next ``state_dict()`` then carries all of them and each
    # rank restores its own. ``CommHookCallback`` calls it before every Trainer save.
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's error-feedback buffers onto rank ``to`` (call on every rank before saving there)."""
        gs = self.global_state
        local = torch.cat([gs["worker_error"], gs["server_error"]])
        me = dist.get_rank(self.process_group)
        gathered = [torch.empty_like(local) for _ in range(self.world)] if me == to else None
        dist.gather(
            local,
            gathered,
            dst=dist.get_global_rank(self.process_group, to) if self.process_group else to,
            group=self.process_group,
        )
        if me == to:
            stacked = torch.stack(gathered)
            self._consolidated = {
                "step": gs["step"],
                "worker_error": stacked[:, : self.padded].clone(),
                "server_error": stacked[:, self.padded :].clone(),
            }

    def state_dict(self) -> dict:
        sd = super().state_dict()
        gs = self.global_state
        onebit = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in gs.items()}
        onebit["rank"], onebit["world"] = dist.get_rank(self.process_group), self.world
        consolidated = getattr(self, "_consolidated", None)
        if consolidated is not None and consolidated["step"] == gs["step"]:
            onebit["per_rank"] = {
                "worker_error": consolidated["worker_error"],
                "server_error": consolidated["server_error"],
            }
        sd["onebit"] = onebit
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        onebit = state_dict.pop("onebit", None)
        super().load_state_dict(state_dict)
        if onebit is None:
            return
        onebit = dict(onebit)
        per_rank = onebit.pop("per_rank", None)
        saved_rank, saved_world = onebit.pop("rank", None), onebit.pop("world", self.world)
        me = dist.get_rank(self.process_group)
        if saved_world != self.world:
            raise SettingsError(
                f"This OneBitLamb state was saved with {saved_world} ranks and is loaded on {self.world}; "
                "the compressed chunks (and their error feedback) depend on the world size: resume "
                f"with {saved_world} processes."
            )
        if per_rank is not None:
            onebit["worker_error"] = per_rank["worker_error"][me]
            onebit["server_error"] = per_rank["server_error"][me]
        elif saved_rank is not None and saved_rank != me and onebit["step"] > self.freeze_step:
            import warnings

            warnings.warn(
                f"OneBitLamb: rank {me} loads the state saved by rank {saved_rank}, without its own "
                "error-feedback buffers; they restart at zero, so the resume is close but not exact. Call "
                "optimizer.consolidate_state_dict() on every rank before saving (CommHookCallback does it "
                "for the Trainer), or save each rank's state_dict().",
                stacklevel=2,
            )
            onebit["worker_error"] = torch.zeros_like(self.global_state["worker_error"])
            onebit["server_error"] = torch.zeros_like(self.global_state["server_error"])
        self.global_state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in onebit.items()}


def onebit_lamb_step_bytes(numel: int, world: int, scale_block: int | None = 2048) -> int:
    """Bytes per compressed step and rank: packed signs of both phases plus the 4-byte scales (phase 1: one per
    block of every rank's chunk, phase 2: one per block of the own chunk)."""
    padded = math.ceil(numel / (8 * world)) * 8 * world
    chunk = padded // world
    blocks = -(-chunk // min(scale_block or chunk, chunk))
    return padded // 8 + 4 * world * blocks + chunk // 8 + 4 * blocks
