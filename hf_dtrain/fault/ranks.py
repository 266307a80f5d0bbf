"""Where this rank stands among the job's, for the snapshots: its rank, the world, its node and the node's ranks, the
erasure groups of nodes, and the small gloo collectives every decision is agreed by (so no rank is left waiting in a
collective: a failure anywhere is a vote everywhere)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from hf_dtrain.errors import SettingsError

from .erasure import node_groups


def node_info(rank: int, world: int) -> tuple[int, int, list[int]]:
    """(node id, number of nodes, local ranks): ``HF_DTRAIN_NODE_RANK`` or torchrun's ``GROUP_RANK``, else
    consecutive ranks by ``LOCAL_WORLD_SIZE``."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if world % local:
        raise SettingsError(f"LOCAL_WORLD_SIZE={local} does not divide the world size {world}")
    node = int(os.environ.get("HF_DTRAIN_NODE_RANK", os.environ.get("GROUP_RANK", rank // local)))
    return node, world // local, [node * local + i for i in range(local)]


class Ranks:
    """This rank in ``process_group`` (the default group when None; one process when torch.distributed is not
    initialised), its node, and the erasure groups (``parity`` parity nodes per group of ``group_size`` nodes; no
    parity on one node). The engine's own collectives run on :attr:`group`: gloo, a group of its own when the job's
    carries no CPU tensors (NCCL alone, as Accelerate sets it up on GPUs)."""

    def __init__(self, process_group, timeout: float, parity: int = 0, group_size: int | None = None):
        self.process_group = process_group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.world = dist.get_world_size(process_group) if self.distributed else 1
        self.group = self.control_group(process_group, timeout) if self.distributed else process_group
        self.node, self.num_nodes, self.local_ranks = node_info(self.rank, self.world)
        group_size = group_size or self.num_nodes
        if parity and self.num_nodes > 1:
            if parity >= group_size:
                raise SettingsError(
                    f"parity={parity} needs erasure groups of more than {parity} nodes; group_size is {group_size} "
                    f"({self.num_nodes} nodes). Lower parity or use more nodes."
                )
            self.groups = node_groups(self.num_nodes, group_size)
        else:
            parity, self.groups = 0, [[n] for n in range(self.num_nodes)]
        self.parity = parity
        self.node_group = next(g for g in self.groups if self.node in g)

    @property
    def first_on_node(self) -> bool:
        return self.rank == self.local_ranks[0]

    @staticmethod
    def gloo_group(process_group, timeout: float):
        """A new gloo group of ``process_group``'s ranks (every rank builds the engine, so every rank joins it)."""
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        return dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout))

    @classmethod
    def control_group(cls, process_group, timeout: float):
        """``process_group`` when it carries CPU tensors (gloo, or a ``cpu:gloo`` part), else a gloo group of the
        same ranks."""
        if "gloo" in str(dist.get_backend(process_group)):
            return process_group
        return cls.gloo_group(process_group, timeout)

    def agree(self, steps: list[int]) -> list[int]:
        """The steps every rank has, newest first."""
        if not self.distributed:
            return sorted(steps, reverse=True)
        buf = torch.full((64,), -1, dtype=torch.int64)
        mine = sorted(steps)[-64:]
        buf[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
        out = [torch.zeros_like(buf) for _ in range(self.world)]
        dist.all_gather(out, buf, group=self.group)
        common = {int(s) for s in out[0].tolist() if s >= 0}
        for t in out[1:]:
            common &= {int(s) for s in t.tolist() if s >= 0}
        return sorted(common, reverse=True)

    def vote(self, flag: bool, every: bool) -> bool:
        """``flag`` on every rank (``every``) or on any rank: one all-reduce of 0/1 (MIN or MAX)."""
        if not self.distributed:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN if every else dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def all(self, flag: bool) -> bool:
        return self.vote(flag, every=True)

    def any(self, flag: bool) -> bool:
        return self.vote(flag, every=False)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def gather_bytes(self, data: bytes, size: int = 256) -> list[bytes]:
        """Every rank's ``data`` (at most ``size`` bytes), in rank order."""
        if not self.distributed:
            return [data]
        buf = torch.zeros(size, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.zeros_like(buf) for _ in range(self.world)]
        dist.all_gather(out, buf, group=self.group)
        return [bytes(t.tolist()).rstrip(b"\0") for t in out]

    def broadcast_bytes(self, data: bytes | None, size: int) -> bytes:
        """Rank 0's ``data`` (``size`` bytes) on every rank."""
        if not self.distributed:
            return data
        t = torch.zeros(size, dtype=torch.uint8)
        if data is not None:
            t.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        dist.broadcast(t, src=0, group=self.group)
        return bytes(t.tolist())
