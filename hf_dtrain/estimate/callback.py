"""The Trainer's side of ``--estimate.measure`` (:class:`~hf_dtrain.estimate.section.EstimateSection`): the job's
last ``measured_steps`` optimizer steps measured, from the first one's start to the last one's end."""

from __future__ import annotations

from transformers import TrainerCallback


class MeasuredStepsCallback(TrainerCallback):
    def __init__(self, section) -> None:
        self.section = section

    def on_step_begin(self, args, state, control, **kwargs):
        self.section.before_step(state.global_step + 1, state.max_steps, kwargs["model"], kwargs.get("optimizer"))

    def on_step_end(self, args, state, control, **kwargs):
        self.section.after_step(state.global_step, 0.0)

    def on_train_end(self, args, state, control, **kwargs):
        self.section.end()
