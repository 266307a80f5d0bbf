"""The estimate's section of the jobs (``--estimate``): the job's step traced on fake tensors before the process
group, printed, written (``estimate.json`` and ``estimate.png`` in the output directory), and a verdict against one
device's memory; on a GPU (or with ``--estimate.train true``) a run whose step will not fit is refused before any
weight is read, naming its largest buffer and the changes that would make it fit."""

from __future__ import annotations

from dataclasses import field

from hf_dtrain.run.section import Section, register_section

from .config import EstimateConfig


@register_section
class EstimateSection(Section):
    """``--estimate``: per-rank peak memory of the job's training step, traced through the real modules and the
    job's own engine sections on fake tensors over a fake world of ``--world-size`` ranks."""

    name = "estimate"
    order = 0

    @classmethod
    def settings(cls):
        help = (
            "Trace the job's training step on fake tensors (no weight read; --model may be a preset such as "
            "llama3-8b or a directory holding only config.json) and print its per-rank peak memory, split, FLOPs "
            "and a verdict against --device-memory, then exit (estimate.train true: train after it). On a GPU a run "
            "is checked this way unasked and refused when its step will not fit (--run-anyway to run it)."
        )
        return [("estimate", EstimateConfig | None, field(default=None, metadata={"help": help}))]

    @classmethod
    def short_flags(cls):
        return [
            (
                "--world-size",
                "estimate.world_size",
                dict(type=int, metavar="N", help="Short for --estimate.world-size."),
            ),
            (
                "--device-memory",
                "estimate.device_memory",
                dict(metavar="SIZE", help="Short for --estimate.device-memory."),
            ),
            (
                "--run-anyway",
                "estimate.anyway",
                dict(action="store_const", const=True, help="Short for --estimate.anyway true."),
            ),
        ]

    @classmethod
    def planned_world(cls, cfg) -> int | None:
        """An estimate that does not train is checked against the world it is asked for, not the launched one."""
        asked = cfg.estimate
        return asked.world_size if asked is not None and not asked.train else None

    @classmethod
    def reads_no_data(cls, cfg) -> bool:
        """An estimate that does not train reads no data (a data file that does not exist is said once in its
        notes, not refused)."""
        asked = getattr(cfg, "estimate", None)
        return asked is not None and not asked.train

    @classmethod
    def active(cls, view) -> bool:
        """Asked for, or on a GPU (the check before a run), unless skipped."""
        if view.cfg.estimate is not None:
            return not view.cfg.estimate.skip
        import torch

        return torch.cuda.is_available()

    # --estimate.measure measures the job's last steps, as many as the estimate traces (the first builds the
    # optimizer's state, the second starts with it): after any warm-up of a method (SMT's scoring steps)
    measured_steps = 2

    def __init__(self, run) -> None:
        super().__init__(run)
        self.estimated: dict | None = None  # the traced step's results, once answered
        self.meter = None  # --estimate.measure: the job's own steps, measured (hf_dtrain.estimate.measure)
        self.first_step: int | None = None  # the first and last measured steps
        self.last_step: int | None = None
        self.held = (None, None)  # the model and optimizer the measured steps train

    def answer(self):
        """Trace the job's step (the run's ``skeleton``); print the estimate; refuse a step that will not fit; the
        job's results when it is not to train, else None."""
        from .report import answer

        asked = self.cfg.estimate
        self.estimated = answer(self.run, asked)
        if asked is not None and not asked.train:
            return None if self.estimated is None else {"estimate": self.estimated}
        if self.estimated is not None and asked is not None and asked.measure:
            from .measure import StepPeak

            self.meter = StepPeak()
        return None

    # ---- --estimate.measure: the Trainer's steps (a callback) or a plain loop's (after_prepare / after_step) --------
    def callbacks(self) -> list:
        if self.meter is None:
            return []
        from .callback import MeasuredStepsCallback

        return [MeasuredStepsCallback(self)]

    def after_prepare(self, model, optimizer) -> None:
        """A plain loop: measuring starts here when the run has no more than ``measured_steps`` left."""
        self.held = (model, optimizer)  # what the measured steps start from (hf_dtrain.estimate.measure)
        max_steps = getattr(self.cfg, "max_steps", None)
        if self.meter is not None and (max_steps is None or self.run.start_step > max_steps - self.measured_steps):
            self.start_measuring(None)  # the first step's number comes with its after_step

    def before_step(self, step: int, max_steps: int, model, optimizer) -> None:
        """Before optimizer step ``step`` of ``max_steps`` (the Trainer's callback): measuring starts with the last
        ``measured_steps``."""
        if self.meter is not None and self.first_step is None and step > max_steps - self.measured_steps:
            self.held = (model, optimizer)
            self.start_measuring(step)

    def after_step(self, step: int, loss: float) -> None:
        if self.meter is None:
            return
        if not self.meter.running:  # a plain loop: the next step is one of the last measured_steps
            max_steps = getattr(self.cfg, "max_steps", None)
            if self.first_step is None and max_steps is not None and step + 1 > max_steps - self.measured_steps:
                self.start_measuring(step + 1)
            return
        if self.first_step is None:
            self.first_step = step
        self.last_step = step
        if step >= self.first_step + self.measured_steps - 1:
            self.stop_measuring()

    def end(self) -> None:
        if self.meter is not None and self.meter.running:  # fewer steps than measured_steps
            self.stop_measuring()

    def start_measuring(self, first_step: int | None) -> None:
        self.first_step, self.last_step = first_step, None
        self.meter.start(*self.held)

    def stop_measuring(self) -> None:
        from .report import measured

        peak = self.meter.stop()
        steps = [] if self.last_step is None else list(range(self.first_step, self.last_step + 1))
        self.estimated = measured(
            self.estimated, peak, self.meter.how, steps, self.run.output_dir, main=self.run.is_main
        )

    def results(self) -> dict:
        return {} if self.estimated is None else {"estimate": self.estimated}
