"""What a job trains, described without its weights or its data (:class:`Skeleton`): the job builds one from its
config (``skeleton(cfg)`` in its package) and hands that function to :class:`~hf_dtrain.run.job.JobRun`, where a
section that traces the step (the memory estimate) takes it. Imports nothing heavy."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Skeleton:
    """What a job trains, for a trace with no weight read. ``build()``: the model on the meta device, the method applied
    there, a data-dependent preparation replaced by a seeded one with the same shapes, said in ``notes``
    (``build("cpu")``: the same, initialised, for the measurement the trace is checked against); ``batch`` sequences
    of ``seq_len`` tokens per rank and step; ``autocast``: the compute dtype under autocast (None: the weights');
    ``checkpointing``: gradient checkpointing on the decoder layers; ``optimizer(params)``: the optimizer the job
    builds when no section builds one; ``lr`` / ``weight_decay``: what a section's optimizer is built with;
    ``output_dir``: where the estimate's JSON and chart go; ``notes``: what the trace does not take as the run would
    (the data not read, a selection seeded); ``alternatives``: the job's own changes that would lower the memory (a
    micro-batch of 1, gradient checkpointing), each ``(what to change, the job config with it)``;
    ``forward_kwargs``: what the job's loss passes to ``model(input_ids=..., labels=..., **forward_kwargs)`` (TRL's
    fused LM head: ``fused_lm_head=True``)."""

    build: Callable[..., Any]  # build(device="meta"): the model (a torch module) there
    batch: int
    seq_len: int
    vocab_size: int
    optimizer: Callable[[list], Any]
    autocast: Any = None  # a torch dtype
    checkpointing: bool = False
    lr: float = 1e-4
    weight_decay: float = 0.0
    output_dir: str | None = None
    notes: list[str] = field(default_factory=list)
    alternatives: list[tuple[str, Any]] = field(default_factory=list)  # (the change, the job config with it)
    forward_kwargs: dict = field(default_factory=dict)  # what the job's loss passes to the model's forward


def vary(cfg, **changes):
    """A shallow copy of a job config with ``changes`` (a job's own alternatives)."""
    changed = copy.copy(cfg)
    for key, value in changes.items():
        setattr(changed, key, value)
    return changed


def data_notes(dataset: str | None, how: str = "") -> list[str]:
    """What a trace says of the job's data file: not read (and, when it does not exist, that the run would refuse it),
    ``how`` the batches are taken instead."""
    if dataset is None:
        return []
    missing = "" if os.path.exists(os.path.expanduser(dataset)) else " (it does not exist: the run would refuse it)"
    return [f"--dataset {dataset} is not read{missing}{how}"]
