"""D-PSGD (Lian et al., NeurIPS 2017, arXiv 1705.09056): every rank takes a local step with its own gradient and
averages its parameters with its neighbours' through the mixing matrix ``W``; no global all-reduce.

Two orders, as in the literature:

* ``mode="atc"`` (adapt then combine, the default): ``x_i <- sum_j W[i, j] (x_j + Δ_j)`` where ``Δ_j`` is rank j's
  local update. With SGD and momentum this is DmSGD; on a uniform complete graph it is exactly all-reduce SGD (the
  average of the local SGD steps is SGD on the averaged gradient).
* ``mode="cta"`` (combine then adapt, Lian et al.'s form): ``x_i <- sum_j W[i, j] x_j + Δ_i``, the gradient taken at
  the rank's own ``x_i`` before mixing.

``asynchronous=True`` is AD-PSGD's asynchronous gossip (:class:`~hf_dtrain.decentralized.gossip.AsyncGossip`): each
rank mixes the newest values its neighbours have sent, waiting only for one older than ``max_staleness`` of its own
steps, so a straggler slows only itself; call ``optimizer.finish()`` on every rank at the end.

Wraps any torch optimizer for the local update (``base_optimizer="sgd"``, ``momentum=0.9``, ...). Under DDP register
DDP's ``noop_hook`` (:meth:`DPSGD.attach_ddp`) so the gradients stay local.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_dtrain.errors import SettingsError

from ..optimizer_wrapper import WrappedOptimizer, build_base_optimizer
from ._base import GossipMixin
from .topology import Topology


class DPSGD(GossipMixin, WrappedOptimizer):
    """``DPSGD(params, topology="ring", base_optimizer="sgd", mode="atc", lr=0.1, momentum=0.9)``; ``stats.steps``
    holds the bytes this rank sends per step, ``consensus_distance()`` how far the replicas are apart."""

    state_key = "dpsgd"

    def __init__(
        self,
        params,
        topology: str | Topology = "ring",
        base_optimizer: str | Callable = "sgd",
        mode: str = "atc",
        process_group=None,
        asynchronous: bool = False,
        max_staleness: int = 4,
        **base_kwargs,
    ):
        if mode not in ("atc", "cta"):
            raise SettingsError(
                f"DPSGD mode must be 'atc' (adapt then combine) or 'cta' (combine then adapt), got {mode!r}."
            )
        self._init_wrapper()
        self.base = build_base_optimizer(base_optimizer, params, "DPSGD", **base_kwargs)
        self.mode = mode
        self._init_gossip(topology, process_group)
        self._init_async(asynchronous, max_staleness)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._closure_loss(closure)
        step = self.gossip_steps
        if self.mode == "cta":
            before = self._flat()
            mixed = self._mix(before, step)
            self.base.step()
            self._set_flat(mixed + (self._flat() - before))
        else:
            self.base.step()
            self._set_flat(self._mix(self._flat(), step))
        self.gossip_steps += 1
        self.stats.end_step()
        return loss
