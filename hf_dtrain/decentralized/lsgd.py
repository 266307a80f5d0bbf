"""LSGD, leader SGD (Teng et al., NeurIPS 2019, arXiv 1905.10395): local SGD where, every few steps, each rank is
pulled toward the rank with the lowest current loss (the leader), within its node (local leader, every
``local_period`` steps, coupling ``c_local``) and across all ranks (global leader, every ``global_period`` steps,
coupling ``c_global``):

    x_i <- (1 - c) x_i + c x_leader

The leader's parameters go out by one broadcast per group (the node's ranks, or all ranks); the losses by one small
all-gather. Defaults are the paper's code: couplings 0.1, periods 256 (their sweeps used 4 to 64). With both
couplings 0 it is independent local SGD on every rank. Under DDP register DDP's ``noop_hook``
(:meth:`LSGD.attach_ddp`). The loss comes from a forward hook on ``model`` (``output.loss``) or from
``optimizer.set_loss(loss)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from hf_dtrain.errors import SettingsError

from ..distributed.collectives import all_gather_single
from ..optimizer_wrapper import WrappedOptimizer, build_base_optimizer
from ._base import GossipMixin
from .topology import Topology


class LSGD(GossipMixin, WrappedOptimizer):
    """``LSGD(params, model=model, base_optimizer="sgd", lr=0.1, momentum=0.9, c_local=0.1, c_global=0.1,
    local_period=16, global_period=64, ranks_per_node=None)`` (``ranks_per_node``: default ``LOCAL_WORLD_SIZE``, so
    one node = one torchrun host)."""

    state_key = "lsgd"

    def __init__(
        self,
        params,
        model: nn.Module | None = None,
        base_optimizer: str | Callable = "sgd",
        c_local: float = 0.1,
        c_global: float = 0.1,
        local_period: int = 256,
        global_period: int = 256,
        ranks_per_node: int | None = None,
        process_group=None,
        **base_kwargs,
    ):
        for name, c in (("c_local", c_local), ("c_global", c_global)):
            if not 0 <= c <= 1:
                raise SettingsError(f"LSGD {name} (the pull toward the leader) must be in [0, 1], got {c!r}.")
        for name, period in (("local_period", local_period), ("global_period", global_period)):
            if not isinstance(period, int) or period < 1:
                raise SettingsError(f"LSGD {name} must be an integer >= 1 (steps between pulls), got {period!r}.")
        self._init_wrapper()
        self.base = build_base_optimizer(base_optimizer, params, "LSGD", **base_kwargs)
        world = dist.get_world_size(process_group) if dist.is_initialized() else 1
        self._init_gossip(Topology.fully_connected(max(world, 2)), process_group, model=model)
        self.c_local, self.c_global = float(c_local), float(c_global)
        self.local_period, self.global_period = local_period, global_period
        per_node = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if per_node < 1 or world % per_node:
            raise SettingsError(f"LSGD ranks_per_node={per_node} must divide the world size {world}.")
        self.ranks_per_node = per_node
        self.node = self.rank // per_node
        self.node_ranks = [list(range(k * per_node, (k + 1) * per_node)) for k in range(world // per_node)]
        # one process group per node for the local leader's broadcast (every rank creates every group, in order)
        self._node_groups = []
        if per_node > 1 and per_node < world:
            for ranks in self.node_ranks:
                glob = [dist.get_global_rank(process_group, r) if process_group else r for r in ranks]
                self._node_groups.append(dist.new_group(glob))
        self.leaders: list[tuple[int, int, str]] = []  # (step, leader rank, "local" | "global")

    def _pull(self, leader: int, ranks: list[int], c: float, group) -> None:
        flat = self._flat()
        src = dist.get_global_rank(self.process_group, leader) if self.process_group else leader
        if self.rank == leader:
            self.stats.add(flat)
        dist.broadcast(flat, src=src, group=group)
        if self.rank != leader and c > 0:
            self._set_flat(torch.lerp(self._flat(), flat, c))

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._closure_loss(closure)
        self.base.step()
        self.gossip_steps += 1
        t = self.gossip_steps
        do_local = t % self.local_period == 0 and self.ranks_per_node > 1
        do_global = t % self.global_period == 0
        if do_local or do_global:
            losses = torch.empty(self.topology.n, dtype=torch.float64)
            mine = torch.tensor([self._current_loss()], dtype=torch.float64)
            self.stats.add(mine)
            all_gather_single(losses, mine, group=self.process_group)
            if do_local:
                ranks = self.node_ranks[self.node]
                leader = min(ranks, key=lambda r: (float(losses[r]), r))
                group = self._node_groups[self.node] if self._node_groups else self.process_group
                self._pull(leader, ranks, self.c_local, group)
                self.leaders.append((t, leader, "local"))
            if do_global:
                leader = min(range(self.topology.n), key=lambda r: (float(losses[r]), r))
                self._pull(leader, list(range(self.topology.n)), self.c_global, self.process_group)
                self.leaders.append((t, leader, "global"))
        self.stats.end_step()
        return loss
