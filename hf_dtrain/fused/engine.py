"""The fused training loop: K jobs, one forward/backward per step, each job its own optimizer state, learning rate,
schedule, gradient clipping and data order (HFTA, Wang et al., MLSys 2021).

``FusedTrainer(fused, jobs, FusedConfig())`` drives a model from :func:`~hf_dtrain.fused.fuse.fuse_adapters` or
:func:`~hf_dtrain.fused.fuse.fuse_models`: each step takes one micro-batch per job, pads them to one length (right
padding, which a causal model's earlier positions never see), stacks them job-major, runs the model once, and
computes each job's loss as the Trainer's causal-LM loss would (sum over the job's supervised tokens divided by
their count). The losses are summed for backward: no parameter is shared between jobs' trainable sets, so each job
gets exactly its own gradient. A job whose loss or gradient turns non-finite is stopped (its update masked out) and
reported; the others go on.

Under ``torchrun`` / ``accelerate launch`` the fused model is wrapped in ``DistributedDataParallel``: data parallel
over the fused array, each rank feeding its own shard of every job's batches.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from hf_dtrain.distributed.counters import SavedTensorCounter
from hf_dtrain.errors import SettingsError, UserError
from hf_dtrain.tasks import exact_match

from .config import FusedConfig
from .optim import FusedAdamW, JobSchedules

IGNORE_INDEX = -100


class FusedMemoryError(UserError, ValueError):
    """The fused jobs do not fit the memory budget (the message says how many fit and what to change)."""


@dataclass
class FusedJob:
    """One job of a fused group: its name, peak learning rate, weight decay, warm-up, and its micro-batches (an
    iterator of dicts with input_ids / attention_mask / labels, in the job's own order)."""

    name: str
    learning_rate: float
    batches: Iterator[dict]
    weight_decay: float = 0.0
    warmup_steps: int = 0


def stack_batches(batches: list[dict], pad_id: int) -> dict:
    """K micro-batches of equal row count -> one batch, job-major, right-padded to the longest."""
    rows = {b["input_ids"].shape[0] for b in batches}
    if len(rows) > 1:
        raise SettingsError(
            f"fused jobs got micro-batches of different sizes {sorted(rows)}; fused jobs need one "
            "per_device_train_batch_size and datasets of one length."
        )
    t = max(b["input_ids"].shape[1] for b in batches)
    pads = {"input_ids": pad_id, "attention_mask": 0, "labels": IGNORE_INDEX}
    out = {}
    for key, value in pads.items():
        out[key] = torch.cat([F.pad(b[key], (0, t - b[key].shape[1]), value=value) for b in batches])
    return out


def per_job_loss(logits: torch.Tensor, labels: torch.Tensor, num_jobs: int, counts: torch.Tensor | None = None):
    """``(K,)`` causal-LM losses: each job's summed next-token cross entropy over its supervised tokens divided by
    ``counts`` (default: the job's own count of shifted labels that are not ignored, the Trainer's
    ``num_items_in_batch``)."""
    vocab = logits.shape[-1]
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    ce = F.cross_entropy(
        logits.float().reshape(-1, vocab), shifted.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    )
    if counts is None:
        counts = token_counts(labels, num_jobs)
    return ce.reshape(num_jobs, -1).sum(1) / counts.clamp(min=1)


def token_counts(labels: torch.Tensor, num_jobs: int) -> torch.Tensor:
    """Each job's count of supervised next-token targets (``labels[..., 1:]`` not ignored), as the Trainer counts."""
    return (labels[..., 1:] != IGNORE_INDEX).reshape(num_jobs, -1).sum(1)


def no_decay(name: str) -> bool:
    """The Trainer's rule: biases and norm weights get no weight decay."""
    low = name.lower()
    return "bias" in low or "norm" in low


class FusedTrainer:
    """Train the K jobs of ``fused`` (a ``FusedAdapters`` or ``FusedModels``) for ``max_steps`` steps.

    :meth:`step` runs one fused step and returns the ``(K,)`` losses (NaN for a stopped job); :attr:`history` holds
    every job's loss per step; :attr:`stopped` maps a stopped job's index to the step and the reason.
    """

    def __init__(
        self,
        fused,
        jobs: list[FusedJob],
        max_steps: int,
        config: FusedConfig | None = None,
        pad_id: int = 0,
        optimizer_rule: str = "adamw",
    ) -> None:
        self.fused, self.jobs, self.config = fused, list(jobs), config or FusedConfig()
        if len(self.jobs) != fused.num_jobs:
            raise SettingsError(f"{len(self.jobs)} jobs given for a fused model of {fused.num_jobs}.")
        self.max_steps, self.pad_id = max_steps, pad_id
        self.num_jobs = fused.num_jobs
        named = fused.named_parameters()
        pairs = {}
        if optimizer_rule == "lorafa":  # LoRA-FA's correction needs each B's frozen A and scaling
            for _, f in getattr(fused, "layers", {}).values():
                if hasattr(f, "lora_B") and not isinstance(f.lora_A, torch.nn.Parameter):
                    pairs[id(f.lora_B)] = (f.lora_A, f.scaling.view(-1))
        self.optimizer = FusedAdamW(
            [p for _, p in named],
            self.num_jobs,
            weight_decay=[j.weight_decay for j in self.jobs],
            decay=[not no_decay(n) for n, _ in named],
            rule=optimizer_rule,
            pairs=pairs,
            eps=1e-6 if optimizer_rule == "lorafa" else 1e-8,
        )
        self.schedules = JobSchedules(
            [j.learning_rate for j in self.jobs],
            [j.warmup_steps for j in self.jobs],
            max_steps,
            self.config.lr_scheduler_type,
        )
        self.params = fused.parameters()  # the fused trainable tensors, listed once
        self.device = self.params[0].device
        self.model = fused.model
        self.module = self.model
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.module = DistributedDataParallel(self.model)
        self.alive = [True] * self.num_jobs
        self.stopped: dict[int, dict] = {}
        self.history: list[list[float]] = []
        self.step_seconds: list[float] = []  # wall time of every step (data loading included)
        self.global_step = 0

    def _forward_losses(self, batch: dict) -> torch.Tensor:
        batch = {k: v.to(self.device) for k, v in batch.items()}
        counts = token_counts(batch["labels"], self.num_jobs)
        scale = 1.0
        if self.module is not self.model:
            # as the Trainer (average_tokens_across_devices): each job's loss is over its tokens on all ranks, times
            # the world size, which DDP's gradient average divides out again
            torch.distributed.all_reduce(counts)
            scale = float(torch.distributed.get_world_size())
        out = self.module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return per_job_loss(out.logits, batch["labels"], self.num_jobs, counts) * scale

    def step(self) -> list[float]:
        t0 = time.perf_counter()
        self.model.train()
        batch = stack_batches([next(j.batches) for j in self.jobs], self.pad_id)
        losses = self._forward_losses(batch)
        alive = torch.tensor(self.alive, device=losses.device)
        ok = torch.isfinite(losses.detach()) & alive
        torch.where(ok, losses, torch.zeros((), device=losses.device)).sum().backward()
        values = losses.detach().clone()
        if self.module is not self.model:  # each job's loss over all ranks' tokens
            torch.distributed.all_reduce(values)
            values /= torch.distributed.get_world_size()
        all_ok = bool(ok.all())
        for p in self.params if not all_ok else ():  # a stopped or failing job's gradient is dropped (NaN*0 is NaN)
            if p.grad is not None:
                keep = ok.view(-1, *([1] * (p.dim() - 1)))
                p.grad = torch.where(keep, p.grad, torch.zeros((), dtype=p.grad.dtype, device=p.grad.device))
        norms = self.optimizer.clip_grad_norm_(self.config.max_grad_norm)
        step_ok = ok & torch.isfinite(norms.to(ok.device))
        for k in range(self.num_jobs):
            if self.alive[k] and not bool(step_ok[k]):
                what = "loss" if not math.isfinite(float(values[k])) else "gradient norm"
                self.stopped[k] = dict(step=self.global_step + 1, reason=f"non-finite {what} ({float(values[k])})")
                self.alive[k] = False
        self.optimizer.step(self.schedules.lrs(), active=self.alive)
        self.schedules.step()
        self.optimizer.zero_grad()
        self.global_step += 1
        row = [float(v) if a else float("nan") for v, a in zip(values.tolist(), self.alive)]
        self.history.append(row)
        self.step_seconds.append(time.perf_counter() - t0)
        return row

    def train(self, progress: bool = True, desc: str = "fused jobs") -> list[list[float]]:
        with tqdm(total=self.max_steps, desc=desc, disable=not progress) as bar:
            while self.global_step < self.max_steps:
                row = self.step()
                bar.update(1)
                bar.set_postfix_str(
                    " ".join(
                        f"{self.jobs[k].name}={v:.3f}" if v == v else f"{self.jobs[k].name}=stopped"
                        for k, v in enumerate(row)
                    ),
                    refresh=False,
                )
        return self.history

    @torch.no_grad()
    def evaluate(self, batches_per_job: list[list[dict]]) -> list[dict]:
        """Each job's eval loss (the mean over its batches of the per-batch loss, weighted by rows, as the Trainer
        averages) and exact-match accuracy, on its own eval batches (lists of equal length)."""
        self.model.eval()
        k = self.num_jobs
        sums, rows, correct = [0.0] * k, [0] * k, [0.0] * k
        for group in zip(*batches_per_job):
            batch = stack_batches(list(group), self.pad_id)
            out = self.model(
                input_ids=batch["input_ids"].to(self.device), attention_mask=batch["attention_mask"].to(self.device)
            )
            losses = per_job_loss(out.logits, batch["labels"].to(self.device), k)
            preds = out.logits.argmax(-1).cpu().reshape(k, -1, batch["labels"].shape[1])
            labels = batch["labels"].reshape(k, -1, batch["labels"].shape[1])
            for j in range(k):
                n = labels.shape[1]
                sums[j] += float(losses[j]) * n
                rows[j] += n
                correct[j] += exact_match(preds[j].numpy(), labels[j].numpy()) * n
        return [dict(eval_loss=sums[j] / max(1, rows[j]), accuracy=correct[j] / max(1, rows[j])) for j in range(k)]


def measure_job_bytes(fused, batch: dict) -> dict:
    """Memory of one job in a fused step, measured on a one-job fused model: the bytes its step saves for backward
    (logits included) plus its trainable state (parameter, gradient and AdamW's two moments), and the shared frozen
    bytes. On CUDA the step's peak allocation is measured too and the larger figure is kept."""
    model = fused.model
    trainable = sum(p.numel() * p.element_size() for p in fused.parameters())
    seen, frozen = set(), 0
    for p in model.parameters():
        if not p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            frozen += p.numel() * p.element_size()
    device = next(iter(fused.parameters())).device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    counter = SavedTensorCounter(exclude=list(model.parameters()) + list(model.buffers()))
    with counter():
        out = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device))
        loss = per_job_loss(out.logits, batch["labels"].to(device), 1).sum()
    saved = counter.nbytes
    loss.backward()
    peak = (torch.cuda.max_memory_allocated() - start) if cuda else 0
    for p in fused.parameters():
        p.grad = None
    per_job = max(saved + 4 * trainable, peak + 3 * trainable)
    return dict(
        per_job_bytes=int(per_job), shared_bytes=int(frozen), saved_bytes=int(saved), trainable_bytes=int(trainable)
    )


