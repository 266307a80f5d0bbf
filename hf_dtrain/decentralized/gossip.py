"""Neighbour exchange and gossip averaging on torch.distributed (gloo and NCCL), with byte accounting.

One gossip round on rank ``i`` is ``x_i <- sum_j W[i, j] x_j`` with ``W`` the topology's mixing matrix at that step.
Values go to out-neighbours and come from in-neighbours by ``batch_isend_irecv`` (point-to-point, one message per
edge); a uniform complete graph takes the all-reduce fast path (the same result, one collective). Every wait is
bounded by the process group's timeout.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from hf_dtrain.distributed.groups import CommFailure
from hf_dtrain.errors import SettingsError

from ..distributed.counters import WireStats
from .topology import Topology


def _global(rank: int, group) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def require_world(group=None) -> int:
    """The size of ``group``; a clear error unless torch.distributed runs with >= 2 processes."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) < 2:
        raise SettingsError(
            "Decentralized training needs torch.distributed initialised with >= 2 processes; world size 1 "
            "has nobody to gossip with (launch with torchrun --nproc_per_node >= 2 or accelerate launch "
            "--num_processes >= 2)."
        )
    return dist.get_world_size(group)


def check_world(topology: Topology, group=None) -> int:
    """This rank in ``group``; a clear error unless the topology has one node per rank of the group."""
    world = require_world(group)
    if topology.n != world:
        raise SettingsError(
            f"The topology has {topology.n} nodes but the process group has {world} ranks; build it for "
            f"the world size, e.g. Topology.ring({world})."
        )
    return dist.get_rank(group)


