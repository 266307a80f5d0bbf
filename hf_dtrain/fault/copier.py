"""Taking a snapshot: at the step boundary, in the training thread, what the next step changes is captured (the
source's references, the RNG states, the ``stateful`` objects' copies); a long-lived copy thread then collects the
rest (optimizer, scheduler, scaler), lays the tensors out in the safetensors layout, copies them into a slot of the
node's snapshot process (page-locked on CUDA, from a side stream) and commits it with a checksum, overlapping the
next forward and backward. ``wait()``, before the next optimizer step, surfaces a failure, and when the snapshot
process was lost meanwhile starts a new one and writes the same snapshot into it."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import queue
import threading
import time
from typing import Any

import torch

from hf_dtrain.errors import WriteFailure

from .ddp import unwrap
from .errors import SnapshotError
from .node import SMP_LOST
from .state import Layout, flatten_state, rng_state
from .wire import checksum


class SnapshotCopier:
    """One rank's snapshots into its node's slots. ``parts`` holds what is snapshotted (``model``, ``optimizer``,
    ``scheduler``, ``scaler``, ``stateful``; the engine sets ``optimizer`` / ``scheduler`` again when the Trainer
    hands them over), ``source`` how (the layout's :class:`~hf_dtrain.fault.source.SnapshotSource`); ``node`` the
    snapshot process, ``record`` the job's identity and run record, ``persister`` the disk copies."""

    def __init__(self, parts, source, ranks, node, record, persister) -> None:
        self.parts, self.source, self.ranks, self.node = parts, source, ranks, node
        self.record, self.persister = record, persister
        self.layout: Layout | None = None
        self.maps: dict[int, tuple[int, mmap.mmap]] = {}
        self.registered: dict[int, int] = {}  # slot -> page-locked address (CUDA)
        # read at the first snapshot: Accelerate's FSDP2 route moves the model to the GPU after the engine is built
        self.cuda: bool | None = None
        # one long-lived copy thread fed by a queue: starting a thread per snapshot would stall the training thread
        # for up to the interpreter's switch interval (5 ms) while the new thread runs Python code
        self._worker: threading.Thread | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._in_flight = False
        self._error: BaseException | None = None
        self.pending = None  # (step, header, tensors, total, extra) of the snapshot being written
        self.last: tuple[int, Any] | None = None  # (step, extra) of the newest committed or restored snapshot
        self.committed: tuple[int, int, int, dict] | None = None  # (step, slot, bytes, manifest) of the newest commit
        self.stats = {"snapshots": 0, "stall_seconds": [], "copy_seconds": [], "wait_seconds": [], "bytes": 0}

    # ---- the training thread -------------------------------------------------------------------------------------
    def start(self, step: int, extra: Any) -> None:
        """Capture the state after ``step`` and hand the rest to the copy thread (the previous one awaited first)."""
        t0 = time.perf_counter()
        self.wait()
        self.persister.prepare(self.source, self.parts.optimizer)
        if self.cuda is None:
            self.cuda = any(p.is_cuda for p in unwrap(self.parts.model).parameters())
        state = self._capture(extra)
        self.pending = None  # set by the copy thread once the snapshot's bytes are laid out
        stream = None
        if self.cuda:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())  # the copy reads what the optimizer step just wrote
        if self._worker is None:
            self._worker = threading.Thread(target=self._serve, daemon=True, name="hf_dtrain-snapshot")
            self._worker.start()
        self._done.clear()
        self._in_flight = True
        self._jobs.put((step, state, stream, extra))
        self.stats["stall_seconds"].append(time.perf_counter() - t0)

    def _capture(self, extra: Any) -> dict:
        """What must be read at the step boundary, in the training thread: the source's references (the model's
        tensors: FSDP2 swaps unsharded parameters onto the modules during forward and backward; DeepSpeed's ZeRO
        state), the RNG states (the next step draws from them), the ``stateful`` objects' copies."""
        state = {**self.source.capture(), "rng": rng_state(), "extra": extra}
        if self.parts.stateful:
            state["stateful"] = {name: obj.state_dict() for name, obj in self.parts.stateful.items()}
        return state

    def wait(self) -> None:
        """Block until the snapshot in flight is committed (call before the next optimizer step). When the node's
        snapshot process died meanwhile, a new one is started and the same snapshot written into it (the state has
        not changed yet: this runs before the optimizer step)."""
        if self._in_flight:
            t0 = time.perf_counter()
            self._done.wait()
            self._in_flight = False
            self.stats["wait_seconds"].append(time.perf_counter() - t0)
        if self._error is not None:
            e, self._error = self._error, None
            if isinstance(e, SMP_LOST) and self.pending is not None:
                self.respawn(e)
                step, header, tensors, total, extra = self.pending
                slot, buf = self._slot(total)
                self._copy(step, slot, buf, header, tensors, total, None, extra)
                if self._error is None:
                    self.pending = None
                    return
                e, self._error = self._error, None
            if isinstance(e, WriteFailure):  # a persisted copy that could not be written: named as it is
                raise e
            raise SnapshotError(f"snapshot failed on rank {self.ranks.rank}: {type(e).__name__}: {e}") from e
        self.pending = None
        if self.persister.finished():
            self.persister.raise_error()

    def committed_bytes(self, step: int):
        """The bytes and manifest of the committed snapshot of ``step`` (after ``wait()``), from its slot, or None
        when the newest commit is of another step."""
        if self.committed is None or self.committed[0] != step or self.committed[1] not in self.maps:
            return None
        _, slot, total, manifest = self.committed
        return bytearray(memoryview(self.maps[slot][1])[:total]), manifest

    def respawn(self, error: BaseException) -> None:
        """A new snapshot process in place of the lost one; the slots mapped from the old one are let go."""
        for slot in list(self.maps):
            self._unregister(slot)
            self.maps.pop(slot)[1].close()
        self.node.respawn(error)

    # ---- the copy thread -----------------------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._background(*job)
            finally:
                self._done.set()

    def _background(self, step: int, state: dict, stream, extra: Any) -> None:
        """The snapshot's layout and header, a slot from the snapshot process, the copy, the commit. A lost snapshot
        process is left to ``wait()``, which starts a new one and writes the same snapshot (``pending``) into it."""
        try:
            metadata, tensors = self._collect(step, state)
            if self.layout is None or not self.layout.matches(tensors):
                self.layout = Layout(tensors)
            header = self.layout.header(metadata)
            total = self.layout.total_bytes
            self.pending = (step, header, tensors, total, extra)
            slot, buf = self._slot(total)
        except BaseException as e:  # surfaced by wait()
            self._error = e
            return
        self._copy(step, slot, buf, header, tensors, total, stream, extra)

    def _collect(self, step: int, state: dict) -> tuple[dict, dict[str, torch.Tensor]]:
        """The rest of the snapshot (nothing it reads changes before the next optimizer step, which waits for this
        thread): the optimizer's, scheduler's and scaler's state dicts, then the whole state split into tensors and a
        JSON skeleton."""
        parts = self.parts
        self.source.collect(state, parts.optimizer)
        if parts.scheduler is not None:
            state["scheduler"] = parts.scheduler.state_dict()
        if parts.scaler is not None:
            state["scaler"] = parts.scaler.state_dict()
        tensors: dict[str, torch.Tensor] = {}
        skeleton = flatten_state(state, tensors)
        metadata = {
            "step": str(step),
            "rank": str(self.ranks.rank),
            "world_size": str(self.ranks.world),
            **self.record.header(),
            "skeleton": json.dumps(skeleton, separators=(",", ":")),
        }
        shards = self.persister.shards
        if shards is not None:  # where this rank's shards sit in the global tensors (a restart on another world
            metadata["offsets"] = json.dumps(shards.offsets)  # size reads them: restore.py)
        return metadata, tensors

    def _slot(self, total: int) -> tuple[int, mmap.mmap]:
        slot, fd, size = self.node.slot(total)
        return slot, self._map(slot, fd, size)

    def _map(self, slot: int, fd: int, size: int) -> mmap.mmap:
        old = self.maps.get(slot)
        if old is not None and old[0] >= size:
            os.close(fd)
            return old[1]
        if old is not None:
            self._unregister(slot)
            old[1].close()
        m = mmap.mmap(fd, size)
        os.close(fd)
        if self.cuda:  # page-locked, so the device-to-host copies run asynchronously on the side stream
            import ctypes

            ptr = ctypes.addressof(ctypes.c_char.from_buffer(m))
            torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
            self.registered[slot] = ptr
        self.maps[slot] = (size, m)
        return m

    def _unregister(self, slot: int) -> None:
        ptr = self.registered.pop(slot, None)
        if ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(ptr)

    def _copy(self, step, slot, buf, header, tensors, total, stream, extra=None) -> None:
        try:
            t0 = time.perf_counter()
            buf[: len(header)] = header
            base = len(header)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for key, t in tensors.items():
                    _, _, a, b = self.layout.entries[key]
                    if b > a:
                        dst = torch.frombuffer(buf, dtype=torch.uint8, count=b - a, offset=base + a)
                        dst.view(t.dtype).view(t.shape).copy_(t, non_blocking=t.is_cuda and stream is not None)
            if stream is not None:
                stream.synchronize()  # the device-to-host copies have landed
            manifest = {
                "step": step,
                "nbytes": total,
                "checksum": checksum(memoryview(buf)[:total]),
                "fingerprint": self.record.fingerprint,
                "identity": self.record.identity_hash,
                "world_size": self.ranks.world,
            }
            self.node.commit(slot, manifest)
            self.stats["copy_seconds"].append(time.perf_counter() - t0)
            self.stats["snapshots"] += 1
            self.stats["bytes"] = total
            self.last = (step, extra)
            self.committed = (step, slot, total, manifest)
            self.record.mark_committed(step)
            if self.persister.due(step):
                self.persister.start(step, bytearray(memoryview(buf)[:total]), manifest)
        except BaseException as e:  # surfaced by wait()
            self._error = e

    def close(self) -> None:
        """The copy thread stopped, the slots unmapped (after ``wait()``)."""
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join()
            self._worker = None
        for slot, (_, m) in self.maps.items():
            self._unregister(slot)
            m.close()
        self.maps.clear()
