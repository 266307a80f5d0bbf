"""``DeltaConfig``: DELTA's memory budget and planner settings. Every field is a ``--delta.<field>`` flag of
``hf-dtrain finetune`` / ``pretrain`` and a key of the ``delta:`` YAML section (``delta: 0.5`` is short for
``delta: {budget: 0.5}``); ``DeltaCallback(config)`` and ``apply_delta(model, config)`` take it unchanged."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from hf_dtrain.errors import SettingsError
from hf_dtrain.settings import check_choice, check_fields, setting

OBJECTIVES = ("time", "memory")  # what the planner minimises (planner.py)
GRANULARITIES = ("layer", "submodule")  # what one plan unit is (profiler.py)


PLANNERS = ("exact", "delta")


@dataclass
class DeltaConfig:
    """DELTA's settings (validated on construction; the budget rule lives here and nowhere else)."""

    section_key: ClassVar[str] = "delta"  # flags --delta.<field>, YAML delta:

    shorthand: ClassVar[str] = "budget"

    budget: float | None = setting(
        None,
        "Memory budget for saved activations: a fraction in (0, 1] of the bytes a step saves with nothing "
        "offloaded or recomputed, or a number of bytes (> 1). Required.",
    )
    granularity: str = setting(
        "layer", "Planning unit: layer (each decoder layer) or submodule (each layer's attention, MLP and norms)."
    )
    objective: str = setting(
        "time",
        "time: the fastest plan within the budget; memory: the fewest bytes among plans predicted no "
        "slower than recomputing every unit.",
    )
    method: str = setting(
        "exact", "Planner: exact (Pareto dynamic programme) or delta (the paper's filter and director heuristic)."
    )
    allow_offload: bool = setting(
        True,
        "Allow the offload action (to pinned host memory on CUDA, a private file on CPU); false: recompute "
        "or keep only.",
    )

    def __post_init__(self):
        check_fields(self)
        b = self.budget
        if b is None:
            raise SettingsError(
                "DeltaConfig.budget is required: set delta.budget (--delta.budget) to a fraction in "
                "(0, 1] of the no-saving activation bytes, or to bytes (> 1)."
            )
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not b > 0:
            raise SettingsError(
                f"DeltaConfig.budget must be a fraction in (0, 1] or bytes (> 1), got {b!r}; set delta.budget."
            )
        if b > 1 and b != int(b):
            raise SettingsError(
                f"DeltaConfig.budget={b!r}: above 1 the budget is a number of bytes and must be whole; "
                "a fraction of the no-saving activation bytes is in (0, 1]."
            )
        # the one rule: up to 1 is a fraction of the no-saving bytes, above 1 a number of bytes
        self.budget = float(b) if b <= 1 else int(b)
        check_choice(self, "granularity", GRANULARITIES, "delta.granularity")
        check_choice(self, "objective", OBJECTIVES, "delta.objective")
        check_choice(self, "method", PLANNERS, "delta.method")

    def budget_bytes(self, no_saving_bytes: int) -> int:
        """The budget in bytes for a step that saves ``no_saving_bytes`` with everything kept."""
        return int(self.budget * no_saving_bytes) if isinstance(self.budget, float) else int(self.budget)

    @classmethod
    def from_any(cls, config: DeltaConfig | int | float | None, **overrides) -> DeltaConfig:
        """A config from itself, a budget (bytes as an int, a fraction as a float) or None (the fields as keywords:
        ``budget=0.5, granularity="submodule"``), with fields overridden."""
        if config is None:
            return cls(**overrides)
        if isinstance(config, cls):
            return dataclasses.replace(config, **overrides) if overrides else config
        return cls(budget=config, **overrides)