def plan_groups(num_jobs: int, per_job_bytes: int, shared_bytes: int, config: FusedConfig) -> list[list[int]]:
    """Split job indices into fused groups that fit ``config``'s memory budget (see :class:`FusedConfig`)."""
    budget = config.budget_bytes()
    fit = (budget - shared_bytes) // max(1, per_job_bytes)
    gib = 2**30
    if fit < 1:
        raise FusedMemoryError(
            f"not even one job fits: the shared base takes {shared_bytes / gib:.2f} GiB and one job's "
            f"step {per_job_bytes / gib:.2f} GiB, the budget is {budget / gib:.2f} GiB; lower "
            "per_device_train_batch_size or the sequence length, or raise --fused.memory-budget."
        )
    if config.max_jobs_per_group is not None:
        fit = min(fit, config.max_jobs_per_group)
    if fit >= num_jobs:
        return [list(range(num_jobs))]
    if config.on_overflow == "error" and (config.max_jobs_per_group is None or fit < config.max_jobs_per_group):
        raise FusedMemoryError(
            f"{num_jobs} fused jobs would need about {(shared_bytes + num_jobs * per_job_bytes) / gib:.2f} "
            f"GiB; the budget is {budget / gib:.2f} GiB, so {int(fit)} fit at once. Use "
            "--fused.on-overflow split (groups run one after another), fewer jobs, or a larger "
            "--fused.memory-budget."
        )
    fit = int(fit)
    return [list(range(i, min(i + fit, num_jobs))) for i in range(0, num_jobs, fit)]
