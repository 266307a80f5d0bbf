"""Snapshots on disk: every ``persist_every``-th committed snapshot is written to ``persist_dir`` by a background
thread (this rank's slot bytes and manifest, and, for layouts that reshard, a DCP checkpoint of the shards plus rank
0's replicated state, so a restart on another world size or layout can load it), and read back when the snapshot
processes hold nothing usable. A write that fails fails the run on the training thread, naming the path."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
from typing import Any

import torch
import torch.distributed as dist

from hf_dtrain.errors import WriteFailure, check_writable

from . import reshard
from .record import clean_temporaries, write_private
from .state import parse, unflatten_state
from .wire import checksum

logger = logging.getLogger("hf_dtrain.fault.snapshot")


class Persister:
    """The disk copies of one rank's snapshots under ``directory`` (None: no disk copies). ``shards``: the layout's
    shard map (set at the first snapshot by :meth:`prepare`; None where the layout does not reshard); ``group``: the
    gloo group the DCP copies are written over (its own, built at set-up)."""

    def __init__(
        self, directory: str | None, every: int, ranks, record, process_group, timeout: float, on_notice: bool = False
    ) -> None:
        self.directory, self.every, self.ranks, self.record = directory, every, ranks, record
        # a preemption notice writes the step it stops after (``on_notice``): the DCP copy too, so it reshards
        self.writes = bool(directory) and (bool(every) or on_notice)
        if directory:  # before any step: a directory that cannot be written fails now, not in the background
            check_writable(directory, "--fault-tolerance.persist-dir", mode=0o700)
            if ranks.first_on_node and os.path.isdir(directory):  # what a writer killed midway left
                clean_temporaries(directory)
        self.shards = None
        self.exact_only = False  # no resharding copy for this layout (see prepare)
        self._thread: threading.Thread | None = None
        self._error: WriteFailure | None = None
        # every persist_every-th snapshot is also a DCP checkpoint (restorable onto another world size), written by
        # the persist thread over a process group of its own
        self.group = ranks.gloo_group(process_group, timeout) if self.writes and ranks.distributed else None

    def prepare(self, source, optimizer) -> None:
        """Read the layout's shard map once (the Trainer hands the optimizer over after the engine is built)."""
        if self.writes and self.shards is None and not self.exact_only:
            try:
                self.shards = source.shard_map(optimizer)  # None: this layout does not reshard (ZeRO)
            except reshard.NotReshardable as why:
                self._exact_only(why)

    def _exact_only(self, why) -> None:
        """From now on the disk copy is each rank's exact one, restored on this world size; said once."""
        self.shards, self.exact_only = None, True
        logger.warning(
            "no copy for another world size is written (%s): the disk copy is each rank's exact one, for a restart "
            "on this world size",
            why,
        )

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    # ---- writing -------------------------------------------------------------------------------------------------
    def start(self, step: int, data: bytes, manifest: dict) -> None:
        """Write the snapshot of ``step`` (its slot's bytes) in the background; the previous write is awaited."""
        self.join()
        self.raise_error()
        self._thread = threading.Thread(target=self._write, args=(step, data, manifest), daemon=True)
        self._thread.start()

    def _write(self, step: int, data: bytes, manifest: dict) -> None:
        rank = self.ranks.rank
        d = os.path.join(self.directory, f"snapshot-{step}")
        what = "persisted snapshot"
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
            write_private(os.path.join(d, f"rank{rank}.safetensors"), data)  # the slot's bytes
            write_private(os.path.join(d, f"rank{rank}.json"), json.dumps(manifest).encode())
            if self.shards is not None:
                what = "resharding (DCP) copy"
                try:
                    self._write_resharding(d, step, data)
                except reshard.NotReshardable as why:  # every rank alike (one optimizer), before any collective
                    self._exact_only(why)
        except Exception as e:  # raised on the training thread by the next wait(), snapshot or close()
            self._error = WriteFailure(
                f"rank {rank}: the {what} of step {step} could not be written to {d} ({type(e).__name__}: {e}). Set "
                "fault_tolerance.persist_dir to a writable directory with room, or persist_every 0 to keep snapshots "
                "in memory only; relaunch the same command to resume from the snapshots in memory."
            )
            self._error.__cause__ = e

    def _write_resharding(self, d: str, step: int, data) -> None:
        """The snapshot in ``data`` (this rank's slot bytes) as a DCP checkpoint under ``d/dcp`` (each rank its own
        shards), then ``d/replicated.safetensors`` from rank 0 once every rank's shards are written."""
        metadata, tensors = parse(data)
        state = unflatten_state(json.loads(metadata["skeleton"]), tensors)
        sharded, replicated = self.shards.split(state)
        if self.ranks.rank == 0:  # a copy of this step from a failed timeline (or another world size): gone first
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(d, reshard.REPLICATED))
            shutil.rmtree(os.path.join(d, reshard.DCP_DIR), ignore_errors=True)
        if self.ranks.distributed:
            dist.barrier(group=self.group)
        reshard.save(os.path.join(d, reshard.DCP_DIR), sharded, self.group)  # returns once all have written
        if self.ranks.rank == 0:
            fields = {"step": str(step), "world_size": str(self.ranks.world), **self.record.header()}
            fields["identity"] = json.dumps(self.record.identity, sort_keys=True)
            reshard.write_replicated(os.path.join(d, reshard.REPLICATED), replicated, fields, write_private)

    def write_now(self, step: int, data, manifest: dict) -> str:
        """Write the snapshot of ``step`` now, on this thread (a preemption notice: the process exits next); returns
        its directory. A failed write raises :class:`~hf_dtrain.errors.WriteFailure`."""
        self.join()
        self.raise_error()
        self._write(step, data, manifest)
        self.raise_error()
        return self.step_dir(step)

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def finished(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def raise_error(self) -> None:
        """A persisted write that failed in the background fails the run on the training thread."""
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    # ---- reading -------------------------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps with a disk snapshot of this rank (``snapshot-<step>/rank<r>.json``) or a complete DCP copy
        (``snapshot-<step>/replicated.safetensors``); other names are ignored."""
        if not self.directory or not os.path.isdir(self.directory):
            return []
        steps = []
        for name in os.listdir(self.directory):
            number = name[len("snapshot-") :]
            files = (f"rank{self.ranks.rank}.json", "replicated.safetensors")
            if (
                name.startswith("snapshot-")
                and number.isdigit()
                and any(os.path.exists(os.path.join(self.directory, name, f)) for f in files)
            ):
                steps.append(int(number))
        return sorted(steps)

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, f"snapshot-{step}")

    def read(self, step: int) -> tuple[Any | None, str]:
        """This rank's disk snapshot of ``step`` as bytes, checked against its manifest, or ``(None, why)``."""
        d, rank = self.step_dir(step), self.ranks.rank
        path = os.path.join(d, f"rank{rank}.json")
        try:
            with open(path) as f:
                manifest = json.load(f)
            nbytes, digest = int(manifest["nbytes"]), str(manifest["checksum"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            return None, f"{path} is damaged ({type(e).__name__}: {e})"
        data_path = os.path.join(d, f"rank{rank}.safetensors")
        try:
            if os.path.getsize(data_path) < nbytes:
                return None, f"{data_path} is truncated ({os.path.getsize(data_path)} of {nbytes} bytes)"
            data = torch.from_file(data_path, size=nbytes, dtype=torch.uint8).numpy()  # a private mapping
        except (RuntimeError, OSError) as e:
            return None, f"{data_path} cannot be read ({e})"
        if checksum(data) != digest:
            return None, f"{data_path} fails its checksum (a corrupted byte)"
        return data, ""

    def set_aside(self) -> str | None:
        """``fresh_start``: move the disk snapshots to ``<persist_dir>.discarded-<time>`` (kept, never read again)."""
        import time

        if self.directory and os.path.isdir(self.directory) and self.ranks.rank == 0:
            aside = f"{self.directory}.discarded-{time.strftime('%Y%m%d-%H%M%S')}"
            os.replace(self.directory, aside)
            return aside
        return None
