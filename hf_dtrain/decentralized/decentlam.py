"""DecentLaM (Yuan et al., ICCV 2021, arXiv 2104.11981): decentralized large-batch momentum SGD without the bias that
momentum adds to DmSGD on heterogeneous data.

DmSGD (D-PSGD with a local momentum) is ``m_i <- β m_i + g_i; x_i <- sum_j W[i, j] (x_j - γ m_j)``: the momentum
amplifies the inconsistency between ranks, and with heterogeneous data its fixed point moves away from the optimum
by a bias that grows with ``1 / (1 - β)``. DecentLaM puts the momentum on the combined direction instead:

    z_i = x_i - γ g_i                          (a local gradient step)
    g̃_i = (x_i - sum_j W[i, j] z_j) / γ       (= the neighbours' average gradient + the consensus term / γ)
    m_i <- β m_i + g̃_i
    x_i <- x_i - γ m_i

One model-sized exchange per step (``z``), like D-PSGD. ``asynchronous=True`` mixes the newest ``z_j`` that have
arrived (AD-PSGD-style, values at most ``max_staleness`` of this rank's steps old; ``optimizer.finish()`` at the end).
**Warning, measured** (``benchmarks/async_gossip.py``): asynchronous DecentLaM diverged in every seed on 4 hosts with a
3x straggler. ``g̃`` divides the gap between ``x_i`` and the neighbours' (stale) ``z_j`` by ``γ``; with stale values
that gap holds several steps of progress, and the momentum accumulates it. Prefer asynchronous D-PSGD.
``weight_decay`` is added to ``g`` (L2). Under DDP register DDP's ``noop_hook`` (:meth:`DecentLaM.attach_ddp`).
"""

from __future__ import annotations

import torch
from torch._utils import _flatten_dense_tensors

from hf_dtrain.errors import SettingsError

from ._base import GossipMixin
from .topology import Topology


class DecentLaM(GossipMixin, torch.optim.Optimizer):
    """``DecentLaM(params, lr, momentum=0.9, weight_decay=0.0, topology="ring")``."""

    def __init__(
        self,
        params,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        topology: str | Topology = "ring",
        process_group=None,
        asynchronous: bool = False,
        max_staleness: int = 4,
    ):
        if not lr > 0:
            raise SettingsError(f"DecentLaM lr must be > 0, got {lr!r}.")
        if not 0 <= momentum < 1:
            raise SettingsError(f"DecentLaM momentum must be in [0, 1), got {momentum!r}.")
        if not weight_decay >= 0:
            raise SettingsError(f"DecentLaM weight_decay must be >= 0, got {weight_decay!r}.")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self._init_gossip(topology, process_group)
        self._init_async(asynchronous, max_staleness)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._closure_loss(closure)
        params, hyper = [], []
        z_parts = []
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                if group["weight_decay"]:
                    g = g.add(p, alpha=group["weight_decay"])
                params.append(p)
                hyper.append((group["lr"], group["momentum"]))
                z_parts.append(p - group["lr"] * g)
        z_mixed = self._mix(_flatten_dense_tensors(z_parts), self.gossip_steps)
        offset = 0
        for p, (lr, momentum) in zip(params, hyper):
            zm = z_mixed[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            g_tilde = (p - zm) / lr
            st = self.state[p]
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.zeros_like(p)
            buf = st["momentum_buffer"].mul_(momentum).add_(g_tilde)
            p.add_(buf, alpha=-lr)
        self.gossip_steps += 1
        self.stats.end_step()
        return loss

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["decentlam"] = {"gossip_steps": self.gossip_steps}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        own = state_dict.pop("decentlam", None)
        super().load_state_dict(state_dict)
        if own is not None:
            self.gossip_steps = int(own["gossip_steps"])
