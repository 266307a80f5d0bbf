"""The snapshot engine: at a step boundary, each rank's training state goes into a host-memory slot owned by its node's
snapshot process (``smp.py``), copied by a background thread that overlaps the next forward and backward and is
awaited before the next optimizer step; then committed with a checksum. ``restore()`` brings the newest step every
rank can load back: from the snapshot processes, else rebuilt from peers' parity, else from the last snapshot
persisted to disk, and says which it used.

:class:`SnapshotEngine` puts together the parts, each its own object: where this rank stands (``ranks.py``), the
job's identity, placement and run record (``record.py``), the node's snapshot process (``node.py``), the copy into
its slots (``copier.py``), the disk copies (``persist.py``) and the restore policy (``restore.py``). What each layout
stores and how it loads in place is the layout's :class:`~hf_dtrain.fault.source.SnapshotSource` (``source.py``:
DDP replicas, FSDP2 shards, DTensor layouts, pipeline stages; ``zero.py``: DeepSpeed ZeRO partitions); the DCP copy
that reshards onto another world size or layout: ``reshard.py``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from hf_dtrain.errors import SettingsError

from . import reshard
from .config import SnapshotConfig
from .copier import SnapshotCopier
from .errors import SnapshotError, SnapshotMismatch
from .node import NodeProcess, default_directory
from .persist import Persister
from .preempt import Preemption, signal_name
from .ranks import Ranks
from .record import FRESH_START, RunRecord, clean_temporaries, fingerprint_of, identity_of
from .restore import Restored, Restorer
from .source import source_for
from .state import set_rng_state

__all__ = ["Restored", "SnapshotEngine", "SnapshotError", "SnapshotMismatch", "default_directory", "job_key_for"]

logger = logging.getLogger(__name__)


def job_key_for(output_dir: str) -> str:
    """The default snapshot directory name of a job writing to ``output_dir`` (its absolute path, hashed)."""
    return "out-" + hashlib.sha256(os.path.abspath(output_dir).encode()).hexdigest()[:16]


@dataclass
class Parts:
    """What a snapshot holds: the model, the optimizer, scheduler and scaler (the Trainer hands the last ones over
    after the engine is built), and the ``stateful`` objects (``state_dict`` / ``load_state_dict``)."""

    model: nn.Module
    optimizer: Any = None
    scheduler: Any = None
    scaler: Any = None
    stateful: dict = field(default_factory=dict)


class SnapshotEngine:
    """In-memory snapshots for one rank.

    ``snapshot_hooks``: callables ``hook(engine, step)`` run after each ``snapshot()`` has started its copy (metrics, or
    the fault injector of :mod:`hf_dtrain.testing.fault`); an engine starts with the class-wide
    ``default_snapshot_hooks``.

    ``engine.snapshot(step, extra)`` after ``optimizer.step()`` (and the scheduler's), ``engine.wait()`` before the
    next ``optimizer.step()``; ``engine.restore()`` at start-up. ``extra``: JSON-able or tensor state you want back
    (the data position). ``stateful``: more objects with ``state_dict()`` / ``load_state_dict()`` to keep (a
    communication hook's state: error feedback); their ``state_dict()`` must return copies of anything that changes
    before the next optimizer step. With a frozen base (PEFT), only trainable parameters are stored. A snapshot process
    with no trainer connected for ``idle_exit`` seconds exits (the job is gone), so crashed jobs do not hold memory.
    """

    default_snapshot_hooks: ClassVar[list] = []

    def __init__(
        self,
        model: nn.Module,
        optimizer=None,
        scheduler=None,
        scaler=None,
        config=None,
        *,
        stateful: dict | None = None,
        process_group=None,
        identity: dict | None = None,
        job_key: str | None = None,
        placement: dict | None = None,
        **settings,
    ):
        self.config = config = SnapshotConfig.from_any(config, **settings)
        if config.persist_every and not config.persist_dir:
            raise SettingsError(
                "SnapshotConfig.persist_every > 0 needs persist_dir (where every N-th snapshot is written); set "
                "fault_tolerance.persist_dir."
            )
        for name, obj in (stateful or {}).items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"stateful[{name!r}] ({type(obj).__name__}) needs state_dict() and load_state_dict()")
        # what the snapshot holds of this layout and how it loads in place (source.py)
        self.source = source_for(model, optimizer, config.trainable_only)
        self.parts = Parts(model, optimizer, scheduler, scaler, dict(stateful or {}))
        self.snapshot_hooks: list = list(type(self).default_snapshot_hooks)
        self.ranks = Ranks(process_group, config.timeout, config.parity, config.group_size)
        fingerprint = fingerprint_of(self.source)
        job = identity_of(identity or {}, fingerprint, model, optimizer, scheduler)
        self.record = RunRecord(job, fingerprint, placement, self.ranks)
        self.persister = Persister(
            config.persist_dir,
            config.persist_every,
            self.ranks,
            self.record,
            process_group,
            config.timeout,
            on_notice=config.preempt_deadline > 0,
        )
        base = config.directory or default_directory(job_key or f"job-{self.record.identity_hash}")
        self.node = NodeProcess(base, self.ranks, config.timeout, config.idle_exit)
        self.record.marker = os.path.join(self.node.dir, f"run-rank{self.ranks.rank}.json")
        if self.ranks.first_on_node:  # what a writer killed midway left (no snapshot is being written now)
            clean_temporaries(self.node.dir)
        self.node.configure()
        self.copier = SnapshotCopier(self.parts, self.source, self.ranks, self.node, self.record, self.persister)
        self.restorer = Restorer(
            self.ranks, self.node, self.record, self.persister, self.copier, self, fresh_start=config.fresh_start
        )
        self._step_hook = self.source.guard_step(self.wait)  # removed again by close()
        # SIGTERM / SIGUSR1 as a preemption notice (preempt.py); closed by close()
        self.preemption = None
        if config.preempt_deadline:
            self.preemption = Preemption(self.ranks, config.preempt_deadline, self._saved)

    # ---- what users and the callback read ------------------------------------------------------------------------
    model = property(lambda self: self.parts.model)
    stateful = property(lambda self: self.parts.stateful)
    rank = property(lambda self: self.ranks.rank)
    world = property(lambda self: self.ranks.world)
    node_id = property(lambda self: self.ranks.node)
    dir = property(lambda self: self.node.dir)
    base = property(lambda self: self.node.base)
    key = property(lambda self: self.node.key)
    client = property(lambda self: self.node.client)
    respawns = property(lambda self: self.node.respawns)
    idle_exit = property(lambda self: self.config.idle_exit)
    persist_dir = property(lambda self: self.persister.directory)
    trainable_only = property(lambda self: self.source.trainable_only)
    identity = property(lambda self: self.record.identity)
    stats = property(lambda self: self.copier.stats)

    # the optimizer and scheduler a callback attaches once the Trainer made them
    optimizer = property(lambda self: self.parts.optimizer, lambda self, value: setattr(self.parts, "optimizer", value))
    scheduler = property(lambda self: self.parts.scheduler, lambda self, value: setattr(self.parts, "scheduler", value))

    def available(self) -> tuple[list[int], str, str]:
        """The steps this rank's snapshots are held for, where from, and why not when none are."""
        return self.node.available()

    # ---- snapshots -----------------------------------------------------------------------------------------------
    def snapshot(self, step: int, extra: Any = None) -> None:
        """Start a snapshot of the state after ``step``: what the next step changes is captured now, the rest
        collected and copied in the background. The previous snapshot is awaited first (one in flight at a time)."""
        self.wait()  # (through the engine: a fault injector may stand in for it)
        self.copier.start(step, extra)
        for hook in self.snapshot_hooks:
            hook(self, step)

    def wait(self) -> None:
        """Block until the snapshot in flight is committed (call before the next optimizer step)."""
        self.copier.wait()

    # ---- preemption notices -------------------------------------------------------------------------------------
    def notice(self) -> int:
        """At every step boundary, on every rank: the preemption signal any rank got (0: none; one small all-reduce).
        When it is not 0, call :meth:`stop_for_notice` with this step (the Trainer callback and the jobs do)."""
        return self.preemption.agree() if self.preemption is not None else 0

    def stop_for_notice(self, step: int, extra: Any, signum: int) -> None:
        """Every rank got (or learnt of) a preemption notice: the snapshot of ``step`` (taken now unless it is the
        newest), written to ``persist_dir``, a line saying where and how to resume, and the exit (status 128 +
        ``signum``). Does not return."""
        t0 = time.monotonic()
        self.wait()
        if self.copier.committed is None or self.copier.committed[0] != step:
            self.snapshot(step, extra)
            self.wait()
        where = "the snapshot processes' memory only (no fault_tolerance.persist_dir: it goes with this node)"
        if self.persister.directory:
            data = self.copier.committed_bytes(step)
            if data is None:
                raise SnapshotError(f"rank {self.rank}: the snapshot of step {step} is not in its slot any more")
            where = self.persister.write_now(step, *data)
        self.ranks.barrier()  # every rank's copy is written: the step is complete on disk
        since = self.preemption.elapsed() if self.preemption is not None else 0.0
        megabytes = self.copier.stats["bytes"] / 1e6
        line = (
            f"hf_dtrain: rank {self.rank} (host {socket.gethostname()}) stopped for {signal_name(signum)} (a "
            f"preemption notice) after step {step}, saved {megabytes:.1f} MB to {where} in "
            f"{time.monotonic() - t0:.2f} s ({since:.2f} s after the signal); relaunch the same command to resume at "
            f"step {step + 1}."
        )
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.write(line + "\n")  # one write: the ranks' lines do not interleave
            sys.stderr.flush()
        os._exit(128 + signum)

    def _saved(self) -> str:
        """The newest saved step, in words (for a rank that exits without saving)."""
        last = self.copier.committed[0] if self.copier.committed else None
        disk = self.persister.steps()
        return (
            f"The newest snapshot in memory is of step {last}" if last is not None else "No snapshot in memory yet"
        ) + (f"; on disk, step {disk[-1]} ({self.persister.directory})." if disk else ".")

    # ---- restoring -----------------------------------------------------------------------------------------------
    def restore(self, apply: bool = True) -> Restored | None:
        """Load the newest step every rank has (see :class:`~hf_dtrain.fault.restore.Restorer`)."""
        return self.restorer.restore(apply)

    def apply(self, state: dict) -> None:
        """A restored state, loaded in place: the model, the optimizer, the rest; then what the layout does once
        everything is loaded."""
        self.apply_model(state)
        self.apply_optimizer(state)
        self.apply_rest(state)
        self.rebuild_ddp_buckets()

    def rebuild_ddp_buckets(self) -> None:
        """What the layout does once everything is loaded (``SnapshotSource.after_restore``): a DDP model (passed
        wrapped) rebuilds its buckets before the first step after the restore, so that step reduces as the
        uninterrupted run's did (``hf_dtrain.fault.ddp``)."""
        self.source.after_restore()

    def apply_model(self, state: dict) -> None:
        """The restored model state, loaded in place by the layout's source (``source.py``): FSDP2's local shards,
        DDP's replicas, a pipeline rank's stages, the trainable parameters of a PEFT model, DeepSpeed's ZeRO
        partitions. Every rank calls it (ZeRO-3's load is collective; a snapshot that does not fit is refused on
        every rank)."""
        why = self.source.check(state)
        if self.ranks.any(why is not None):
            raise SnapshotMismatch(
                f"The snapshot does not fit this run's {self.source.kind} state: {why or 'see the other ranks'}. "
                f"Resume it with the model, settings and world size that took it, or train from step 0 with "
                f"{FRESH_START}."
            )
        self.source.load(state)

    def apply_optimizer(self, state: dict) -> None:
        """The restored optimizer state, loaded into the optimizer (an FSDP2 parameter's state as DTensor shards
        again; ZeRO's came with the partitions)."""
        self.source.load_optimizer(state, self.parts.optimizer)

    def _apply_schedule(self, state: dict) -> None:
        """The scheduler, the scaler and the RNG streams."""
        parts = self.parts
        if parts.scheduler is not None and "scheduler" in state:
            parts.scheduler.load_state_dict(state["scheduler"])
        if parts.scaler is not None and "scaler" in state:
            parts.scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"])

    def apply_rest(self, state: dict) -> None:
        """The scheduler, scaler, RNGs and ``stateful`` objects."""
        self._apply_schedule(state)
        for name, obj in self.parts.stateful.items():
            if name in state.get("stateful", {}):
                obj.load_state_dict(state["stateful"][name])

    @property
    def can_reshard(self) -> bool:
        """Snapshots of another world size reshard into this run only with the optimizer (its state has no names
        without it)."""
        return self.parts.optimizer is not None

    def shard_map(self):
        try:
            return self.source.shard_map(self.parts.optimizer)
        except ValueError:
            return None

    def apply_resharded(self, d: str, metadata: dict, state: dict) -> None:
        """A DCP copy of another world size or layout (under ``d``) loaded into this run's sharding: the model's and
        optimizer's shards, the scheduler and scaler, rank 0's RNG streams (the old ranks' do not map onto the new
        ranks); per-rank ``stateful`` state starts afresh."""
        path = os.path.join(d, reshard.DCP_DIR)
        plan, problems = self.source.reshard_plan(path, self.parts.optimizer)
        if self.ranks.any(bool(problems)):
            raise SnapshotMismatch(
                f"The snapshot on disk at {d} (taken on {metadata['world_size']} ranks) does not map onto this model "
                f"and optimizer: {'; '.join(problems[:6]) or 'see the other ranks'}"
                f"{f' (and {len(problems) - 6} more)' if len(problems) > 6 else ''}. Resume it with the model and "
                f"optimizer that took it, or train from step 0 with {FRESH_START}."
            )
        self.source.load_resharded(plan, path, state, self.parts.optimizer)
        self._apply_schedule(state)
        self.rebuild_ddp_buckets()
        parts = self.parts
        if parts.stateful:
            logger.warning(
                "restored on another world size: %s start afresh (their per-rank state, such as error feedback, does "
                "not map onto the new ranks)",
                ", ".join(parts.stateful),
            )

    # ---- the end -------------------------------------------------------------------------------------------------
    def close(self, shutdown: bool = False) -> None:
        """Finish the snapshot in flight; with ``shutdown`` (the run is over) record the job as completed and stop the
        node's snapshot process."""
        self.wait()
        if self.preemption is not None:
            self.preemption.close()
            self.preemption = None
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        self.copier.close()
        self.persister.join()
        if shutdown:
            self.ranks.barrier()
            step, extra = self.copier.last or (0, None)
            self.record.mark_completed(step, extra)
            self.ranks.barrier()
            if self.ranks.first_on_node:
                self.node.shutdown()
        self.node.close()
        self.persister.raise_error()  # the last persisted write failed: the run fails, after its cleanup
