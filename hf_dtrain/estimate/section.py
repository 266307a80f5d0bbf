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

    def answer(self):
        """Trace the job's step (the run's ``skeleton``); print the estimate; refuse a step that will not fit; the
        job's results when it is not to train, else None."""
        from .report import answer

        return answer(self.run, self.cfg.estimate)
