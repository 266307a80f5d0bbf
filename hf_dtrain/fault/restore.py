"""Which snapshot a relaunched job resumes from, and loading it: the restore policy of
:class:`~hf_dtrain.fault.SnapshotEngine` (a mixin it inherits; the engine holds the state these methods use).

Newest step first that every rank can load: from the snapshot processes, else rebuilt from peers' parity (the
snapshot process does the rebuild when a rank opens a step it lacks), else this rank's persisted copy on disk, else
the persisted DCP copy resharded onto another world size. A job that took snapshots and can restore none stops with
what was lost; another job's snapshots, or another world size's without a DCP copy, are refused naming what differs.
Every decision is agreed by all ranks (one small gloo collective each), so no rank is left waiting in a collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import struct
import time
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError

from hf_dtrain.errors import UserError

from . import reshard
from .state import parse, set_rng_state, unflatten_state
from .wire import checksum

logger = logging.getLogger("hf_dtrain.fault.snapshot")


class SnapshotError(UserError, RuntimeError):
    """A run whose snapshots exist but cannot be restored (and no disk copy to fall back to)."""


class SnapshotMismatch(UserError, ValueError):
    """A snapshot of another job or world size: not resumed (the message names what differs and the way out)."""


FRESH_START = "--fault-tolerance.fresh-start true (YAML fault_tolerance: {fresh_start: true})"


@dataclasses.dataclass
class Restored:
    step: int
    # "memory", "parity", "disk", "memory-resharded" (the snapshot processes' snapshots of another world size or
    # layout, through a DCP checkpoint), "resharded" (the persisted DCP copy, ditto) or "completed"
    source: str
    extra: Any  # what was passed to snapshot(extra=...): the data position, trainer state
    detail: str = ""
    state: dict | None = dataclasses.field(default=None, repr=False)  # everything, with restore(apply=False)


def _flatten(d: Any, prefix: str = "") -> dict:
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): d}


def identity_diff(theirs: dict, ours: dict, limit: int = 6) -> str:
    """The settings that differ between two run identities, as ``key: theirs -> ours``."""
    a, b = _flatten(theirs), _flatten(ours)
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    parts = [f"{k}: {a.get(k, '(absent)')!r} there, {b.get(k, '(absent)')!r} here" for k in keys[:limit]]
    return "; ".join(parts) + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")


class RestorePolicy:
    """The restore half of :class:`~hf_dtrain.fault.SnapshotEngine` (see the module's docstring)."""

    def _disk_steps(self) -> list[int]:
        """Steps with a disk snapshot of this rank (``snapshot-<step>/rank<r>.json``) or a complete DCP copy
        (``snapshot-<step>/replicated.safetensors``); other names are ignored."""
        if not self.persist_dir or not os.path.isdir(self.persist_dir):
            return []
        steps = []
        for name in os.listdir(self.persist_dir):
            number = name[len("snapshot-") :]
            if (
                name.startswith("snapshot-")
                and number.isdigit()
                and any(
                    os.path.exists(os.path.join(self.persist_dir, name, f))
                    for f in (f"rank{self.rank}.json", "replicated.safetensors")
                )
            ):
                steps.append(int(number))
        return sorted(steps)

    def _read_disk(self, step: int) -> tuple[Any | None, str]:
        """This rank's disk snapshot of ``step`` as bytes, checked against its manifest, or ``(None, why)``."""
        d = os.path.join(self.persist_dir, f"snapshot-{step}")
        path = os.path.join(d, f"rank{self.rank}.json")
        try:
            with open(path) as f:
                manifest = json.load(f)
            nbytes, digest = int(manifest["nbytes"]), str(manifest["checksum"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            return None, f"{path} is damaged ({type(e).__name__}: {e})"
        data_path = os.path.join(d, f"rank{self.rank}.safetensors")
        try:
            if os.path.getsize(data_path) < nbytes:
                return None, f"{data_path} is truncated ({os.path.getsize(data_path)} of {nbytes} bytes)"
            data = torch.from_file(data_path, size=nbytes, dtype=torch.uint8).numpy()  # a private mapping
        except (RuntimeError, OSError) as e:
            return None, f"{data_path} cannot be read ({e})"
        if checksum(data) != digest:
            return None, f"{data_path} fails its checksum (a corrupted byte)"
        return data, ""

    def _agree(self, steps: list[int]) -> list[int]:
        """The steps every rank has, newest first."""
        if not self.distributed:
            return sorted(steps, reverse=True)
        buf = torch.full((64,), -1, dtype=torch.int64)
        mine = sorted(steps)[-64:]
        buf[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
        out = [torch.zeros_like(buf) for _ in range(self.world)]
        dist.all_gather(out, buf, group=self.group)
        common = {int(s) for s in out[0].tolist() if s >= 0}
        for t in out[1:]:
            common &= {int(s) for s in t.tolist() if s >= 0}
        return sorted(common, reverse=True)

    def _vote(self, flag: bool, every: bool) -> bool:
        """``flag`` on every rank (``every``) or on any rank: one all-reduce of 0/1 (MIN or MAX)."""
        if not self.distributed:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN if every else dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def _all(self, flag: bool) -> bool:
        return self._vote(flag, every=True)

    def _any(self, flag: bool) -> bool:
        return self._vote(flag, every=False)

    def _placement_of(self, metadata: dict) -> dict:
        """The placement a snapshot was taken with (``{}`` for one written before placements were recorded)."""
        return json.loads(metadata.get("placement") or "{}")

    def _moved(self, metadata: dict) -> bool:
        """The snapshot was taken on another world size or placement: it does not load rank by rank."""
        return int(metadata["world_size"]) != self.world or self._placement_of(metadata) != self.placement

    def _check_all(self, metadata: dict, where: str, resharded: bool = False) -> None:
        """``_check`` on every rank at once: a mismatch anywhere is a ``ValueError`` everywhere (no rank is left
        waiting in a collective)."""
        problem = None
        try:
            self._check(metadata, where, resharded)
        except ValueError as e:
            problem = e
        if self._any(problem is not None):
            raise problem or SnapshotMismatch(
                f"another rank's snapshot {where} does not match this run (see its error)"
            )

    def _check(self, metadata: dict, where: str, resharded: bool = False) -> None:
        """``metadata`` is this job's, taken on this world size and placement; with ``resharded`` (a DCP copy read
        into this run's sharding) the world size and placement may differ, and the parameter fingerprint is left
        to the copy's own check of every name and shape (``reshard.differences``)."""
        if not resharded and int(metadata["world_size"]) != self.world:
            raise SnapshotMismatch(
                f"The snapshot {where} was taken with world size {metadata['world_size']}; this run "
                f"has {self.world}. Restart with the same number of processes, or set "
                "fault_tolerance.persist_every so that a restart on another world size reshards "
                "the newest persisted DCP snapshot."
            )
        if not resharded and self._placement_of(metadata) != self.placement:
            raise SnapshotMismatch(
                f"The snapshot {where} was taken with another layout "
                f"({identity_diff(self._placement_of(metadata), self.placement)}). Restart with "
                "the same layout, or set fault_tolerance.persist_every so that a restart on "
                "another layout reshards the newest persisted DCP snapshot."
            )
        theirs = json.loads(metadata.get("identity") or "{}")
        ours = self.identity
        if resharded:
            theirs, ours = ({k: v for k, v in i.items() if k != "parameters"} for i in (theirs, ours))
        if theirs != ours:
            raise SnapshotMismatch(
                f"The snapshot {where} belongs to another job: "
                f"{identity_diff(theirs, ours)}. This run does not resume it. To train "
                f"this job from step 0 and discard those snapshots, relaunch with "
                f"{FRESH_START}; to keep them, give this job its own fault_tolerance.directory "
                "(or output directory)."
            )

    def _load(self, metadata: dict, tensors: dict[str, torch.Tensor], apply: bool = True) -> dict:
        """The snapshot's state (its tensors are views into a private copy of the slot); with ``apply``, loaded into
        the model, optimizer, scheduler, scaler and RNGs."""
        state = unflatten_state(json.loads(metadata["skeleton"]), tensors)
        if apply:
            self._apply(state)
        return state

    def _apply(self, state: dict) -> None:
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
        if self._any(why is not None):
            raise SnapshotMismatch(
                f"The snapshot does not fit this run's {self.source.kind} state: "
                f"{why or 'see the other ranks'}. Resume it with the model, settings and world "
                f"size that took it, or train from step 0 with {FRESH_START}."
            )
        self.source.load(state)

    def apply_optimizer(self, state: dict) -> None:
        """The restored optimizer state, loaded into ``self.optimizer`` (an FSDP2 parameter's state as DTensor
        shards again; ZeRO's came with the partitions)."""
        self.source.load_optimizer(state, self.optimizer)

    def apply_rest(self, state: dict) -> None:
        """The scheduler, scaler, RNGs and ``stateful`` objects."""
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"])
        for name, obj in self.stateful.items():
            if name in state.get("stateful", {}):
                obj.load_state_dict(state["stateful"][name])

    def available(self) -> tuple[list[int], str, str]:
        reply, _ = self.client.call({"op": "available", "rank": self.rank})
        return reply["steps"], reply["source"], reply.get("reason", "")

    def restore(self, apply: bool = True) -> Restored | None:
        """Load the newest step every rank has: from memory, else rebuilt from parity, else from disk (with
        ``apply=False`` the state is returned in ``Restored.state`` and nothing is loaded). Returns ``None`` on a
        fresh start: nothing anywhere and no record of earlier snapshots, or ``fresh_start`` set. Raises
        ``SnapshotError`` when this job had snapshots but none can be restored (saying which copies were lost and
        what remains), ``ValueError`` for a snapshot of another world size or another job (naming what differs).
        A job that already completed returns ``Restored(source="completed")`` with the extra of its last step."""
        if self.config.fresh_start:
            self._start_fresh()
            return None
        marker = self._read_marker()
        steps, _source, reason = self.available()
        reasons = [reason] if reason else []
        disk_steps = self._disk_steps()
        # lost: this rank committed snapshots (its record says so) and its snapshot process holds none now. Ranks
        # that all hold snapshots but share no step never finished a first one together: a fresh start is right.
        lost_here = marker is not None and not marker.get("completed") and not steps
        had_any = self._any(lost_here or bool(reason) or bool(disk_steps))
        other_world = None  # in words, the world size or layout of in-memory snapshots that cannot load here
        for step in self._agree(steps):
            got, why = self._read_snapshot(self.rank, step)
            if self._all(got is not None):
                if self._any(self._moved(got[0])):
                    theirs = int(got[0]["world_size"])
                    other_world = f"{theirs} ranks" + (
                        ""
                        if theirs != self.world
                        else f" in another layout ({identity_diff(self._placement_of(got[0]), self.placement)})"
                    )
                    logger.warning(
                        "the in-memory snapshots were taken on %s and this run has %d: they cannot be "
                        "loaded here; trying the persisted DCP snapshots, which reshard",
                        other_world,
                        self.world,
                    )
                    break
                self._check_all(got[0], f"in memory at step {step}")
                metadata, tensors, rebuilt = got
                state = self._load(metadata, tensors, apply)
                used = "parity" if self._any(rebuilt) else "memory"
                self._discard_after(step)
                self._marked = False  # written again at the next commit
                self._last = (step, state["extra"])
                detail = "rebuilt from peers' parity" if used == "parity" else "held by the snapshot processes"
                logger.warning("restored step %d from %s (%s)", step, used, detail)
                return Restored(step, used, state["extra"], detail, state)
            if why:
                reasons.append(why)
                logger.error("cannot use step %d from memory: %s", step, why)
        resharded = self._try_memory_resharded(apply, reasons)
        if resharded is not None:
            return resharded
        completed = self._completed(marker)
        if completed is not None:
            return completed
        if reasons:
            logger.error("in-memory restore failed: %s; falling back to the disk snapshots", "; ".join(reasons))
        skipped = []
        for step in self._agree(disk_steps):
            resharded = self._try_resharded(step, apply, reasons)
            if resharded is not None:
                return resharded
            data, why = self._read_disk(step)
            if why:
                reasons.append(why)
            if self._all(data is not None):
                d = os.path.join(self.persist_dir, f"snapshot-{step}")
                metadata, tensors = parse(data)
                if self._any(self._moved(metadata)):
                    # taken on another world size or layout and its DCP copy is incomplete (a host was lost while
                    # writing it): an older step's copy may reshard
                    why = (
                        f"the copy of step {step} was taken on {metadata['world_size']} ranks"
                        f"{'' if int(metadata['world_size']) != self.world else ' in another layout'} and its "
                        "resharding (DCP) copy is incomplete"
                    )
                    reasons.append(why)
                    skipped.append(step)
                    logger.error("%s; trying an older one", why)
                    continue
                self._check_all(metadata, f"on disk at {d}")
                state = self._load(metadata, tensors, apply)
                self._discard_after(-1)
                self._marked = False
                self._last = (step, state["extra"])
                detail = f"{d}" + (f" (newer copies unusable: {'; '.join(reasons)})" if reasons else "")
                logger.warning("restored step %d from disk (%s)", step, detail)
                return Restored(step, "disk", state["extra"], detail, state)
            skipped.append(step)
            logger.error(
                "disk snapshot of step %d is unusable on some rank (%s); trying an older one",
                step,
                why or "another rank's copy",
            )
        if other_world is not None:
            raise SnapshotMismatch(
                f"This job's snapshots were taken on {other_world} and this run has {self.world}; in-memory "
                "snapshots load only into the world size and layout that took them, and no persisted DCP snapshot "
                f"{'exists in ' + self.persist_dir if self.persist_dir else 'is configured'} to reshard from. "
                f"Relaunch as they were taken to resume from memory; set fault_tolerance.persist_every (and "
                "persist_dir, on storage every node reads) so a later restart on another world size or layout "
                "can reshard; "
                f"or train from step 0 with {FRESH_START}."
            )
        if had_any or self._any(bool(reasons)):
            raise SnapshotError(self._lost_message(marker, reasons, skipped))
        return None

    def _try_resharded(
        self, step: int, apply: bool, reasons: list[str], d: str | None = None, source: str = "resharded"
    ) -> Restored | None:
        """Restore ``step`` from its DCP copy when it was taken on another world size (every rank agrees), loading
        the model's and optimizer's shards into this run's sharding; None when the step was taken on this world size
        (the exact per-rank copy is used) or has no complete DCP copy. A copy of another job, or one whose tensors
        do not map onto this model and optimizer, is refused on every rank naming what differs."""

        d = d or os.path.join(self.persist_dir, f"snapshot-{step}")
        path = os.path.join(d, reshard.REPLICATED)
        metadata, state, why = None, None, ""
        if os.path.exists(path):
            try:
                metadata, state = reshard.read_replicated(path)
            except (OSError, ValueError, KeyError, SafetensorError) as e:  # a damaged file: the step is not used
                # (only file and format errors: a programming error reading an intact file must not look like one)
                why = f"{path} cannot be read ({type(e).__name__}: {e})"
        other = metadata is not None and self._moved(metadata)
        if not self._any(other):
            return None
        if not self._all(metadata is not None):
            reasons.append(why or f"{path} is missing on some rank")
            return None
        self._check_all(metadata, f"on disk at {d}", resharded=True)
        if apply:
            plan, problems = self.source.reshard_plan(os.path.join(d, reshard.DCP_DIR), self.optimizer)
            if self._any(bool(problems)):
                raise SnapshotMismatch(
                    f"The snapshot on disk at {d} (taken on {metadata['world_size']} ranks) does not map onto this "
                    f"model and optimizer: {'; '.join(problems[:6]) or 'see the other ranks'}"
                    f"{f' (and {len(problems) - 6} more)' if len(problems) > 6 else ''}. Resume it with the model "
                    f"and optimizer that took it, or train from step 0 with {FRESH_START}."
                )
            self.source.load_resharded(plan, os.path.join(d, reshard.DCP_DIR), state, self.optimizer)
            if self.scheduler is not None and "scheduler" in state:
                self.scheduler.load_state_dict(state["scheduler"])
            if self.scaler is not None and "scaler" in state:
                self.scaler.load_state_dict(state["scaler"])
            set_rng_state(state["rng"])  # rank 0's: the old ranks' streams do not map onto the new ranks
            self.rebuild_ddp_buckets()
            if self.stateful:
                logger.warning(
                    "restored on another world size: %s start afresh (their per-rank state, such as "
                    "error feedback, does not map onto the new ranks)",
                    ", ".join(self.stateful),
                )
        self._discard_after(-1)
        self._marked = False
        self._last = (step, state["extra"])
        detail = (
            f"{'the snapshot processes copy, through ' if source != 'resharded' else ''}{d}, taken on "
            f"{metadata['world_size']} ranks"
            f"{' in another layout' if int(metadata['world_size']) == self.world else ''} and resharded onto "
            f"{self.world} by "
            "torch.distributed.checkpoint"
        )
        logger.warning("restored step %d from %s (%s)", step, "memory" if source != "resharded" else "disk", detail)
        return Restored(step, source, state["extra"], detail, state)

    def _snapshot_header(self, rank: int, step: int) -> dict | None:
        """The metadata of the snapshot of ``rank`` (any rank whose slots this node holds) at ``step``: the slot's
        safetensors header, read alone."""

        reply, fd = self.client.call({"op": "open", "rank": rank, "step": step}, want_fd=True)
        if "error" in reply:
            return None
        try:
            (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            return json.loads(os.pread(fd, n, 8)).get("__metadata__", {})
        finally:
            os.close(fd)

    def _read_snapshot(self, rank: int, step: int) -> tuple[tuple[dict, dict, bool] | None, str]:
        """``rank``'s snapshot at ``step`` held by this node (rebuilt from parity if it must be): its metadata,
        its tensors (views into a private copy) and whether it was rebuilt; checksum checked."""
        reply, fd = self.client.call({"op": "open", "rank": rank, "step": step}, want_fd=True)
        if "error" in reply:
            return None, reply["error"]
        manifest = reply["manifest"]
        # one kernel copy into private memory (mapping the slot here would fault in every page: ~8x slower)
        buf = torch.empty(manifest["nbytes"], dtype=torch.uint8)
        try:
            got = os.preadv(fd, [memoryview(buf.numpy())], 0)
        finally:
            os.close(fd)
        if got != manifest["nbytes"] or checksum(buf.numpy()) != manifest["checksum"]:
            return None, (
                f"rank {rank}'s snapshot of step {step} fails its checksum (a corrupted byte); it is not used"
            )
        metadata, tensors = parse(buf.numpy())
        return (metadata, tensors, reply.get("rebuilt", False)), ""

    def _try_memory_resharded(self, apply: bool, reasons: list[str]) -> Restored | None:
        """A restart on another world size or layout, from the snapshot processes: when the nodes of this run hold,
        between them, every old rank's snapshot of one step (the newest such), each old rank's snapshot is written
        once, by a rank of a node that holds it, as its file of a DCP checkpoint (its shards at the global offsets it
        recorded) under ``persist_dir`` (storage every node reads), and loaded like a persisted copy: no step since
        the last persist is lost. None when they do not (the persisted copies are tried next) or nothing is
        persisted (no shared storage)."""

        if not (self.distributed and self.persist_dir and self.optimizer is not None):
            return None  # (without the optimizer its state in the snapshots has no names)
        try:
            shards = self.source.shard_map(self.optimizer)
        except ValueError:
            shards = None
        mine = []  # (old rank, step, world size) of the moved snapshots of this job this node holds
        if shards is not None:
            status, _ = self.client.call({"op": "status"})
            ours = {k: v for k, v in self.identity.items() if k != "parameters"}
            for rank, steps in (status.get("ranks") or {}).items():
                for step in steps:
                    meta = self._snapshot_header(int(rank), int(step))
                    if not meta or "offsets" not in meta or not self._moved(meta):
                        continue
                    theirs = {k: v for k, v in json.loads(meta.get("identity") or "{}").items() if k != "parameters"}
                    if theirs == ours:
                        mine.append((int(rank), int(step), int(meta["world_size"])))
        held: list = [None] * self.world
        dist.all_gather_object(held, mine, group=self.group)
        holders: dict[tuple[int, int], dict[int, int]] = {}  # (step, old world) -> {old rank: the new rank to write it}
        for new_rank, items in enumerate(held):
            for rank, step, world in items:
                holders.setdefault((step, world), {}).setdefault(rank, new_rank)
        found = [(step, world) for (step, world), got in holders.items() if set(range(world)) <= set(got)]
        if not found:
            return None
        step, world = max(found)
        assigned = holders[(step, world)]
        d = os.path.join(self.persist_dir, f"memory-{step}")
        failed = ""
        try:
            if self.rank == 0:
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(os.path.join(d, reshard.DCP_DIR), mode=0o700)
            dist.barrier(group=self.group)
            for rank, writer in sorted(assigned.items()):
                if writer != self.rank or failed:
                    continue
                # any error here is this rank's vote below, never an exception that would leave the others in the
                # collective
                try:
                    got, why = self._read_snapshot(rank, step)
                    if got is None:
                        failed = why
                        continue
                    metadata, tensors, _ = got
                    state = unflatten_state(json.loads(metadata["skeleton"]), tensors)
                    chunks = shards.chunks(state, json.loads(metadata["offsets"]), whole=rank == 0)
                    reshard.write_chunks(
                        os.path.join(d, reshard.DCP_DIR, f"shard-{rank:05d}.safetensors"), chunks, self._write_private
                    )
                    if rank == 0:  # after every shard file (the barrier below): its presence marks the copy complete
                        replicated, keep = (
                            shards.replicated(state),
                            {k: metadata[k] for k in ("step", "world_size", "placement", "fingerprint", "identity")},
                        )
                except Exception as e:
                    failed = (
                        f"old rank {rank}'s snapshot of step {step} could not be written as a DCP file "
                        f"({type(e).__name__}: {e})"
                    )
            if self._any(bool(failed)):
                reasons.append(failed or "another rank could not read an old rank's snapshot")
                return None
            if assigned[0] == self.rank:
                reshard.write_replicated(os.path.join(d, reshard.REPLICATED), replicated, keep, self._write_private)
            dist.barrier(group=self.group)
            logger.warning(
                "the snapshot processes hold every one of the %d old ranks' snapshots of step %d: "
                "resharding them onto %d ranks",
                world,
                step,
                self.world,
            )
            return self._try_resharded(step, apply, reasons, d=d, source="memory-resharded")
        finally:
            dist.barrier(group=self.group)
            if self.rank == 0:
                shutil.rmtree(d, ignore_errors=True)

    def _completed(self, marker: dict | None) -> Restored | None:
        """A relaunch after the job finished (its snapshot processes shut down): the completed record, agreed by
        every rank, or None."""
        done = bool(marker) and marker.get("completed") is True and marker.get("identity_hash") == self.identity_hash
        if not self._all(done):
            return None
        logger.warning("this job already completed at step %s; nothing to resume", marker.get("last_step"))
        return Restored(
            int(marker.get("last_step") or 0),
            "completed",
            marker.get("extra"),
            f"the job completed at step {marker.get('last_step')} ({self.marker})",
        )

    def _lost_message(self, marker: dict | None, reasons: list[str], skipped: list[int]) -> str:
        parts = [
            f"This job took snapshots (rank {self.rank}, node {self.node}: {self.dir}) but none can be "
            "restored, so it will not silently start over."
        ]
        if marker and marker.get("identity_hash") not in (None, self.identity_hash):
            parts.append(f"They belonged to another job ({identity_diff(marker.get('identity', {}), self.identity)}).")
        exited = os.path.join(self.dir, "exited.json")
        if os.path.exists(exited):
            with contextlib.suppress(OSError, ValueError):
                parts.append(f"Node {self.node}'s snapshot process exited: {json.load(open(exited))['reason']}.")
        elif self.started_smp is not None and marker is not None:
            parts.append(
                f"Node {self.node}'s snapshot process was lost (a new one was started by this launch), "
                "and its snapshots with it."
            )
        if reasons:
            parts.append("Lost or unusable: " + "; ".join(reasons) + ".")
        if skipped:
            parts.append(f"Disk snapshots of steps {skipped} are not usable on every rank.")
        elif not self.persist_dir:
            parts.append("No disk copy to fall back to (set fault_tolerance.persist_dir and persist_every).")
        else:
            parts.append(f"No disk snapshot in {self.persist_dir}.")
        parts.append(f"To train from step 0, relaunch with {FRESH_START}.")
        return " ".join(parts)

    def _start_fresh(self) -> None:
        """``fresh_start``: drop this job's snapshots (memory, the record of them) and move its disk snapshots
        aside to ``<persist_dir>.discarded-<time>`` (kept, never read again), on every rank, then train from 0."""
        self._discard_after(-1)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.marker)
        if self.persist_dir and os.path.isdir(self.persist_dir) and self.rank == 0:
            aside = f"{self.persist_dir}.discarded-{time.strftime('%Y%m%d-%H%M%S')}"
            os.replace(self.persist_dir, aside)
            logger.warning("fresh start: the disk snapshots moved to %s", aside)
        if self.distributed:
            dist.barrier(group=self.group)
        logger.warning("fresh start (fault_tolerance.fresh_start): this job's earlier snapshots are discarded")

    def _discard_after(self, step: int) -> None:
        self.client.call({"op": "discard", "rank": self.rank, "after": step})
