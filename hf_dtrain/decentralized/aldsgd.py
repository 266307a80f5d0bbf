"""AL-DSGD, adjacent-leader decentralized SGD (He, Wang, Choromanska, arXiv 2405.11389), after the authors' code
(``communicator.py::LLDSGDaveraging``): local SGD, then at every step, over a time-varying graph (MATCHA matchings,
budget 0.5 by default), each rank exchanges its parameters, current loss and degree with its active neighbours and

    y = sum_j W[i, j] x_j                                   (gossip over the active edges)
    y <- (1 - c1 - c2) y + c1 x_best + c2 x_maxdeg          (x_best: lowest loss, x_maxdeg: highest degree,
    y <- y - p1 (y - x_best) - p2 (y - x_maxdeg)             among itself and its active neighbours)
    x_i <- y

Defaults are the authors' README: ``c1=0.3, c2=0.1, p1=p2=0.2``. The loss and degree ride at the end of the
parameter message (one message per edge). Under DDP register DDP's ``noop_hook`` (:meth:`ALDSGD.attach_ddp`); the loss
comes from a forward hook on ``model`` or ``optimizer.set_loss(loss)``.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from torch import nn

from ..optim.wrapper import WrappedOptimizer, build_base_optimizer
from ._base import GossipMixin
from .gossip import exchange
from .topology import Topology


class ALDSGD(GossipMixin, WrappedOptimizer):
    """``ALDSGD(params, model=model, topology="matcha", base_optimizer="sgd", lr=0.1, momentum=0.9)``."""

    state_key = "aldsgd"

    def __init__(self, params, model: Optional[nn.Module] = None, topology: Union[str, Topology] = "matcha",
                 base_optimizer: Union[str, Callable] = "sgd", c1: float = 0.3, c2: float = 0.1, p1: float = 0.2,
                 p2: float = 0.2, budget: float = 0.5, seed: int = 0, process_group=None, **base_kwargs):
        if not (0 <= c1 and 0 <= c2 and c1 + c2 <= 1):
            raise ValueError(f"ALDSGD needs c1, c2 >= 0 with c1 + c2 <= 1, got c1={c1!r}, c2={c2!r}.")
        if not (0 <= p1 and 0 <= p2 and p1 + p2 <= 1):
            raise ValueError(f"ALDSGD needs p1, p2 >= 0 with p1 + p2 <= 1, got p1={p1!r}, p2={p2!r}.")
        self._init_wrapper()
        self.base = build_base_optimizer(base_optimizer, params, "ALDSGD", **base_kwargs)
        kwargs = {"budget": budget, "seed": seed} if topology == "matcha" else {}
        self._init_gossip(topology, process_group, model=model, **kwargs)
        self.c1, self.c2, self.p1, self.p2 = c1, c2, p1, p2

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
                self.set_loss(loss)
        self.base.step()
        t, i = self.gossip_steps, self.rank
        w = self.topology.mixing(t)
        degree = self.topology.degree(i, t)
        x = self._flat()
        message = torch.cat([x, torch.tensor([self._current_loss(), float(degree)], dtype=x.dtype)])
        received = exchange(message, self.topology, t, self.process_group, self.stats)
        if received:
            models = {i: x, **{j: m[:-2] for j, m in received.items()}}
            loss_of = {i: self._current_loss(), **{j: float(m[-2]) for j, m in received.items()}}
            degree_of = {i: degree, **{j: int(m[-1]) for j, m in received.items()}}
            y = x * float(w[i, i])
            for j, xj in received.items():
                y.add_(xj[:-2], alpha=float(w[i, j]))
            best = min(models, key=lambda r: (loss_of[r], r))
            maxdeg = min(models, key=lambda r: (-degree_of[r], r))
            y = (1 - self.c1 - self.c2) * y + self.c1 * models[best] + self.c2 * models[maxdeg]
            y = y - self.p1 * (y - models[best]) - self.p2 * (y - models[maxdeg])
            self._set_flat(y)
        self.gossip_steps += 1
        self.stats.end_step()
        return loss

    def _wrapper_state(self) -> dict:
        return {"gossip_steps": self.gossip_steps}

    def _load_wrapper_state(self, state: dict) -> None:
        self.gossip_steps = int(state["gossip_steps"])



