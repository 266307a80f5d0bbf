"""Parrot's aggregation in two steps: each process sums its own clients' weighted deltas (local aggregation), then
one all-reduce sums the processes' partial sums (global aggregation), so the server side receives one update per
process, not one per client. Sums are kept in float64: the result equals the flat weighted average over all clients
(the grouping changes only float64 rounding, far below fp32's)."""

from __future__ import annotations

import torch

from hf_dtrain.errors import SettingsError


def local_aggregate(deltas: list[dict[str, torch.Tensor]], weights: list[float], names=None):
    """``(sum_i w_i delta_i in float64, sum_i w_i)`` over one process's clients."""
    if names is None:
        names = list(deltas[0]) if deltas else []
    total = dict.fromkeys(names)
    for d, w in zip(deltas, weights):
        for n in names:
            term = d[n].double() * float(w)
            total[n] = term if total[n] is None else total[n].add_(term)
    return total, float(sum(weights))


def global_average(partials: list[tuple[dict, float]]) -> dict[str, torch.Tensor]:
    """The weighted average from the processes' ``local_aggregate`` results (in one process: the list of them)."""
    weight = sum(w for _, w in partials)
    if weight <= 0:
        raise SettingsError(
            "no client update reached the aggregation (every sampled client failed or none was sampled)."
        )
    names = [n for n, v in partials[0][0].items()]
    out = {}
    for n in names:
        acc = None
        for sums, _ in partials:
            if sums.get(n) is None:
                continue
            acc = sums[n].clone() if acc is None else acc.add_(sums[n])
        out[n] = (acc / weight).float()
    return out


def flat_average(deltas: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    """The weighted average of all clients' deltas at once (the reference the two-step aggregation equals)."""
    sums, weight = local_aggregate(deltas, weights)
    return {n: (v / weight).float() for n, v in sums.items()}
