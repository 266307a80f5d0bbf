"""What a job's snapshots record of the job, and the checks a restore makes against it: the run identity (the
caller's settings and what the engine sees: the trainable parameter set, the model config, the optimizer's and
scheduler's classes and hyper-parameters, hf_dtrain's release), the placement (how the model is laid over the ranks),
and this rank's run record on disk (``run-rank<r>.json``: it committed snapshots, or the job completed). Also the
private-file helpers every writer of the snapshot directories uses."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from typing import Any

from hf_dtrain.settings import RELEASE

from .ddp import unwrap
from .errors import SnapshotMismatch, identity_diff

FRESH_START = "--fault-tolerance.fresh-start true (YAML fault_tolerance: {fresh_start: true})"


def write_private(path: str, data: bytes) -> None:
    """Write ``path`` (0600) all at once: into ``<path>.<pid>.tmp``, then renamed. A writer killed midway leaves only
    the temporary, which the next engine on that directory removes (:func:`clean_temporaries`). (``O_TMPFILE`` +
    ``linkat`` through ``/proc`` would leave nothing at all, but fails with EXDEV in containers.)"""
    tmp = f"{path}.{os.getpid()}.tmp"
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def clean_temporaries(directory: str) -> None:
    """Remove ``*.tmp`` files a killed writer left under ``directory``."""
    for root, _, files in os.walk(directory):
        for name in files:
            if name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(root, name))


def fingerprint_of(source) -> str:
    """A hash of what the layout's source stores (names, shapes, dtypes of the trainable set)."""
    h = hashlib.sha256()
    for entry in source.describe():
        h.update(f"{entry};".encode())
    return h.hexdigest()[:16]


def identity_of(job: dict, fingerprint: str, model, optimizer, scheduler) -> dict:
    """What makes this job this job: the caller's settings (``job``: the job's config, seed, data source) and what
    the engine sees itself. Recorded in every snapshot; a restore into a job whose identity differs is refused,
    naming what differs."""
    out = {"job": job, "hf_dtrain": RELEASE, "parameters": fingerprint}
    config = getattr(unwrap(model), "config", None)
    if hasattr(config, "to_dict"):
        cfg = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
        out["model_config"] = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]
    if optimizer is not None:
        from hf_dtrain.distributed.engines import unwrap_optimizer

        opt = unwrap_optimizer(optimizer)
        groups = [
            {k: v for k, v in g.items() if k not in ("params", "lr") and isinstance(v, (int, float, str, bool, tuple))}
            for g in opt.param_groups
        ]
        out["optimizer"] = {"class": type(opt).__name__, "groups": groups}
    if scheduler is not None:
        out["scheduler"] = type(scheduler).__name__
    return json.loads(json.dumps(out, default=str))


