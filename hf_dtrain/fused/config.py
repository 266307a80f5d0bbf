"""How K jobs are trained fused (``hf-dtrain sweep --fused.*``): :class:`FusedConfig` (light to import)."""

from __future__ import annotations

from dataclasses import dataclass

from hf_dtrain.errors import SettingsError
from hf_dtrain.settings import check_fields, parse_bytes, setting

OVERFLOW = ("split", "error")  # what the memory guard does when the jobs do not fit


@dataclass
class FusedConfig:
    """How K jobs are trained fused (``hf-dtrain sweep --fused.*``)."""

    max_grad_norm: float = setting(
        1.0, "Per-job gradient-norm clip (the Trainer's max_grad_norm); 0 turns it off.", min=0
    )
    memory_budget: str | None = setting(
        None,
        "Memory the fused step may use, e.g. '20GiB'; None: the free GPU memory, or on CPU the available "
        "RAM, less a tenth.",
    )
    on_overflow: str = setting(
        "split",
        "When K jobs would not fit the budget: 'split' into fused groups that fit (run one after another), or 'error'.",
    )
    max_jobs_per_group: int | None = setting(
        None, "At most this many jobs in one fused group (None: as many as fit).", min=1
    )
    lr_scheduler_type: str = setting(
        "linear", "Each job's schedule (transformers' get_scheduler names: linear, cosine, constant_with_warmup, ...)."
    )

    def __post_init__(self):
        check_fields(self)
        if self.on_overflow not in OVERFLOW:
            raise SettingsError(f"FusedConfig.on_overflow={self.on_overflow!r}: use one of {OVERFLOW}.")
        if self.memory_budget is not None:
            self.budget_bytes()  # parse now: a bad value is refused before any step

    def budget_bytes(self) -> int:
        if self.memory_budget is not None:
            try:
                return int(parse_bytes(self.memory_budget))
            except ValueError as e:
                raise SettingsError(f"FusedConfig.memory_budget={self.memory_budget!r}: {e}") from None
        import torch

        if torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info()
            return int(0.9 * free)
        import psutil

        return int(0.9 * psutil.virtual_memory().available)
