"""Which snapshot a relaunched job resumes from: the restore policy (:class:`Restorer`).

Newest step first that every rank can load: from the snapshot processes, else rebuilt from peers' parity (the
snapshot process does the rebuild when a rank opens a step it lacks), else the snapshot processes' snapshots of
another world size or layout resharded through a DCP checkpoint, else this rank's persisted copy on disk, else the
persisted DCP copy resharded onto another world size. A job that took snapshots and can restore none stops with what
was lost; another job's snapshots, or another world size's without a DCP copy, are refused naming what differs.
Every decision is agreed by all ranks (one small gloo collective each), so no rank is left waiting in a collective.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from typing import Any

import torch.distributed as dist
from safetensors import SafetensorError

from . import reshard
from .errors import SnapshotError, SnapshotMismatch, identity_diff
from .record import FRESH_START, write_private
from .state import parse, unflatten_state

logger = logging.getLogger("hf_dtrain.fault.snapshot")


@dataclasses.dataclass
class Restored:
    step: int
    # "memory", "parity", "disk", "memory-resharded" (the snapshot processes' snapshots of another world size or
    # layout, through a DCP checkpoint), "resharded" (the persisted DCP copy, ditto) or "completed"
    source: str
    extra: Any  # what was passed to snapshot(extra=...): the data position, trainer state
    detail: str = ""
    state: dict | None = dataclasses.field(default=None, repr=False)  # everything, with restore(apply=False)


class Restorer:
    """The restore policy of one rank. It receives everything it reads: ``ranks`` (votes), ``node`` (the snapshot
    process), ``record`` (identity, placement, run record), ``persister`` (the disk copies), ``copier`` (which learns
    the restored step) and ``loader`` (the engine: ``apply(state)``, ``apply_resharded(plan_dir, metadata, state)``,
    ``shard_map()``), and ``fresh_start``."""

    def __init__(self, ranks, node, record, persister, copier, loader, fresh_start: bool = False) -> None:
        self.ranks, self.node, self.record, self.persister = ranks, node, record, persister
        self.copier, self.loader, self.fresh_start = copier, loader, fresh_start

    def _restored(self, step: int, source: str, state: dict, detail: str, discard: int, where: str = "") -> Restored:
        """What every successful restore does: the snapshot process keeps the steps up to ``discard``, the run record
        is written again at the next commit, the copier knows the step; logged as restored from ``where`` (default
        ``source``)."""
        self.node.discard_after(discard)
        self.record.marked = False
        self.copier.last = (step, state["extra"])
        logger.warning("restored step %d from %s (%s)", step, where or source, detail)
        return Restored(step, source, state["extra"], detail, state)

    def restore(self, apply: bool = True) -> Restored | None:
        """Load the newest step every rank has (with ``apply=False`` the state is returned in ``Restored.state`` and
        nothing is loaded). ``None`` on a fresh start: nothing anywhere and no record of earlier snapshots, or
        ``fresh_start`` set. Raises ``SnapshotError`` when this job had snapshots but none can be restored (saying
        which copies were lost and what remains), ``SnapshotMismatch`` for a snapshot of another world size or another
        job (naming what differs). A job that already completed returns ``Restored(source="completed")``."""
        if self.fresh_start:
            self.start_fresh()
            return None
        ranks, marker = self.ranks, self.record.read_marker()
        steps, _, reason = self.node.available()
        reasons = [reason] if reason else []
        disk_steps = self.persister.steps()
        # lost: this rank committed snapshots (its record says so) and its snapshot process holds none now. Ranks that
        # all hold snapshots but share no step never finished a first one together: a fresh start is right.
        lost_here = marker is not None and not marker.get("completed") and not steps
        had_any = ranks.any(lost_here or bool(reason) or bool(disk_steps))
        found, other_world = self._from_memory(steps, apply, reasons)
        if found is None:
            found = self._memory_resharded(apply, reasons)
        if found is None:
            found = self._completed(marker)
        if found is not None:
            return found
        if reasons:
            logger.error("in-memory restore failed: %s; falling back to the disk snapshots", "; ".join(reasons))
        skipped: list[int] = []
        found = self._from_disk(disk_steps, apply, reasons, skipped)
        if found is not None:
            return found
        if other_world is not None:
            persisted = self.persister.directory
            raise SnapshotMismatch(
                f"This job's snapshots were taken on {other_world} and this run has {ranks.world}; in-memory snapshots "
                "load only into the world size and layout that took them, and no persisted DCP snapshot "
                f"{'exists in ' + persisted if persisted else 'is configured'} to reshard from. Relaunch as they were "
                "taken to resume from memory; set fault_tolerance.persist_every (and persist_dir, on storage every "
                f"node reads) so a later restart on another world size or layout can reshard; or train from step 0 "
                f"with {FRESH_START}."
            )
        if had_any or ranks.any(bool(reasons)):
            raise SnapshotError(self._lost_message(marker, reasons, skipped))
        return None

    def _from_memory(self, steps: list[int], apply: bool, reasons: list[str]) -> tuple[Restored | None, str | None]:
        """The newest step every rank's snapshot process holds and can load here; or, when those were taken on
        another world size or layout, ``(None, that world in words)``."""
        ranks, record = self.ranks, self.record
        for step in ranks.agree(steps):
            got, why = self.node.read(ranks.rank, step)
            if ranks.all(got is not None):
                if ranks.any(record.moved(got[0])):
                    theirs = int(got[0]["world_size"])
                    layout = identity_diff(record.placement_of(got[0]), record.placement)
                    other_world = f"{theirs} ranks" + (
                        "" if theirs != ranks.world else f" in another layout ({layout})"
                    )
                    logger.warning(
                        "the in-memory snapshots were taken on %s and this run has %d: they cannot be loaded here; "
                        "trying the persisted DCP snapshots, which reshard",
                        other_world,
                        ranks.world,
                    )
                    return None, other_world
                record.check_all(got[0], f"in memory at step {step}")
                metadata, tensors, rebuilt = got
                state = self._load(metadata, tensors, apply)
                used = "parity" if ranks.any(rebuilt) else "memory"
                detail = "rebuilt from peers' parity" if used == "parity" else "held by the snapshot processes"
                return self._restored(step, used, state, detail, step), None
            if why:
                reasons.append(why)
                logger.error("cannot use step %d from memory: %s", step, why)
        return None, None

    def _from_disk(self, disk_steps: list[int], apply: bool, reasons: list[str], skipped: list[int]):
        """The newest persisted step every rank can load: its DCP copy resharded when it was taken on another world
        size, else this rank's exact copy."""
        ranks, record = self.ranks, self.record
        for step in ranks.agree(disk_steps):
            resharded = self._resharded(step, apply, reasons)
            if resharded is not None:
                return resharded
            data, why = self.persister.read(step)
            if why:
                reasons.append(why)
            if ranks.all(data is not None):
                d = self.persister.step_dir(step)
                metadata, tensors = parse(data)
                if ranks.any(record.moved(metadata)):
                    # taken on another world size or layout and its DCP copy is incomplete (a host was lost while
                    # writing it): an older step's copy may reshard
                    layout = "" if int(metadata["world_size"]) != ranks.world else " in another layout"
                    why = (
                        f"the copy of step {step} was taken on {metadata['world_size']} ranks{layout} and its "
                        "resharding (DCP) copy is incomplete"
                    )
                    reasons.append(why)
                    skipped.append(step)
                    logger.error("%s; trying an older one", why)
                    continue
                record.check_all(metadata, f"on disk at {d}")
                state = self._load(metadata, tensors, apply)
                detail = f"{d}" + (f" (newer copies unusable: {'; '.join(reasons)})" if reasons else "")
                return self._restored(step, "disk", state, detail, -1)
            skipped.append(step)
            logger.error(
                "disk snapshot of step %d is unusable on some rank (%s); trying an older one",
                step,
                why or "another rank's copy",
            )
        return None

    def _load(self, metadata: dict, tensors: dict, apply: bool = True) -> dict:
        """The snapshot's state (its tensors are views into a private copy); with ``apply``, loaded in place."""
        state = unflatten_state(json.loads(metadata["skeleton"]), tensors)
        if apply:
            self.loader.apply(state)
        return state

    def _resharded(self, step: int, apply: bool, reasons: list[str], d: str | None = None, source: str = "resharded"):
        """Restore ``step`` from its DCP copy when it was taken on another world size (every rank agrees), loading
        the model's and optimizer's shards into this run's sharding; None when the step was taken on this world size
        (the exact per-rank copy is used) or has no complete DCP copy. A copy of another job, or one whose tensors do
        not map onto this model and optimizer, is refused on every rank naming what differs."""
        ranks = self.ranks
        d = d or self.persister.step_dir(step)
        path = os.path.join(d, reshard.REPLICATED)
        metadata, state, why = None, None, ""
        if os.path.exists(path):
            try:
                metadata, state = reshard.read_replicated(path)
            except (OSError, ValueError, KeyError, SafetensorError) as e:  # a damaged file: the step is not used
                # (only file and format errors: a programming error reading an intact one must not look like one)
                why = f"{path} cannot be read ({type(e).__name__}: {e})"
        if not ranks.any(metadata is not None and self.record.moved(metadata)):
            return None
        if not ranks.all(metadata is not None):
            reasons.append(why or f"{path} is missing on some rank")
            return None
        self.record.check_all(metadata, f"on disk at {d}", resharded=True)
        if apply:
            self.loader.apply_resharded(d, metadata, state)
        theirs = metadata["world_size"]
        detail = (
            f"{'the snapshot processes copy, through ' if source != 'resharded' else ''}{d}, taken on {theirs} ranks"
            f"{' in another layout' if int(theirs) == ranks.world else ''} and resharded onto {ranks.world} by "
            "torch.distributed.checkpoint"
        )
        return self._restored(step, source, state, detail, -1, "memory" if source != "resharded" else "disk")

    def _memory_resharded(self, apply: bool, reasons: list[str]) -> Restored | None:
        """A restart on another world size or layout, from the snapshot processes: when the nodes of this run hold,
        between them, every old rank's snapshot of one step (the newest such), each old rank's snapshot is written
        once, by a rank of a node that holds it, as its file of a DCP checkpoint (its shards at the global offsets it
        recorded) under ``persist_dir`` (storage every node reads), and loaded like a persisted copy: no step since
        the last persist is lost. None when they do not (the persisted copies are tried next) or nothing is
        persisted (no shared storage)."""
        ranks = self.ranks
        if not (ranks.distributed and self.persister.directory and self.loader.can_reshard):
            return None  # (without the optimizer its state in the snapshots has no names)
        shards = self.loader.shard_map()
        held: list = [None] * ranks.world
        dist.all_gather_object(held, self._moved_here() if shards is not None else [], group=ranks.group)
        holders: dict[tuple[int, int], dict[int, int]] = {}  # (step, old world) -> {old rank: the new rank to write it}
        for new_rank, items in enumerate(held):
            for rank, step, world in items:
                holders.setdefault((step, world), {}).setdefault(rank, new_rank)
        found = [(step, world) for (step, world), got in holders.items() if set(range(world)) <= set(got)]
        if not found:
            return None
        step, world = max(found)
        d = os.path.join(self.persister.directory, f"memory-{step}")
        try:
            if ranks.rank == 0:
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(os.path.join(d, reshard.DCP_DIR), mode=0o700)
            ranks.barrier()
            if not self._write_old_ranks(shards, holders[(step, world)], step, d, reasons):
                return None
            logger.warning(
                "the snapshot processes hold every one of the %d old ranks' snapshots of step %d: resharding them "
                "onto %d ranks",
                world,
                step,
                ranks.world,
            )
            return self._resharded(step, apply, reasons, d=d, source="memory-resharded")
        finally:
            ranks.barrier()
            if ranks.rank == 0:
                shutil.rmtree(d, ignore_errors=True)

    def _moved_here(self) -> list[tuple[int, int, int]]:
        """``(old rank, step, world size)`` of this job's snapshots of another world size or layout this node holds."""
        mine = []
        for rank, steps in self.node.held().items():
            for step in steps:
                meta = self.node.header(int(rank), int(step))
                if meta and "offsets" in meta and self.record.moved(meta) and self.record.same_job(meta):
                    mine.append((int(rank), int(step), int(meta["world_size"])))
        return mine

    def _write_old_ranks(self, shards, assigned: dict[int, int], step: int, d: str, reasons: list[str]) -> bool:
        """This rank writes the old ranks' snapshots it was assigned as DCP files (rank 0's also as the replicated
        part, after every shard file: its presence marks the copy complete); False, on every rank, when any failed."""
        ranks, failed, replicated = self.ranks, "", None
        for rank, writer in sorted(assigned.items()):
            if writer != ranks.rank or failed:
                continue
            # any error here is this rank's vote below, never an exception that would leave the others in the
            # collective
            try:
                got, why = self.node.read(rank, step)
                if got is None:
                    failed = why
                    continue
                metadata, tensors, _ = got
                state = unflatten_state(json.loads(metadata["skeleton"]), tensors)
                chunks = shards.chunks(state, json.loads(metadata["offsets"]), whole=rank == 0)
                path = os.path.join(d, reshard.DCP_DIR, f"shard-{rank:05d}.safetensors")
                reshard.write_chunks(path, chunks, write_private)
                if rank == 0:
                    keep = {k: metadata[k] for k in ("step", "world_size", "placement", "fingerprint", "identity")}
                    replicated = (shards.replicated(state), keep)
            except Exception as e:
                failed = (
                    f"old rank {rank}'s snapshot of step {step} could not be written as a DCP file "
                    f"({type(e).__name__}: {e})"
                )
        if ranks.any(bool(failed)):
            reasons.append(failed or "another rank could not read an old rank's snapshot")
            return False
        if assigned[0] == ranks.rank:
            reshard.write_replicated(os.path.join(d, reshard.REPLICATED), *replicated, write_private)
        ranks.barrier()
        return True

    def _completed(self, marker: dict | None) -> Restored | None:
        """A relaunch after the job finished (its snapshot processes shut down): the completed record, agreed by every
        rank, or None."""
        record = self.record
        done = bool(marker) and marker.get("completed") is True and marker.get("identity_hash") == record.identity_hash
        if not self.ranks.all(done):
            return None
        logger.warning("this job already completed at step %s; nothing to resume", marker.get("last_step"))
        step = marker.get("last_step")
        return Restored(
            int(step or 0), "completed", marker.get("extra"), f"the job completed at step {step} ({record.marker})"
        )

    def _lost_message(self, marker: dict | None, reasons: list[str], skipped: list[int]) -> str:
        node, record = self.node, self.record
        parts = [
            f"This job took snapshots (rank {self.ranks.rank}, node {self.ranks.node}: {node.dir}) but none can be "
            "restored, so it will not silently start over."
        ]
        if marker and marker.get("identity_hash") not in (None, record.identity_hash):
            parts.append(
                f"They belonged to another job ({identity_diff(marker.get('identity', {}), record.identity)})."
            )
        exited = os.path.join(node.dir, "exited.json")
        if os.path.exists(exited):
            try:
                parts.append(f"Node {self.ranks.node}'s snapshot process exited: {json.load(open(exited))['reason']}.")
            except (OSError, ValueError, KeyError):
                pass
        elif node.started is not None and marker is not None:
            parts.append(
                f"Node {self.ranks.node}'s snapshot process was lost (a new one was started by this launch), and its "
                "snapshots with it."
            )
        if reasons:
            parts.append("Lost or unusable: " + "; ".join(reasons) + ".")
        if skipped:
            parts.append(f"Disk snapshots of steps {skipped} are not usable on every rank.")
        elif not self.persister.directory:
            parts.append("No disk copy to fall back to (set fault_tolerance.persist_dir and persist_every).")
        else:
            parts.append(f"No disk snapshot in {self.persister.directory}.")
        parts.append(f"To train from step 0, relaunch with {FRESH_START}.")
        return " ".join(parts)

    def start_fresh(self) -> None:
        """``fresh_start``: drop this job's snapshots (memory, the record of them) and move its disk snapshots aside
        to ``<persist_dir>.discarded-<time>`` (kept, never read again), on every rank, then train from 0."""
        self.node.discard_after(-1)
        self.record.forget()
        aside = self.persister.set_aside()
        if aside:
            logger.warning("fresh start: the disk snapshots moved to %s", aside)
        self.ranks.barrier()
        logger.warning("fresh start (fault_tolerance.fresh_start): this job's earlier snapshots are discarded")
