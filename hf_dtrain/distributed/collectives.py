"""Collectives and codecs: the single-tensor all-gather / reduce-scatter under their current and old torch names,
a check that every rank agrees before a method's first collective (a mismatch is a clear error, not a hang), and
the compressed all-reduces (1-bit signs with block scales, int8) with their bit packing."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist

from hf_dtrain.errors import SettingsError

from .counters import WireStats


def world_size_of(process_group=None) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(process_group)


def check_same_across_ranks(value: Any, what: str, process_group=None) -> None:
    """Raise a ``ValueError`` on every rank unless ``value`` (JSON-serialisable) is the same on all ranks. Uses one
    small all-gather, bounded by the process group's timeout."""
    if world_size_of(process_group) == 1:
        return
    digest = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
    gathered: list = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, (digest, value), group=process_group)
    if len({d for d, _ in gathered}) > 1:
        per_rank = {r: v for r, (_, v) in enumerate(gathered)}
        raise SettingsError(
            f"{what} differs across ranks: {per_rank}. Give every rank the same {what} (the same recipe "
            "or config file on every host)."
        )


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """``all_gather_single`` (torch >= 2.13), else ``all_gather_into_tensor`` (its old name, deprecated in 2.13)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """``reduce_scatter_single`` (torch >= 2.13), else ``reduce_scatter_tensor`` (its old name)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)


# bit i of a byte holds position i (little-endian bit order)
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A boolean vector as uint8, 8 positions per byte (little-endian bit order, zero-padded): the bitmaps of the
    S2 Reducer and the signs of 1-bit LAMB."""
    n = mask.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask.reshape(-1)
    return (padded.view(-1, 8) * _BIT_WEIGHTS.to(mask.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` positions as a boolean vector."""
    bits = packed.unsqueeze(1).bitwise_and(_BIT_WEIGHTS.to(packed.device)).ne(0)
    return bits.reshape(-1)[:n]


def _sign(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)  # sign(0) = +1, as DeepSpeed


