"""Uplink compression of a client's adapter delta, with the bytes it puts on the wire.

``int8`` / ``int4``: per-tensor symmetric scale (``max|x| / 127`` or ``/ 7``), 1 byte (or half a byte) per value
plus the scale. ``lowrank``: every matrix
``M (m x n)`` sent as rank-``r`` factors from its SVD (``U_r S_r`` and ``V_r``, ``r (m + n)`` fp32 values; the best
rank-r approximation); vectors go as fp32. With error feedback the client adds what compression dropped last time to
its next delta (EF-SGD), so nothing is lost for good.
"""

from __future__ import annotations

import torch

from hf_dtrain.errors import SettingsError


def compress(delta: torch.Tensor, method: str, rank: int = 4) -> tuple[torch.Tensor, int]:
    """``(what the server receives, bytes sent)`` for one tensor."""
    x = delta.detach().float()
    if method == "none":
        return x.clone(), 4 * x.numel()
    if method in ("int8", "int4"):
        levels = 127.0 if method == "int8" else 7.0
        nbytes = (x.numel() if method == "int8" else (x.numel() + 1) // 2) + 4  # values (two 4-bit per byte) + scale
        scale = x.abs().max() / levels
        if scale == 0:
            return torch.zeros_like(x), nbytes
        q = torch.clamp(torch.round(x / scale), -levels, levels)
        return q * scale, nbytes
    if method == "lowrank":
        if x.dim() != 2 or min(x.shape) <= rank:
            return x.clone(), 4 * x.numel()
        u, s, vh = torch.linalg.svd(x, full_matrices=False)
        approx = (u[:, :rank] * s[:rank]) @ vh[:rank]
        return approx, 4 * rank * (x.shape[0] + x.shape[1])
    raise SettingsError(f"uplink {method!r} is unknown; use none, int8, int4 or lowrank.")


def compress_delta(delta: dict[str, torch.Tensor], method: str, rank: int, residual: dict | None):
    """Compress every tensor of ``delta`` (plus ``residual``, the error feedback); returns ``(received, bytes,
    new residual or None)``."""
    received, sent, new_residual = {}, 0, {} if residual is not None else None
    for name, d in delta.items():
        x = d.float() + (residual[name] if residual is not None and name in residual else 0)
        r, b = compress(x, method, rank)
        received[name] = r
        sent += b
        if new_residual is not None:
            new_residual[name] = x - r
    return received, sent, new_residual
