"""A job's training step traced on fake tensors over a fake world: "will it fit?" for the command the user would run.

A job says what it trains in a :class:`Skeleton` (its model built on the meta device with its method applied, the
micro-batch, the precision, gradient checkpointing, the optimizer it would build); :func:`trace_job` builds the job's
own engine sections for ``world_size`` ranks (:class:`~hf_dtrain.run.job.JobRun` without a process group), makes the
model fake, lets the sections prepare it as they would (the lean paths, FSDP2 / HSDP, the TP mesh over torch's fake
process group), builds the optimizer, and traces two steps on rank 0 (:func:`~hf_dtrain.estimate.trace.trace_step`).
Nothing is read or allocated beyond the host's bookkeeping: an 8B model traces in about a gigabyte of host memory.
"""

from __future__ import annotations

import contextlib
import resource
import time
from dataclasses import dataclass

import torch
from torch import nn

from hf_dtrain.errors import SettingsError
from hf_dtrain.run.skeleton import Skeleton

from .trace import StepMemory, fake_tensors, fake_world, make_fake, trace_step


@dataclass
class JobEstimate:
    """Rank 0's traced step: ``memory`` (the peak and its split, the step's FLOPs), the world and engine it was traced
    for, the trace's own cost (seconds, host memory) and ``notes`` (what it leaves out or took otherwise)."""

    memory: StepMemory
    world_size: int
    engine: str
    batch: int
    seq_len: int
    seconds: float
    host_bytes: int
    notes: list[str]

    def to_dict(self) -> dict:
        return {
            **self.memory.to_dict(),
            "world_size": self.world_size,
            "engine": self.engine,
            "micro_batch": self.batch,
            "seq_len": self.seq_len,
            "trace_seconds": round(self.seconds, 2),
            "trace_host_bytes": self.host_bytes,
            "notes": list(self.notes),
        }


class _Autocast:
    """What a section's ``forward_backward`` asks of Accelerate: ``autocast()``."""

    def __init__(self, dtype, device):
        self.dtype, self.device = dtype, device

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)


def trace_job(cfg, skeleton: Skeleton, world_size: int, run_cls=None, steps: int = 2, fake: bool = True) -> JobEstimate:
    """Trace one training step of the job ``cfg`` on rank 0 of ``world_size`` (see the module's docstring), and on
    the ranks the sections say differ from it (a pipeline's last stage): the estimate is the largest of them.

    The sections are the job's own (``run_cls``: :class:`~hf_dtrain.run.job.JobRun` by default), built for
    ``world_size`` without a process group and without the skeleton (so a section that traces does not trace
    again); their ``setup`` and ``prepare`` run as in a launched job, inside the fake world. A multi-process run
    without a sharding section is DDP's: its gradient buckets are added to the peak (:func:`_add_ddp_buckets`).

    ``fake=False``: the same step on real tensors (the model built and initialised there), in the process group the
    caller made (this process's rank of ``world_size``, the others running the same call), a real DDP wrapping the
    model where the run would have one: the measurement the estimate is checked against."""
    if run_cls is None:
        from hf_dtrain.run.job import JobRun as run_cls
    t0 = time.perf_counter()
    memory, notes, run, others = _trace_rank(cfg, skeleton, world_size, run_cls, steps, fake, rank=0)
    ranks = {0: memory.peak}
    if fake:
        for rank in others:
            theirs, their_notes, _, _ = _trace_rank(cfg, skeleton, world_size, run_cls, steps, fake, rank=rank)
            ranks[rank] = theirs.peak
            notes += [n for n in their_notes if n not in notes]
            if theirs.peak > memory.peak:
                memory = theirs
    if len(ranks) > 1:
        notes.append(
            "ranks traced: " + ", ".join(f"{r} ({gib(peak)})" for r, peak in ranks.items()) + "; the largest is shown"
        )
    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds = time.perf_counter() - t0
    notes = [*skeleton.notes, *notes]
    return JobEstimate(memory, world_size, run.engine, skeleton.batch, skeleton.seq_len, seconds, host, notes)


