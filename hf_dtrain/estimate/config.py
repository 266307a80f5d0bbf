"""``EstimateConfig``: "will it fit?" for a job, before any weight is read. Every field is a ``--estimate.<field>``
flag of ``hf-dtrain finetune`` / ``pretrain`` (short forms ``--world-size``, ``--device-memory``, ``--run-anyway``)
and a key of the ``estimate:`` YAML section; the bare ``--estimate`` traces the job's step, prints the estimate and
exits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hf_dtrain.errors import SettingsError
from hf_dtrain.settings import check_fields, parse_bytes, setting


@dataclass
class EstimateConfig:
    """The estimate's settings (validated on construction)."""

    section_key: ClassVar[str] = "estimate"  # flags --estimate.<field>, YAML estimate:

    world_size: int | None = setting(
        None, "Ranks to estimate for (default: the launched ones; 1 without a launcher).", min=1
    )
    device_memory: str | None = setting(
        None,
        "Memory of one device (80GiB, 24GB, bytes) for the verdict; default: the GPU's, none on a machine "
        "without one (the figures without a verdict).",
    )
    train: bool = setting(
        False,
        "Train after the estimate, refusing a step that will not fit in device_memory (what a run on a GPU does "
        "unasked). false: print the estimate and exit.",
    )
    anyway: bool = setting(False, "Train even when the estimate says the step will not fit (--run-anyway).")
    alternatives: bool = setting(
        True,
        "When it will not fit, trace the cheapest changes too (micro-batch 1, gradient checkpointing, FSDP2, more "
        "ranks) and name each with its peak.",
    )

    measure: bool = setting(
        False,
        "Train, and hold the estimate against the job's own last two steps as they run (after any warm-up): "
        "their peak memory on rank 0 (a GPU: the CUDA allocator's max_memory_allocated; CPU: the profiler's memory "
        "events), written beside the estimate in results.json and estimate.json with the ratio.",
    )
    skip: bool = setting(
        False, "No estimate at all: not even the check a run on a GPU makes unasked before reading the weights."
    )

    def __post_init__(self):
        check_fields(self)
        if self.device_memory is not None:
            try:
                nbytes = parse_bytes(self.device_memory)
            except SettingsError:
                nbytes = -1
            if not nbytes > 0:
                raise SettingsError(
                    f"estimate.device_memory={self.device_memory!r} is not a size; set --device-memory to e.g. 80GiB, "
                    "24GB or a number of bytes."
                )
        if self.skip and self.measure:
            raise SettingsError(
                "estimate.skip and estimate.measure contradict each other: a skipped estimate has nothing to hold "
                "against the measured step; drop one of them."
            )
        if (self.anyway or self.skip or self.measure) and not self.train:
            self.train = True  # --run-anyway, --estimate.skip and --estimate.measure ask for the run
