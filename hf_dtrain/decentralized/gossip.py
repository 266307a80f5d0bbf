"""Neighbour exchange and gossip averaging on torch.distributed (gloo and NCCL), with byte accounting.

One gossip round on rank ``i`` is ``x_i <- sum_j W[i, j] x_j`` with ``W`` the topology's mixing matrix at that step.
Values go to out-neighbours and come from in-neighbours by ``batch_isend_irecv`` (point-to-point, one message per
edge); a uniform complete graph takes the all-reduce fast path (the same result, one collective). Every wait is
bounded by the process group's timeout.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..distributed import WireStats
from .topology import Topology


def _global(rank: int, group) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def require_world(group=None) -> int:
    """The size of ``group``; a clear error unless torch.distributed runs with >= 2 processes."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) < 2:
        raise ValueError("Decentralized training needs torch.distributed initialised with >= 2 processes; world size 1 "
                         "has nobody to gossip with (launch with torchrun --nproc_per_node >= 2 or accelerate launch "
                         "--num_processes >= 2).")
    return dist.get_world_size(group)


def check_world(topology: Topology, group=None) -> int:
    """This rank in ``group``; a clear error unless the topology has one node per rank of the group."""
    world = require_world(group)
    if topology.n != world:
        raise ValueError(f"The topology has {topology.n} nodes but the process group has {world} ranks; build it for "
                         f"the world size, e.g. Topology.ring({world}).")
    return dist.get_rank(group)


def exchange(tensor: torch.Tensor, topology: Topology, step: int = 0, group=None,
             stats: Optional[WireStats] = None) -> dict[int, torch.Tensor]:
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


def gossip(tensor: torch.Tensor, topology: Topology, step: int = 0, group=None,
           stats: Optional[WireStats] = None) -> torch.Tensor:
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
