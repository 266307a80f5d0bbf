"""DELTA's section of the jobs (``--delta.*``): memory scheduling through a Trainer callback, or on the model before a
plain loop shards or wraps it."""

from __future__ import annotations

from dataclasses import field

from hf_dtrain.errors import SettingsError
from hf_dtrain.run.section import Section, register_section

from .config import DeltaConfig


@register_section
class DeltaSection(Section):
    """``--delta``: DELTA schedules which activations each decoder layer keeps, recomputes or offloads under a budget
    of saved bytes."""

    name = "delta"
    order = 10  # on the whole model, before it is sharded or laid out

    @classmethod
    def settings(cls):
        return [
            (
                "delta",
                DeltaConfig | None,
                field(default=None, metadata={"help": "DELTA memory scheduling (hf_dtrain.memory); None: off."}),
            )
        ]

    @classmethod
    def empty_results(cls, trainer: bool) -> dict:
        return {"delta": None}

    def __init__(self, run) -> None:
        super().__init__(run)
        self.callback = None
        self.scheduler = None

    def review_trace(self, model, forward) -> list[str]:
        """The traced step keeps every activation, as DELTA's own first step does (it profiles the run as it goes):
        that step is the run's peak. DELTA's budget is checked here against the bytes the step saves (refused, naming
        the smallest budget that can be met, when it cannot), and what the later steps save under its plan said."""
        from .scheduler import plan_from_trace

        try:
            plan = plan_from_trace(model, forward, self.cfg.delta)
        except SettingsError as e:
            raise SettingsError(f"--delta {self.cfg.delta.budget}: {e}") from None
        total = plan.profile.total_saved_bytes
        counts = {a: list(plan.actions.values()).count(a) for a in ("keep", "recompute", "offload")}
        return [
            f"DELTA: its first step keeps every activation ({total / 2**20:.1f} MiB saved; the peak above is that "
            f"step's); later steps save {plan.predicted_bytes / 2**20:.1f} MiB within the budget of "
            f"{plan.budget / 2**20:.1f} MiB ({counts['keep']} units kept, {counts['recompute']} recomputed, "
            f"{counts['offload']} offloaded; which ones, the run's measured times decide)"
        ]

    def callbacks(self) -> list:
        from .scheduler import DeltaCallback

        self.callback = DeltaCallback(self.cfg.delta)
        return [self.callback]

    def prepare(self, model) -> None:
        # the Trainer's callback applies it when training begins; a trace reviews DELTA's plan instead (review_trace)
        if not self.run.trainer and not self.run.tracing:
            from .scheduler import apply_delta

            self.scheduler = apply_delta(model, self.cfg.delta)

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.remove()

    def results(self) -> dict:
        if self.callback is not None:
            history, budgets = self.callback.history, self.callback.budgets
            return {
                "delta": {
                    "saved_bytes": [h["saved_bytes"] for h in history if not h["profiling"]],
                    "budget_bytes": budgets,
                }
            }
        plans = self.scheduler.plans
        steady = [h for h in self.scheduler.executor.stats.history if not h["profiling"]]
        return {
            "delta": {
                "budget_bytes": {str(k): p.budget for k, p in plans.items()},
                "saved_bytes": [h["saved_bytes"] for h in steady],
                "offloaded_bytes": [h["offloaded_bytes"] for h in steady],
                "plans": {str(k): p.actions for k, p in plans.items()},
            }
        }
