"""The snapshot management process (SMP): one per node, outliving the trainers on it.

It owns the snapshots: two slots per local rank, each an anonymous ``memfd`` (no name in ``/dev/shm``; only a process
the SMP hands the descriptor to over its authenticated Unix socket can map it). A trainer writes a snapshot into the
slot that does not hold its latest complete one, then commits it with a manifest (step, bytes, checksum, model
fingerprint, world size): the commit is the last thing written, so a trainer killed mid-snapshot leaves the
previous snapshot whole. After every rank of the node has committed a step, the SMP sends the pieces of the node's
shard to the peers holding the codewords' parity (``erasure.ErasureCode``) and keeps the parity blocks peers send it,
for the last two steps. A fresh SMP that replaces a lost node rebuilds its shard from the survivors' shards and
parity and checks it against the replicated manifests' checksums.

Modules: ``wire.py`` (the authenticated byte protocol and the trainer's client), ``parity.py`` (the exchange with
peers and the rebuild), this file (slots, the request table, serving). The Unix socket lives in a 0700 directory; the
key is read from stdin, never from the command line.

    python path/to/hf_dtrain/fault/smp.py --dir DIR --node N [--host 127.0.0.1] < key   # or started by the engine

(Run by path, it imports only the standard library, numpy, xxhash and zfec: a light process per node.)
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import sys
import threading
import time
from multiprocessing.connection import Connection, Listener
from multiprocessing.reduction import send_handle
from typing import Optional

if __package__:
    from .erasure import UnrecoverableError
    from .parity import KEEP_STEPS, ParityExchange
    from .wire import recv, send
else:  # started by path (what the engine does): the snapshot process never imports torch or transformers
    from erasure import UnrecoverableError
    from parity import KEEP_STEPS, ParityExchange
    from wire import recv, send

logger = logging.getLogger("hf_dtrain.fault.smp")


class Slot:
    def __init__(self, rank: int, index: int, size: int):
        self.rank, self.index = rank, index
        self.fd = os.memfd_create(f"hf_dtrain_r{rank}_s{index}", os.MFD_CLOEXEC)
        self.size = 0
        self.manifest: Optional[dict] = None  # set by a commit; None while being written
        self.resize(size)

    def resize(self, size: int) -> None:
        if size > self.size:
            os.ftruncate(self.fd, size)
            self.size = size

    def read(self, nbytes: int) -> bytes:
        with mmap.mmap(self.fd, self.size, prot=mmap.PROT_READ) as m:
            return m[:nbytes]

    def write(self, data: bytes) -> None:
        self.resize(len(data))
        with mmap.mmap(self.fd, self.size) as m:
            m[:len(data)] = data


class SnapshotManager(ParityExchange):
    """The SMP's state and request handling (``serve`` runs it)."""

    def __init__(self, directory: str, node: int, key: bytes, host: str = "127.0.0.1", idle_exit: float = 3600.0):
        self.dir, self.node, self.key, self.host = directory, node, key, host
        self.idle_exit = idle_exit  # no trainer connected for this long: the job is gone, free the memory
        self.connected = 0
        self.last_seen = time.monotonic()
        self.lock = threading.RLock()
        self.rebuild_lock = threading.Lock()
        self.slots: dict[int, list[Slot]] = {}
        self.local_ranks: list[int] = []
        self.group: list[int] = [node]  # node ids of this node's erasure group, in group order
        self.parity = 0
        self.peers: dict[int, tuple[str, int]] = {}
        self.pieces: dict[tuple[int, int], dict[int, bytes]] = {}  # (step, codeword) -> {group position: piece}
        self.parity_blocks: dict[int, dict[tuple[int, int], bytes]] = {}  # step -> {(codeword, l): block}
        self.manifests: dict[int, dict[int, dict]] = {}  # step -> {node: node manifest}, replicated by peers
        self.sent: set = set()
        self.events: list[str] = []
        self._stop = threading.Event()
        self._send_queue: list[int] = []
        self._send_cv = threading.Condition(self.lock)

    # ---------------------------------------------------------------- local (trainer) requests
    def _rank_slots(self, rank: int) -> list[Slot]:
        if rank not in self.slots:
            self.slots[rank] = [Slot(rank, i, 0) for i in range(KEEP_STEPS)]
        return self.slots[rank]

    def complete_steps(self, rank: int) -> list[int]:
        return sorted(s.manifest["step"] for s in self.slots.get(rank, []) if s.manifest)

    def _slot_with(self, rank: int, step: int) -> Optional[Slot]:
        return next((s for s in self.slots.get(rank, []) if s.manifest and s.manifest["step"] == step), None)

    # every request the snapshot process answers: the trainer's (local socket) and the peers' (TCP); anything
    # else is refused with the list
    HANDLERS = {name: f"_op_{name}" for name in ("config", "slot", "commit", "available", "open", "discard",
                                                 "status", "shutdown", "piece", "holdings", "fetch_shard",
                                                 "fetch_parity", "ping")}

    def handle(self, conn: Connection, msg: dict) -> None:
        op = msg.get("op")
        method = self.HANDLERS.get(op)
        if method is None:
            send(conn, {"error": f"unknown op {op!r}; the snapshot process answers "
                                 f"{', '.join(sorted(self.HANDLERS))}"})
            return
        getattr(self, method)(conn, msg)

    def _op_config(self, conn: Connection, msg: dict) -> None:
        with self.lock:
            self.local_ranks = sorted(msg["local_ranks"])
            self.group, self.parity = msg["group"], msg["parity"]
            self.peers = {int(n): tuple(a) for n, a in msg["peers"].items()}
        send(conn, {"ok": True})

    def _op_slot(self, conn: Connection, msg: dict) -> None:
        # the slot to write the next snapshot into: never the latest complete one
        with self.lock:
            slots = self._rank_slots(msg["rank"])
            # an unfinished slot first, else the oldest complete one
            target = min(slots, key=lambda s: (s.manifest is not None, s.manifest["step"] if s.manifest else 0))
            target.manifest = None  # being written: not served until committed
            target.resize(msg["nbytes"])
        send(conn, {"slot": target.index, "size": target.size})
        send_handle(conn, target.fd, msg["pid"])

    def _op_commit(self, conn: Connection, msg: dict) -> None:
        with self.lock:
            slot = self._rank_slots(msg["rank"])[msg["slot"]]
            slot.manifest = dict(msg["manifest"], rank=msg["rank"])
            step = slot.manifest["step"]
            if self.parity and all(self._slot_with(r, step) for r in self.local_ranks):
                self._send_queue.append(step)
                self._send_cv.notify()
        send(conn, {"ok": True})

    def _op_available(self, conn: Connection, msg: dict) -> None:
        # complete steps of a rank; for a rank with none, the steps peers can rebuild
        with self.lock:
            local = self.complete_steps(msg["rank"])
        if local or not msg.get("recover", True):
            send(conn, {"steps": local, "source": "memory"})
        else:
            steps, reason = self.recoverable_steps()
            send(conn, {"steps": steps, "source": "parity", "reason": reason})

    def _op_open(self, conn: Connection, msg: dict) -> None:
        # the manifest and descriptor of a rank's snapshot at a step (rebuilt if needed)
        rank, step = msg["rank"], msg["step"]
        error = None
        with self.lock:
            slot = self._slot_with(rank, step)
        if slot is None:
            try:
                with self.rebuild_lock:  # the node's other ranks wait for the same rebuild
                    if self._slot_with(rank, step) is None:
                        self.rebuild(step)
            except (UnrecoverableError, OSError, EOFError, KeyError, ValueError) as e:
                error = f"{type(e).__name__}: {e}"
            with self.lock:
                slot = self._slot_with(rank, step)
        if slot is None:
            send(conn, {"error": error or f"no snapshot of rank {rank} at step {step} on node {self.node}"})
            return
        send(conn, {"manifest": slot.manifest, "size": slot.size, "rebuilt": bool(slot.manifest.get("rebuilt"))})
        send_handle(conn, slot.fd, msg["pid"])

    def _op_discard(self, conn: Connection, msg: dict) -> None:
        # after a restore to step S: snapshots past S belong to the failed timeline
        with self.lock:
            for slot in self._rank_slots(msg["rank"]):
                if slot.manifest and slot.manifest["step"] > msg["after"]:
                    slot.manifest = None
        send(conn, {"ok": True})

    def _op_status(self, conn: Connection, msg: dict) -> None:
        with self.lock:
            send(conn, {"node": self.node, "pid": os.getpid(), "ranks": {r: self.complete_steps(r)
                                                                         for r in self.slots},
                        "parity_steps": sorted(self.parity_blocks), "events": self.events[-50:]})

    def _op_shutdown(self, conn: Connection, msg: dict) -> None:
        send(conn, {"ok": True})
        self._stop.set()

    # ---------------------------------------------------------------- serving
    def serve(self, ready=None) -> None:
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        os.chmod(self.dir, 0o700)
        sock = os.path.join(self.dir, "smp.sock")
        if os.path.exists(sock):
            os.unlink(sock)
        old = os.umask(0o077)
        try:
            local = Listener(sock, family="AF_UNIX", authkey=self.key)
        finally:
            os.umask(old)
        peer = Listener((self.host, 0), family="AF_INET", authkey=self.key)
        info = {"pid": os.getpid(), "node": self.node, "address": list(peer.address)}
        tmp = os.path.join(self.dir, "smp.json.tmp")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(info, f)
        os.replace(tmp, os.path.join(self.dir, "smp.json"))
        for listener in (local, peer):
            threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        threading.Thread(target=self._sender, daemon=True).start()
        if ready is not None:
            ready()
        while not self._stop.wait(0.2):
            if self.connected == 0 and time.monotonic() - self.last_seen > self.idle_exit:
                logger.warning("SMP node %d: no trainer for %.0f s; exiting", self.node, self.idle_exit)
                break
        for listener in (local, peer):
            listener.close()
        for f in ("smp.json", "smp.sock"):
            try:
                os.unlink(os.path.join(self.dir, f))
            except OSError:
                pass

    def _accept(self, listener: Listener) -> None:
        while not self._stop.is_set():
            try:
                conn = listener.accept()
            except Exception:  # a client failing authentication, or the listener closed
                if self._stop.is_set():
                    return
                continue
            threading.Thread(target=self._serve_conn, args=(conn,), daemon=True).start()

    def _serve_conn(self, conn: Connection) -> None:
        with self.lock:
            self.connected += 1
        try:
            while not self._stop.is_set():
                msg = recv(conn)
                try:
                    self.handle(conn, msg)
                except (EOFError, OSError):
                    raise
                except Exception as e:  # a bad request: say why, keep serving
                    logger.exception("SMP node %d: request %s failed", self.node, msg.get("op"))
                    send(conn, {"error": f"{type(e).__name__}: {e}"})
        except (EOFError, OSError):
            pass
        finally:
            conn.close()
            with self.lock:
                self.connected -= 1
                self.last_seen = time.monotonic()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="private directory for the socket (created 0700)")
    ap.add_argument("--node", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1", help="address peers reach this node's SMP on")
    ap.add_argument("--idle-exit", type=float, default=3600.0,
                    help="exit after this many seconds without any connection (the job is gone)")
    args = ap.parse_args(argv)
    key = bytes.fromhex(sys.stdin.readline().strip())
    if len(key) < 16:
        raise SystemExit("SMP: expected a hex key of at least 16 bytes on stdin")
    logging.basicConfig(level=logging.INFO, format=f"[smp node {args.node}] %(message)s")
    SnapshotManager(args.dir, args.node, key, args.host, args.idle_exit).serve()


if __name__ == "__main__":
    main()
