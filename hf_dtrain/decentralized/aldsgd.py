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

from collections.abc import Callable

import torch
from torch import nn

from hf_dtrain.errors import SettingsError

from ..optimizer_wrapper import WrappedOptimizer, build_base_optimizer
from ._base import GossipMixin
from .gossip import exchange
from .topology import Topology


def aldsgd_combine(
    rank: int,
    x: torch.Tensor,
    loss: float,
    degree: int,
    neighbours: dict[int, tuple[torch.Tensor, float, int]],
    w_row: torch.Tensor,
    c1: float,
    c2: float,
    p1: float,
    p2: float,
) -> tuple[torch.Tensor, int, int]:
    """One AL-DSGD combination on rank ``rank``: ``neighbours`` maps each active neighbour to (parameters, loss,
    degree), ``w_row`` is row ``rank`` of the mixing matrix. Returns the new parameters, the lowest-loss rank and the
    highest-degree rank among itself and its neighbours (ties go to the lowest rank)."""
    models = {rank: x, **{j: v[0] for j, v in neighbours.items()}}
    loss_of = {rank: loss, **{j: v[1] for j, v in neighbours.items()}}
    degree_of = {rank: degree, **{j: v[2] for j, v in neighbours.items()}}
    y = x * float(w_row[rank])
    for j, (xj, _, _) in neighbours.items():
        y = y + float(w_row[j]) * xj
    best = min(models, key=lambda r: (loss_of[r], r))
    maxdeg = min(models, key=lambda r: (-degree_of[r], r))
    y = (1 - c1 - c2) * y + c1 * models[best] + c2 * models[maxdeg]
    y = y - p1 * (y - models[best]) - p2 * (y - models[maxdeg])
    return y, best, maxdeg


class ALDSGD(GossipMixin, WrappedOptimizer):
    """``ALDSGD(params, model=model, topology="matcha", base_optimizer="sgd", lr=0.1, momentum=0.9)``."""

    state_key = "aldsgd"

    def __init__(
        self,
        params,
        model: nn.Module | None = None,
        topology: str | Topology = "matcha",
        base_optimizer: str | Callable = "sgd",
        c1: float = 0.3,
        c2: float = 0.1,
        p1: float = 0.2,
        p2: float = 0.2,
        budget: float = 0.5,
        seed: int = 0,
        process_group=None,
        **base_kwargs,
    ):
        if not (c1 >= 0 and c2 >= 0 and c1 + c2 <= 1):
            raise SettingsError(f"ALDSGD needs c1, c2 >= 0 with c1 + c2 <= 1, got c1={c1!r}, c2={c2!r}.")
        if not (p1 >= 0 and p2 >= 0 and p1 + p2 <= 1):
            raise SettingsError(f"ALDSGD needs p1, p2 >= 0 with p1 + p2 <= 1, got p1={p1!r}, p2={p2!r}.")
        self._init_wrapper()
        self.base = build_base_optimizer(base_optimizer, params, "ALDSGD", **base_kwargs)
        kwargs = {"budget": budget, "seed": seed} if topology == "matcha" else {}
        self._init_gossip(topology, process_group, model=model, **kwargs)
        self.c1, self.c2, self.p1, self.p2 = c1, c2, p1, p2
        self.leaders: list[tuple[int, int, int]] = []  # (step, lowest-loss rank, highest-degree rank) seen here

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._closure_loss(closure)
        self.base.step()
        t, i = self.gossip_steps, self.rank
        w = self.topology.mixing(t)
        degree = self.topology.degree(i, t)
        x = self._flat()
        message = torch.cat([x, torch.tensor([self._current_loss(), float(degree)], dtype=x.dtype)])
        received = exchange(message, self.topology, t, self.process_group, self.stats)
        if received:
            neighbours = {j: (m[:-2], float(m[-2]), int(m[-1])) for j, m in received.items()}
            y, best, maxdeg = aldsgd_combine(
                i, x, self._current_loss(), degree, neighbours, w[i], self.c1, self.c2, self.p1, self.p2
            )
            self._set_flat(y)
            self.leaders.append((t, best, maxdeg))
        self.gossip_steps += 1
        self.stats.end_step()
        return loss