def exchange(
    tensor: torch.Tensor, topology: Topology, step: int = 0, group=None, stats: WireStats | None = None
) -> dict[int, torch.Tensor]:
    """Send ``tensor`` to this rank's out-neighbours at ``step`` and return ``{j: x_j}`` from its in-neighbours."""
    rank = dist.get_rank(group)
    ops, received = [], {}
    for j in topology.out_neighbors(rank, step):
        ops.append(dist.P2POp(dist.isend, tensor, _global(j, group), group))
        if stats is not None:
            stats.add(tensor)
    for j in topology.in_neighbors(rank, step):
        received[j] = torch.empty_like(tensor)
        ops.append(dist.P2POp(dist.irecv, received[j], _global(j, group), group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return received


def gossip(
    tensor: torch.Tensor, topology: Topology, step: int = 0, group=None, stats: WireStats | None = None
) -> torch.Tensor:
    """``sum_j W[i, j] x_j`` on rank ``i`` (a new tensor; ``tensor`` is left as it is)."""
    if topology.is_uniform_complete(step):
        out = tensor.clone()
        if stats is not None:
            stats.add(out)
        dist.all_reduce(out, group=group)
        return out.div_(topology.n)
    rank = dist.get_rank(group)
    w = topology.mixing(step)
    received = exchange(tensor, topology, step, group, stats)
    out = tensor * float(w[rank, rank])
    for j, x in received.items():
        out.add_(x, alpha=float(w[rank, j]))
    return out


def flatten(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """One contiguous copy of ``params`` (one message per neighbour instead of one per tensor)."""
    return _flatten_dense_tensors([p.detach() for p in params])


def unflatten_into(flat: torch.Tensor, params: list[torch.Tensor]) -> None:
    """Copy ``flat`` back into ``params`` in place (parameter objects and storages stay the same, as DDP needs)."""
    with torch.no_grad():
        for p, chunk in zip(params, _unflatten_dense_tensors(flat, params)):
            p.copy_(chunk)


@torch.no_grad()
def consensus_distance(params: Iterable[torch.Tensor], group=None) -> float:
    """``sqrt(mean_i ||x_i - x̄||²)`` over the ranks: how far the replicas are from their average (two all-reduces
    of the model size; for logging every so often, not every step)."""
    params = list(params)
    flat = flatten(params).double()
    world = dist.get_world_size(group)
    mean = flat.clone()
    dist.all_reduce(mean, group=group)
    mean /= world
    sq = (flat - mean).pow(2).sum().reshape(1)
    dist.all_reduce(sq, group=group)
    return math.sqrt(float(sq) / world)


class AsyncGossip:
    """Asynchronous gossip in the style of AD-PSGD (Lian et al., ICML 2018, arXiv 1710.06952): a rank never waits
    for a round. At each :meth:`mix` it

    1. hands its current vector to one sender thread per out-neighbour (a value not yet sent is replaced by the newer
       one: a slow receiver sets the pace of its own inbox only);
    2. reads the newest value each in-neighbour's receiver thread has taken in;
    3. **bounded staleness**: waits only for a neighbour whose newest value arrived more than ``max_staleness`` of
       this rank's own steps ago (so a fast rank runs ahead of a straggler, but never mixes a value older than that;
       a neighbour that died ends the wait after ``timeout_s`` with an error naming it);
    4. returns ``W[i, i] x_i + sum_j W[i, j] x_j`` over the newest values.

    The messages travel on threads because gloo's point-to-point work reports completion only once waited on (it
    cannot be polled). Messages carry the sender's step and a "done" flag; :meth:`close` (every rank, at the end of
    training) sends "done" and waits for the neighbours' own, so no message is left hanging. Static topologies only.
    The exchange runs on its own process group, so collectives on the default group (DDP, logging) do not interleave
    with it; DDP must not broadcast buffers every forward (``DDP(model, broadcast_buffers=False)``), or every forward
    is a synchronisation point again.
    """

    def __init__(
        self,
        numel: int,
        topology: Topology,
        group=None,
        max_staleness: int = 4,
        stats: WireStats | None = None,
        dtype: torch.dtype = torch.float32,
        timeout_s: float = 600.0,
    ):
        if not isinstance(max_staleness, int) or max_staleness < 1:
            raise SettingsError(
                f"max_staleness must be an integer >= 1 (steps of this rank a neighbour's value may "
                f"be old), got {max_staleness!r}."
            )
        if type(topology).mixing is not Topology.mixing:
            raise SettingsError(
                f"asynchronous gossip needs a static topology (ring, torus, exponential, "
                f"fully_connected); {topology.name!r} changes with the step."
            )
        ranks = list(range(dist.get_world_size(group)))
        self.group = dist.new_group([_global(r, group) for r in ranks])  # every rank, in order: its own channel
        self.rank = dist.get_rank(group)
        self.topology, self.max_staleness, self.stats, self.timeout_s = topology, max_staleness, stats, timeout_s
        self.weights = topology.mixing(0)
        self.ins = topology.in_neighbors(self.rank)
        self.outs = topology.out_neighbors(self.rank)
        self.numel, self.dtype = numel, dtype
        self._peer = {j: _global(j, group) for j in set(self.ins) | set(self.outs)}
        self._cond = threading.Condition()
        self.latest: dict[int, torch.Tensor | None] = dict.fromkeys(self.ins)
        self.their_step = dict.fromkeys(self.ins, -1)
        self.fresh_at = dict.fromkeys(self.ins, 0)  # this rank's step when j's newest value arrived
        self.done = dict.fromkeys(self.ins, False)
        self._outbox: dict[int, tuple | None] = dict.fromkeys(self.outs)  # (step, value, done) not yet sent
        self._errors: list[BaseException] = []
        self.step = 0
        self.waits = 0  # staleness waits (the bound at work)
        self.max_seen_staleness = 0  # the oldest value mixed, in this rank's steps
        self.replaced_sends = 0  # values replaced by a newer one before their neighbour took them
        self.closed = False
        self._threads = [
            threading.Thread(target=self._receive, args=(j,), daemon=True, name=f"gossip-recv-{j}") for j in self.ins
        ]
        self._threads += [
            threading.Thread(target=self._send_loop, args=(j,), daemon=True, name=f"gossip-send-{j}") for j in self.outs
        ]
        for t in self._threads:
            t.start()

    # ---- the threads: one blocking receive loop per in-neighbour, one send loop per out-neighbour
    def _receive(self, j: int) -> None:
        buf = torch.empty(self.numel + 2, dtype=self.dtype)
        try:
            while True:
                dist.recv(buf, src=self._peer[j], group=self.group)
                with self._cond:
                    if buf[-1] > 0:
                        self.done[j] = True
                    else:
                        self.latest[j] = buf[:-2].clone()
                        self.their_step[j] = int(buf[-2])
                        self.fresh_at[j] = self.step
                    self._cond.notify_all()
                if buf[-1] > 0:
                    return
        except BaseException as e:
            with self._cond:
                self._errors.append(e)
                self._cond.notify_all()

    def _send_loop(self, j: int) -> None:
        buf = torch.empty(self.numel + 2, dtype=self.dtype)
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._outbox[j] is not None)
                    step, value, done = self._outbox[j]
                    self._outbox[j] = None
                buf[:-2].copy_(value)
                buf[-2] = step
                buf[-1] = 1.0 if done else 0.0
                dist.send(buf, dst=self._peer[j], group=self.group)
                if done:
                    return
        except BaseException as e:
            with self._cond:
                self._errors.append(e)
                self._cond.notify_all()

    def _check_errors(self) -> None:
        if self._errors:
            raise CommFailure(
                f"asynchronous gossip on rank {self.rank}: a neighbour's exchange failed (did a rank "
                f"die?): {self._errors[0]}"
            ) from self._errors[0]

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        """One asynchronous gossip step on flat ``x``; returns the mixed vector (``x`` is left as it is)."""
        if self.closed:
            raise RuntimeError("AsyncGossip.mix() after close().")
        value = x.detach().clone()
        with self._cond:
            self.step += 1
            for j in self.outs:
                if self._outbox[j] is not None:
                    self.replaced_sends += 1
                elif self.stats is not None:
                    self.stats.add(x)
                self._outbox[j] = (self.step, value, False)
            self._cond.notify_all()

            def fresh(j):
                return self.done[j] or (
                    self.latest[j] is not None and self.step - self.fresh_at[j] <= self.max_staleness
                )

            for j in self.ins:  # the bound: wait for a value at most max_staleness of this rank's steps old
                if not fresh(j):
                    self.waits += 1
                    if not self._cond.wait_for(lambda: fresh(j) or bool(self._errors), timeout=self.timeout_s):
                        raise CommFailure(
                            f"asynchronous gossip on rank {self.rank}: no value from rank {j} for "
                            f"{self.timeout_s:.0f} s (max_staleness={self.max_staleness}); did it "
                            "die or stop without finish()?"
                        )
                    self._check_errors()
            latest = dict(self.latest)
            for j in self.ins:
                if latest[j] is not None and not self.done[j]:  # a finished neighbour keeps its last value
                    self.max_seen_staleness = max(self.max_seen_staleness, self.step - self.fresh_at[j])
        out = x * float(self.weights[self.rank, self.rank])
        for j in self.ins:
            out.add_(latest[j] if latest[j] is not None else x, alpha=float(self.weights[self.rank, j]))
        return out

    def close(self) -> None:
        """Tell the out-neighbours this rank is done and wait for the in-neighbours' own "done" (every rank, once, at
        the end of training; it returns when the slowest neighbour has finished too)."""
        if self.closed:
            return
        self.closed = True
        with self._cond:
            for j in self.outs:  # a pending value is still sent first only if it is newer than nothing: replace it
                self._outbox[j] = (self.step, torch.zeros(self.numel, dtype=self.dtype), True)
            self._cond.notify_all()
        for t in self._threads:
            t.join(self.timeout_s)
            if t.is_alive():
                raise CommFailure(
                    f"asynchronous gossip on rank {self.rank}: {t.name} did not finish within "
                    f"{self.timeout_s:.0f} s (a neighbour did not call finish()?)."
                )
        self._check_errors()