def _scale_blocks(chunk: int, scale_block: int | None) -> tuple[int, int]:
    """(block length, blocks per chunk) of the per-block scales of the 1-bit all-reduce."""
    block = min(scale_block or chunk, chunk)
    return block, -(-chunk // block)


def onebit_compress(x: torch.Tensor, scale_block: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` (rows, chunk) -> (signs ±1, per-block scales (rows, blocks), the compression error): the scale of a
    block is its RMS, so ``scale * sign`` keeps the block's L2 norm."""
    rows, chunk = x.shape
    block, nb = _scale_blocks(chunk, scale_block)
    padded = torch.nn.functional.pad(x, (0, nb * block - chunk)).view(rows, nb, block)
    counts = torch.full((nb,), float(block))
    counts[-1] = chunk - (nb - 1) * block
    scales = padded.norm(dim=2) / counts.sqrt()
    sign = _sign(x)
    approx = scales.repeat_interleave(block, dim=1)[:, :chunk] * sign
    return sign, scales, x - approx


def onebit_decompress(sign: torch.Tensor, scales: torch.Tensor, scale_block: int | None) -> torch.Tensor:
    block, _ = _scale_blocks(sign.shape[1], scale_block)
    return scales.repeat_interleave(block, dim=1)[:, : sign.shape[1]] * sign


def onebit_allreduce(
    x: torch.Tensor, errors: dict, group=None, scale_block: int | None = 2048, stats: WireStats | None = None
) -> torch.Tensor:
    """The average of ``x`` over the ranks, sent as signs (8 per byte) and per-block scales, with worker and server
    error feedback (1-bit LAMB's exchange; Li et al., arXiv 2104.06069, after DeepSpeed's ``compressed_allreduce``).

    ``x``: flat fp32, its length a multiple of ``8 * world``. ``errors``: ``{"worker_error": zeros(len(x)),
    "server_error": zeros(len(x) // world)}``, updated in place (what compression left out, added back next call).

    - worker: ``x += e_w``; chunk k of ``x`` belongs to rank k; each block of ``scale_block`` values gets its RMS as
      scale, ``e_w = x - scale * sign(x)``; chunk k's signs and scales go to rank k (``all_to_all``);
    - server (rank k, chunk k): ``y = mean_i(s_i sign_i) + e_s``, compressed the same way, ``e_s`` kept; every
      rank's chunk (signs and scales) is ``all_gather``-ed back.
    """
    world = world_size_of(group)
    chunk = x.numel() // world
    _, nb = _scale_blocks(chunk, scale_block)
    x = (x + errors["worker_error"]).view(world, chunk)
    sign, s_w, err = onebit_compress(x, scale_block)
    errors["worker_error"] = err.reshape(-1)
    packed = pack_bits(sign.reshape(-1) > 0)  # the length is a multiple of 8 * world: whole bytes per chunk
    received = torch.empty_like(packed)
    scales = torch.empty(world * nb)
    if stats is not None:
        stats.add(packed)
        stats.add(s_w)
    # phase 1: chunk k of every rank's signs (and its block scales) to rank k
    dist.all_to_all_single(received, packed, group=group)
    dist.all_to_all_single(scales, s_w.reshape(-1).contiguous(), group=group)
    signs = unpack_bits(received, chunk * world).view(world, chunk).float() * 2 - 1
    y = onebit_decompress(signs, scales.view(world, nb), scale_block).mean(0, keepdim=True) + errors["server_error"]
    server_sign, s_s, err = onebit_compress(y, scale_block)
    errors["server_error"] = err.reshape(-1)
    mine = pack_bits(server_sign.reshape(-1) > 0)
    all_signs = torch.empty(mine.numel() * world, dtype=torch.uint8)
    all_scales = torch.empty(world * nb)
    if stats is not None:
        stats.add(mine)
        stats.add(s_s)
    # phase 2: every rank's averaged chunk (signs and block scales) to every rank
    all_gather_single(all_signs, mine, group=group)
    all_gather_single(all_scales, s_s.reshape(-1).contiguous(), group=group)
    out = unpack_bits(all_signs, chunk * world).view(world, chunk).float() * 2 - 1
    return onebit_decompress(out, all_scales.view(world, nb), scale_block).reshape(-1)


def int8_allreduce(
    x: torch.Tensor, errors: dict, group=None, block: int = 2048, stats: WireStats | None = None
) -> torch.Tensor:
    """The average of flat fp32 ``x`` over the ranks, sent as int8 with one fp32 scale per block of ``block`` values
    (``max|x| / 127``) and error feedback: ``errors["worker_error"]`` (zeros like ``x`` at first) holds what the
    rounding left out and is added to the next call's ``x``. Every rank all-gathers every rank's int8 values and
    scales and averages locally (int8 sums would overflow): ``n + 4 n / block`` bytes of payload per rank."""
    world = world_size_of(group)
    n = x.numel()
    padded = -(-n // block) * block
    y = torch.zeros(padded, dtype=torch.float32, device=x.device)
    y[:n] = x.float() + errors.get("worker_error", 0)
    blocks = y.view(-1, block)
    scales = blocks.abs().amax(dim=1) / 127.0
    q = torch.round(blocks / scales.clamp(min=1e-30).unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    errors["worker_error"] = (blocks - q.float() * scales.unsqueeze(1)).reshape(-1)[:n].clone()
    all_q = torch.empty(world * padded, dtype=torch.int8, device=x.device)
    all_s = torch.empty(world * scales.numel(), dtype=torch.float32, device=x.device)
    if stats is not None:
        stats.add(q)
        stats.add(scales)
    all_gather_single(all_q, q.reshape(-1), group=group)
    all_gather_single(all_s, scales, group=group)
    total = (all_q.view(world, -1, block).float() * all_s.view(world, -1, 1)).sum(0).reshape(-1)[:n]
    return total.div_(world).to(x.dtype)
