"""DELTA's planner: for each decoder layer choose keep, offload (to the slower tier) or recompute so that the saved
activation bytes fit a budget at the least predicted extra time.

Per layer ``g`` (from the profile): keep costs ``saved_g`` bytes and no time; recompute keeps only the layer input
(``input_g`` bytes) and costs one more forward (``forward_g`` seconds); offload keeps nothing in memory and costs the
transfer, ``2 saved_g / bandwidth`` (out and back; on a GPU with a side stream and prefetch the part that overlaps the
layer's compute, ``3 forward_g``, is free). Everything saved outside the layers (embeddings, loss) is always kept.

The exact solver is a dynamic programme over the layers keeping the Pareto frontier of (bytes, seconds), exact for any
number of layers a model has. ``method="delta"`` is DELTA's heuristic instead (Tang et al., arXiv 2203.15980): the
filter releases the largest, least recently needed groups first (the earliest layers: their tensors are used last in
backward), and the director recomputes when the transfer would cost more than recomputing, else offloads.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_dtrain.errors import SettingsError

from .config import OBJECTIVES
from .profiler import Profile

ACTIONS = ("keep", "offload", "recompute")


@dataclass
class Plan:
    actions: dict[str, str]
    predicted_bytes: int
    predicted_seconds: float
    budget: int
    profile: Profile

    def table(self) -> str:
        """The plan as a markdown table: group, saved bytes, action, bytes kept, predicted extra seconds."""
        rows = ["| group | saved bytes | action | kept bytes | predicted extra time (ms) |", "|---|---|---|---|---|"]
        for g in self.profile.groups:
            action = self.actions[g.name]
            kept, cost = _option(g, action, self.profile.tier_bandwidth, overlap=False)
            rows.append(f"| {g.name} | {g.saved_bytes:,} | {action} | {kept:,} | {1000 * cost:.2f} |")
        rows.append(
            f"| (outside the layers) | {self.profile.other_bytes:,} | keep | {self.profile.other_bytes:,} | 0 |"
        )
        rows.append(
            f"| **total** | {self.profile.total_saved_bytes:,} | | **{self.predicted_bytes:,}** "
            f"(budget {self.budget:,}) | {1000 * self.predicted_seconds:.2f} |"
        )
        return "\n".join(rows)


def _option(g, action: str, bandwidth: float, overlap: bool) -> tuple[int, float]:
    if action == "keep":
        return g.saved_bytes, 0.0
    if action == "recompute":
        return g.input_bytes, g.forward_seconds
    transfer = 2 * g.saved_bytes / bandwidth
    return 0, max(0.0, transfer - 3 * g.forward_seconds) if overlap else transfer


def minimum_budget(profile: Profile, allow_offload: bool = True) -> int:
    """The smallest budget any plan meets."""
    per_group = [0 if allow_offload else min(g.saved_bytes, g.input_bytes) for g in profile.groups]
    return profile.other_bytes + sum(per_group)


def make_plan(
    profile: Profile,
    budget: int,
    method: str = "exact",
    allow_offload: bool = True,
    overlap: bool = False,
    objective: str = "time",
) -> Plan:
    """The plan for ``budget`` bytes of saved activations; a ``ValueError`` stating the minimum feasible budget when
    none fits.

    ``objective="time"``: the least predicted time within the budget. ``objective="memory"``: the fewest bytes among
    the plans within the budget predicted no slower than recomputing every unit (full gradient checkpointing), for
    users who would otherwise checkpoint everything (exact solver only)."""
    if method not in ("exact", "delta"):
        raise SettingsError(f"DELTA planner method must be 'exact' or 'delta', got {method!r}.")
    if objective not in OBJECTIVES:
        raise SettingsError(f"DELTA planner objective must be one of {OBJECTIVES}, got {objective!r}.")
    if objective == "memory" and method != "exact":
        raise SettingsError(
            "objective='memory' needs method='exact' (it picks from the exact solver's Pareto frontier)."
        )
    floor = minimum_budget(profile, allow_offload)
    if budget < floor:
        raise SettingsError(
            f"A budget of {budget:,} bytes cannot be met: the minimum feasible budget for this model and "
            f"batch shape {profile.shape} is {floor:,} bytes (everything outside the decoder layers, "
            f"{profile.other_bytes:,} bytes, stays, and every layer is "
            f"{'offloaded' if allow_offload else 'recomputed'}). Raise the budget or lower the batch "
            "size / sequence length."
        )
    actions_allowed = ACTIONS if allow_offload else ("keep", "recompute")
    bw = profile.tier_bandwidth
    if method == "exact":
        frontier = [(profile.other_bytes, 0.0, ())]  # (bytes, seconds, actions so far), Pareto-optimal
        for g in profile.groups:
            options = [(a, *_option(g, a, bw, overlap)) for a in actions_allowed]
            candidates = [
                (b + mem, s + cost, acts + (a,))
                for b, s, acts in frontier
                for a, mem, cost in options
                if b + mem <= budget
            ]
            candidates.sort(key=lambda c: (c[0], c[1]))
            frontier = []
            for c in candidates:  # keep the points not dominated (more bytes must buy less time)
                if not frontier or c[1] < frontier[-1][1] - 1e-15:
                    frontier.append(c)
        best = min(frontier, key=lambda c: (c[1], c[0]))
        if objective == "memory":
            checkpoint_seconds = sum(g.forward_seconds for g in profile.groups)
            no_slower = [c for c in frontier if c[1] <= checkpoint_seconds + 1e-12]
            if no_slower:
                best = min(no_slower, key=lambda c: (c[0], c[1]))
        actions = dict(zip((g.name for g in profile.groups), best[2]))
        return Plan(actions, best[0], best[1], budget, profile)
    # DELTA: filter (largest x least recently needed first) and director (recompute vs swap), until under budget
    actions = {g.name: "keep" for g in profile.groups}
    used = profile.total_saved_bytes
    order = sorted(
        range(len(profile.groups)), key=lambda i: -(profile.groups[i].saved_bytes * (len(profile.groups) - i))
    )
    for i in order:
        if used <= budget:
            break
        g = profile.groups[i]
        swap_mem, swap_cost = _option(g, "offload", bw, overlap)
        rec_mem, rec_cost = _option(g, "recompute", bw, overlap)
        action = "recompute" if (not allow_offload or swap_cost > rec_cost) else "offload"
        actions[g.name] = action
        used -= g.saved_bytes - (rec_mem if action == "recompute" else swap_mem)
    if used > budget:  # the director's choices were not enough: offload what is left
        for g in profile.groups:
            if used <= budget or not allow_offload:
                break
            if actions[g.name] == "recompute":
                actions[g.name] = "offload"
                used -= g.input_bytes
    seconds = sum(_option(g, actions[g.name], bw, overlap)[1] for g in profile.groups)
    return Plan(actions, used, seconds, budget, profile)
