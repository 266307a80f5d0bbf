"""DELTA's section of the jobs (``--delta.*``): memory scheduling through a Trainer callback, or on the model before a
plain loop shards or wraps it."""

from __future__ import annotations

from dataclasses import field

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

    def untraceable(self) -> str | None:
        return (
            "--delta: DELTA plans its schedule from the first steps' measured profile, which a trace on fake tensors "
            "cannot measure; estimate without --delta (the step that keeps everything: DELTA's budget is a share of "
            "its activations)"
        )

    def callbacks(self) -> list:
        from .scheduler import DeltaCallback

        self.callback = DeltaCallback(self.cfg.delta)
        return [self.callback]

    def prepare(self, model) -> None:
        if not self.run.trainer:  # the Trainer's callback applies it when training begins
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
