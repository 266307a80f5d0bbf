"""Non-blocking SGD (He & Dube, arXiv 2211.00889) and a straggler injector.

Each rank splits its batch into micro-batches and, at every step, computes only the micro-batches it finishes by a
deadline (at least ``min_micro_batches``), so a slow rank contributes fewer samples instead of holding everyone up.
The gradients are accumulated as a sum with a count, and the update uses

    g = (Σ_ranks Σ_finished ∇ℓ_b) / (Σ_ranks count)

one all-reduce of ``[gradient sum, count]`` per step (``average="allreduce"``): every finished micro-batch gets the
same weight, so the average stays an unbiased estimate of the full-batch gradient. With ``average="local"`` each rank
averages its own finished micro-batches and a decentralized optimizer (D-PSGD, DecentLaM, ...) gossips in its
``step()``.

The deadline (``deadline="fastest"``): the time the fastest rank needs for a full batch, from each rank's running
estimate of its time per micro-batch, agreed with one scalar all-reduce (MIN) per step. Or a fixed number of seconds,
or ``None`` for the blocking baseline (every micro-batch, every step).

The model runs under DDP's ``no_sync()`` (or with DDP's ``noop_hook``); gradients are exchanged here once per step.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from hf_dtrain.errors import SettingsError

from ..distributed.counters import WireStats


class Straggler:
    """Injected slowness for tests and benchmarks: after a micro-batch that took ``seconds`` of compute, rank ``r``
    sleeps ``(slowdown[r] - 1) * seconds``, plus, if ``random_delay_s`` > 0, an exponential random delay of that mean
    (seeded per rank)."""

    def __init__(
        self, slowdown: dict[int, float] | None = None, random_delay_s: float = 0.0, rank: int = 0, seed: int = 0
    ):
        slowdown = dict(slowdown or {})
        for r, f in slowdown.items():
            if not f >= 1:
                raise SettingsError(
                    f"Straggler slowdown for rank {r} must be >= 1 (a factor on its compute time), got {f!r}."
                )
        if not random_delay_s >= 0:
            raise SettingsError(f"Straggler random_delay_s must be >= 0, got {random_delay_s!r}.")
        self.factor = float(slowdown.get(rank, 1.0))
        self.random_delay_s = random_delay_s
        self.rng = random.Random(seed * 7919 + rank)

    def after_compute(self, seconds: float) -> None:
        delay = (self.factor - 1.0) * seconds
        if self.random_delay_s:
            delay += self.rng.expovariate(1.0 / self.random_delay_s)
        if delay > 0:
            time.sleep(delay)


class NonBlockingSGD:
    """Runs one update per :meth:`step` from the micro-batches this rank finishes by the deadline.

    ``NonBlockingSGD(model, optimizer, deadline="fastest", average="allreduce")``; ``step(micro_batches)`` takes an
    iterable of model-kwargs dicts (with labels) and returns ``{"loss", "count", "total_count", "seconds"}``.
    ``history`` keeps those per step; ``stats`` the bytes this rank sends.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        deadline: str | float | None = "fastest",
        average: str = "allreduce",
        min_micro_batches: int = 1,
        straggler: Straggler | None = None,
        process_group=None,
        ema: float = 0.5,
    ):
        if average not in ("allreduce", "local"):
            raise SettingsError(
                f"NonBlockingSGD average must be 'allreduce' (one all-reduce of the gradient sums) or "
                f"'local' (a decentralized optimizer gossips), got {average!r}."
            )
        if not (deadline is None or deadline == "fastest" or (isinstance(deadline, (int, float)) and deadline > 0)):
            raise SettingsError(
                f"NonBlockingSGD deadline must be 'fastest', a positive number of seconds or None "
                f"(blocking), got {deadline!r}."
            )
        if not isinstance(min_micro_batches, int) or min_micro_batches < 1:
            raise SettingsError(f"NonBlockingSGD min_micro_batches must be an integer >= 1, got {min_micro_batches!r}.")
        if not dist.is_initialized() or dist.get_world_size(process_group) < 2:
            raise SettingsError(
                "NonBlockingSGD needs torch.distributed with >= 2 processes (world size 1 has no "
                "stragglers to wait for)."
            )
        self.model, self.optimizer = model, optimizer
        self.deadline, self.average, self.min_micro = deadline, average, min_micro_batches
        self.straggler, self.process_group, self.ema = straggler, process_group, ema
        self.per_micro: float | None = None  # this rank's running time per micro-batch (s)
        self.agreed_deadline: float | None = None
        self.stats = WireStats()
        self.history: list[dict] = []

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]

    def _no_sync(self):
        no_sync = getattr(self.model, "no_sync", None)
        return no_sync() if no_sync is not None else contextlib.nullcontext()

    def step(self, micro_batches: Iterable[dict]) -> dict:
        micro_batches = list(micro_batches)
        t0 = time.perf_counter()
        budget = self.deadline if isinstance(self.deadline, (int, float)) else self.agreed_deadline
        count, loss_sum = 0, 0.0
        with self._no_sync():
            for batch in micro_batches:
                if count >= self.min_micro and budget is not None and time.perf_counter() - t0 >= budget:
                    break
                start = time.perf_counter()
                loss = self.model(**batch).loss
                loss.backward()
                elapsed = time.perf_counter() - start
                if self.straggler is not None:
                    self.straggler.after_compute(elapsed)
                took = time.perf_counter() - start
                self.per_micro = took if self.per_micro is None else self.ema * took + (1 - self.ema) * self.per_micro
                loss_sum += loss.item()
                count += 1
        params = self._params()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        total = count
        if self.average == "allreduce":
            flat = torch.cat(
                [_flatten_dense_tensors(grads).float(), torch.tensor([float(count), loss_sum], dtype=torch.float32)]
            )
            self.stats.add(flat)
            dist.all_reduce(flat, group=self.process_group)
            total = round(float(flat[-2]))
            loss_sum = float(flat[-1])
            for p, g in zip(params, _unflatten_dense_tensors(flat[:-2] / total, grads)):
                p.grad = g.to(p.dtype)
        else:
            for p, g in zip(params, grads):
                p.grad = g / count
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.deadline == "fastest":  # the next step's deadline: the fastest rank's time for a full batch
            estimate = torch.tensor([self.per_micro * len(micro_batches)], dtype=torch.float64)
            dist.all_reduce(estimate, op=dist.ReduceOp.MIN, group=self.process_group)
            self.agreed_deadline = float(estimate)
        self.stats.end_step()
        record = {
            "loss": loss_sum / (total if self.average == "allreduce" else count),
            "count": count,
            "total_count": total,
            "seconds": time.perf_counter() - t0,
        }
        self.history.append(record)
        return record
