"""The fault-tolerance errors: a job whose snapshots exist but cannot be restored, and a snapshot of another job,
world size or layout (the messages name what differs and the way out)."""

from __future__ import annotations

from typing import Any

from hf_dtrain.errors import UserError


class SnapshotError(UserError, RuntimeError):
    """A run whose snapshots exist but cannot be restored (and no disk copy to fall back to)."""


class SnapshotMismatch(UserError, ValueError):
    """A snapshot of another job or world size: not resumed (the message names what differs and the way out)."""


def _flatten(d: Any, prefix: str = "") -> dict:
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): d}


def identity_diff(theirs: dict, ours: dict, limit: int = 6) -> str:
    """The settings that differ between two run identities, as ``key: theirs -> ours``."""
    a, b = _flatten(theirs), _flatten(ours)
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    parts = [f"{k}: {a.get(k, '(absent)')!r} there, {b.get(k, '(absent)')!r} here" for k in keys[:limit]]
    return "; ".join(parts) + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")