def _trace_rank(cfg, skeleton: Skeleton, world_size: int, run_cls, steps: int, fake: bool, rank: int):
    """One rank's traced (or, ``fake=False``, measured) step: ``(memory, notes, the run, the other ranks to trace)``."""
    run = run_cls(cfg, world_size=world_size, start=False)
    refused = [why for why in run._call("untraceable") if why]
    if refused:
        raise SettingsError("--estimate: the step cannot be traced with these settings: " + "; ".join(refused) + ".")
    others = sorted({r for ranks in run._call("traced_ranks") for r in ranks if r != rank})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run.device, run.state, run.tracing = device, None, fake
    notes = []  # the trace's own, after the skeleton's (which its optimizer may add to)
    model = skeleton.build("meta" if fake else device.type)
    ddp = world_size > 1 and not run.sharded and not run.laid_out
    with fake_world(world_size, device.type, rank=rank) if fake else contextlib.nullcontext():
        run._call("setup")
        try:
            with fake_tensors() if fake else contextlib.nullcontext():
                if fake:
                    model = make_fake(model, device)
                model.train()  # as the Trainer and the loops do (a model built from a config may be in eval mode)
                if skeleton.checkpointing:
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                    if hasattr(model, "enable_input_require_grads"):
                        model.enable_input_require_grads()
                run.prepare(model)
                optimizer = run.optimizer(model, skeleton.lr, skeleton.weight_decay)
                if optimizer is None:
                    optimizer = skeleton.optimizer([p for p in model.parameters() if p.requires_grad])
                blocks = torch.randint(0, skeleton.vocab_size, (skeleton.batch, skeleton.seq_len), device=device)
                accelerator = _Autocast(skeleton.autocast, device)
                stepped = model
                if ddp and not fake:
                    from torch.nn.parallel import DistributedDataParallel

                    stepped = DistributedDataParallel(model)

                def step():
                    loss = run.forward_backward(stepped, blocks, accelerator)
                    if loss is None:
                        with accelerator.autocast():
                            loss = stepped(input_ids=blocks, labels=blocks, **skeleton.forward_kwargs).loss
                        loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)

                if not fake and run.laid_out:
                    # one step untraced first: a pipeline's first step infers its stages' shapes with
                    # autograd.grad, which the tracker's gradient hooks cannot follow (the trace is given the shapes)
                    step()
                memory = trace_step(model, optimizer, step, steps=steps)
                accounted = [said for said in run._call("account_trace", memory, model) if said is not None]
                for counted, said in accounted:  # a section that counts what the trace could not run
                    memory = counted
                    notes.extend(said)
                if ddp and fake and not accounted:
                    _add_ddp_buckets(memory, model, notes)

                def forward():
                    with accelerator.autocast():
                        stepped(input_ids=blocks, labels=blocks, **skeleton.forward_kwargs)

                if fake:
                    for said in run._call("review_trace", model, forward):
                        notes.extend(said)
        finally:
            run._call("close")
    return memory, notes, run, others


def _add_ddp_buckets(memory: StepMemory, model: nn.Module, notes: list) -> None:
    """DDP (not traced: its reducer's C++ buckets cannot take fake tensors) holds the trainable gradients a second
    time, flattened into its buckets (``gradient_as_bucket_view=False``, Accelerate's default), from the first
    backward on: counted as ``gradient buckets`` at the traced peak."""
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    memory.split["gradient buckets"] = nbytes
    memory.peak += nbytes
    notes.append("DDP's gradient buckets (a copy of the trainable gradients) are counted, not traced")


def device_memory_of(text: str | None) -> int | None:
    """The memory of one device: ``text`` (``80GiB``, checked by :class:`EstimateConfig`), else the GPU's total, else
    None (no verdict)."""
    if text is not None:
        from hf_dtrain.settings import parse_bytes

        return int(parse_bytes(text))
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return None


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