class RunRecord:
    """This job's identity and placement as every snapshot records them, this rank's run record file, and the
    checks of a snapshot against them. ``ranks`` (:class:`~hf_dtrain.fault.ranks.Ranks`) agrees checks across
    ranks."""

    def __init__(self, identity: dict, fingerprint: str, placement: dict | None, ranks) -> None:
        self.ranks = ranks
        self.fingerprint = fingerprint
        self.identity = identity
        self.identity_hash = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
        self.identity_json = json.dumps(identity, sort_keys=True)  # written into every snapshot's header
        # how the job lays the model over its ranks (its parallel degrees and layout settings): a snapshot of another
        # placement does not load rank by rank; like one of another world size, it reshards from the DCP copy
        self.placement = json.loads(json.dumps(placement or {}, sort_keys=True, default=str))
        self.placement_json = json.dumps(self.placement, sort_keys=True)
        self.marker: str | None = None  # run-rank<r>.json in the node directory (set once it exists)
        self.marked = False

    def header(self) -> dict:
        """The fields every snapshot's metadata carries of the job."""
        return {"placement": self.placement_json, "fingerprint": self.fingerprint, "identity": self.identity_json}

    # ---- the run record ------------------------------------------------------------------------------------------
    def write_marker(self, record: dict) -> None:
        """``run-rank<r>.json``: this rank has committed snapshots (so a relaunch whose snapshot process holds none of
        them says what was lost instead of starting over), or the job completed."""
        self.marked = True
        write_private(self.marker, json.dumps(record, default=str).encode())

    def mark_committed(self, step: int) -> None:
        if not self.marked:
            self.write_marker(
                {"identity": self.identity, "identity_hash": self.identity_hash, "first_step": step, "completed": False}
            )

    def mark_completed(self, step: int, extra: Any) -> None:
        self.write_marker(
            {
                "identity": self.identity,
                "identity_hash": self.identity_hash,
                "completed": True,
                "last_step": step,
                "extra": extra,
            }
        )

    def read_marker(self) -> dict | None:
        try:
            with open(self.marker) as f:
                record = json.load(f)
            return record if isinstance(record, dict) else None
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {"damaged": True}

    def forget(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.marker)

    # ---- a snapshot against this run -----------------------------------------------------------------------------
    @staticmethod
    def placement_of(metadata: dict) -> dict:
        """The placement a snapshot was taken with (``{}`` for one written before placements were recorded)."""
        return json.loads(metadata.get("placement") or "{}")

    def moved(self, metadata: dict) -> bool:
        """The snapshot was taken on another world size or placement: it does not load rank by rank."""
        return int(metadata["world_size"]) != self.ranks.world or self.placement_of(metadata) != self.placement

    def check_all(self, metadata: dict, where: str, resharded: bool = False) -> None:
        """:meth:`check` on every rank at once: a mismatch anywhere is a ``SnapshotMismatch`` everywhere."""
        problem = None
        try:
            self.check(metadata, where, resharded)
        except ValueError as e:
            problem = e
        if self.ranks.any(problem is not None):
            raise problem or SnapshotMismatch(
                f"another rank's snapshot {where} does not match this run (see its error)"
            )

    def check(self, metadata: dict, where: str, resharded: bool = False) -> None:
        """``metadata`` is this job's, taken on this world size and placement; with ``resharded`` (a DCP copy read
        into this run's sharding) the world size and placement may differ, and the parameter fingerprint is left to
        the copy's own check of every name and shape (``reshard.differences``)."""
        world = self.ranks.world
        if not resharded and int(metadata["world_size"]) != world:
            raise SnapshotMismatch(
                f"The snapshot {where} was taken with world size {metadata['world_size']}; this run has {world}. "
                "Restart with the same number of processes, or set fault_tolerance.persist_every so that a restart "
                "on another world size reshards the newest persisted DCP snapshot."
            )
        if not resharded and self.placement_of(metadata) != self.placement:
            raise SnapshotMismatch(
                f"The snapshot {where} was taken with another layout "
                f"({identity_diff(self.placement_of(metadata), self.placement)}). Restart with the same layout, or "
                "set fault_tolerance.persist_every so that a restart on another layout reshards the newest persisted "
                "DCP snapshot."
            )
        theirs = json.loads(metadata.get("identity") or "{}")
        ours = self.identity
        if resharded:
            theirs, ours = ({k: v for k, v in i.items() if k != "parameters"} for i in (theirs, ours))
        if theirs != ours:
            raise SnapshotMismatch(
                f"The snapshot {where} belongs to another job: {identity_diff(theirs, ours)}. This run does not "
                f"resume it. To train this job from step 0 and discard those snapshots, relaunch with {FRESH_START}; "
                "to keep them, give this job its own fault_tolerance.directory (or output directory)."
            )

    def same_job(self, metadata: dict) -> bool:
        """The snapshot is this job's, whatever its world size and placement (its parameter fingerprint aside)."""
        theirs = {k: v for k, v in json.loads(metadata.get("identity") or "{}").items() if k != "parameters"}
        return theirs == {k: v for k, v in self.identity.items() if k != "parameters"}
