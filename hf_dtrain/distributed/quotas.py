"""Data speed quotas: ``n`` items split in proportion to the ranks' (or clients') speeds."""

from __future__ import annotations

import math
from collections.abc import Sequence


def speed_quotas(n: int, speeds: Sequence[float]) -> list[int]:
    """``n`` split proportionally to ``speeds`` (largest remainder; sums to ``n``): the heterogeneity-aware
    partitioner's shard sizes and the federated simulation's clients per process."""
    total = float(sum(speeds))
    exact = [n * s / total for s in speeds]
    quotas = [math.floor(x) for x in exact]
    order = sorted(range(len(speeds)), key=lambda i: (-(exact[i] - quotas[i]), i))
    for i in order[: n - sum(quotas)]:
        quotas[i] += 1
    return quotas
