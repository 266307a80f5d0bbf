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
import contextlib
import json
import logging
import os
import sys
import threading
import time
from multiprocessing.connection import Connection, Listener
from multiprocessing.reduction import send_handle
from typing import ClassVar

if __package__:
    from .erasure import UnrecoverableError
    from .parity import KEEP_STEPS, ParityExchange
    from .wire import authenticate, no_delay, private_dir, send
else:  # started by path (what the engine does): the snapshot process never imports torch or transformers
    from erasure import UnrecoverableError
    from parity import KEEP_STEPS, ParityExchange
    from wire import authenticate, no_delay, private_dir, send

logger = logging.getLogger("hf_dtrain.fault.smp")


class Slot:
    def __init__(self, rank: int, index: int, size: int):
        self.rank, self.index = rank, index
        self.fd = os.memfd_create(f"hf_dtrain_r{rank}_s{index}", os.MFD_CLOEXEC)
        self.size = 0
        self.manifest: dict | None = None  # set by a commit; None while being written
        self.resize(size)

    def resize(self, size: int) -> None:
        if size > self.size:
            os.ftruncate(self.fd, size)
            self.size = size

    def write(self, data) -> None:
        """``data`` (any buffer) at the slot's start: one kernel copy."""
        self.resize(len(data))
        if os.pwrite(self.fd, memoryview(data), 0) != len(data):
            raise OSError(f"short write into rank {self.rank}'s snapshot slot")


class SnapshotManager(ParityExchange):
    """The SMP's state and request handling (``serve`` runs it)."""

    HANDSHAKE_SECONDS = 5.0  # a connection that has not authenticated by then is dropped (it blocks no other)

    def __init__(
        self, directory: str, node: int, key: bytes, host: str = "127.0.0.1", idle_exit: float = 300.0, port: int = 0
    ):
        self.dir, self.node, self.key, self.host, self.port = directory, node, key, host, port
        self.idle_exit = idle_exit  # nothing of the job alive for this long: it is gone, free the memory
        self.connected = 0  # trainers connected over the local socket
        self.trainers: dict[int, int] = {}  # pid -> rank of the local trainers seen
        self.agents: set[int] = set()  # pids of the launchers that may restart the trainers (torchrun's agent)
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
        self._sending: int | None = None  # the step the sender is exchanging now
        self.complete_at: dict[int, set[int]] = {}  # step -> group positions whose parity blocks are complete
        self._send_cv = threading.Condition(self.lock)

    # ---------------------------------------------------------------- local (trainer) requests
    def _rank_slots(self, rank: int) -> list[Slot]:
        if rank not in self.slots:
            self.slots[rank] = [Slot(rank, i, 0) for i in range(KEEP_STEPS)]
        return self.slots[rank]

    def complete_steps(self, rank: int) -> list[int]:
        return sorted(s.manifest["step"] for s in self.slots.get(rank, []) if s.manifest)

    def _slot_with(self, rank: int, step: int) -> Slot | None:
        return next((s for s in self.slots.get(rank, []) if s.manifest and s.manifest["step"] == step), None)

    # every request the snapshot process answers: the trainer's (local socket) and the peers' (TCP); anything
    # else is refused with the list
    HANDLERS: ClassVar[dict[str, str]] = {
        name: f"_op_{name}"
        for name in (
            "config",
            "slot",
            "commit",
            "available",
            "open",
            "discard",
            "status",
            "shutdown",
            "piece",
            "holdings",
            "fetch_symbols",
            "complete",
            "ping",
        )
    }

    def handle(self, conn: Connection, msg: dict) -> None:
        op = msg.get("op")
        method = self.HANDLERS.get(op)
        if method is None:
            send(conn, {"error": f"unknown op {op!r}; the snapshot process answers {', '.join(sorted(self.HANDLERS))}"})
            return
        getattr(self, method)(conn, msg)

    def _op_config(self, conn: Connection, msg: dict) -> None:
        with self.lock:
            self.local_ranks = sorted(msg["local_ranks"])
            self.group, self.parity = msg["group"], msg["parity"]
            if msg.get("agent_pid"):
                self.agents.add(int(msg["agent_pid"]))
            self.peers = {int(n): tuple(a) for n, a in msg["peers"].items()}
        send(conn, {"ok": True})

    def _op_slot(self, conn: Connection, msg: dict) -> None:
        # the slot to write the next snapshot into: never the latest complete one, and the older one only once the
        # latest one's parity is complete at every holder (so a node lost at any moment leaves a step to rebuild)
        self.await_parity(msg["rank"], float(msg.get("wait", 0)))
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
            for step in [s for s in self.complete_at if s > msg["after"]]:
                self.complete_at.pop(step)
            if self.parity and msg["after"] >= 0 and all(self._slot_with(r, msg["after"]) for r in self.local_ranks):
                # exchanged again: a node rebuilt in this restore lost the parity blocks it held for this step
                self._send_queue.append(msg["after"])
                self._send_cv.notify_all()
        send(conn, {"ok": True})

    def _op_status(self, conn: Connection, msg: dict) -> None:
        with self.lock:
            send(
                conn,
                {
                    "node": self.node,
                    "pid": os.getpid(),
                    "ranks": {r: self.complete_steps(r) for r in self.slots},
                    "parity_steps": sorted(self.parity_blocks),
                    "events": self.events[-50:],
                },
            )

    def _op_shutdown(self, conn: Connection, msg: dict) -> None:
        send(conn, {"ok": True})
        self._stop.set()

    # ---------------------------------------------------------------- serving
    def job_alive(self) -> bool:
        """A trainer connected or alive, or a launcher alive that may restart them."""
        with self.lock:
            if self.connected:
                return True
            pids = list(self.trainers) + list(self.agents)
        return any(_pid_alive(p) for p in pids)

    def serve(self, ready=None) -> None:
        private_dir(self.dir)
        sock = os.path.join(self.dir, "smp.sock")
        if os.path.exists(sock):
            os.unlink(sock)
        old = os.umask(0o077)
        try:  # authentication runs per connection, with a deadline (_serve_conn), not in the accept loop
            local = Listener(sock, family="AF_UNIX", backlog=64)
        finally:
            os.umask(old)
        try:
            peer = Listener((self.host, self.port), family="AF_INET", backlog=64)
        except OSError:  # the previous process's port (a re-spawn) is taken: peers learn the new one on relaunch
            peer = Listener((self.host, 0), family="AF_INET", backlog=64)
        info = {"pid": os.getpid(), "node": self.node, "address": list(peer.address)}
        tmp = os.path.join(self.dir, "smp.json.tmp")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(info, f)
        os.replace(tmp, os.path.join(self.dir, "smp.json"))
        for listener, is_local in ((local, True), (peer, False)):
            threading.Thread(target=self._accept, args=(listener, is_local), daemon=True).start()
        threading.Thread(target=self._sender, daemon=True).start()
        if ready is not None:
            ready()
        gone_since = None
        while not self._stop.wait(0.2):
            if self.job_alive():
                gone_since = None
                continue
            gone_since = gone_since or time.monotonic()
            if time.monotonic() - gone_since > self.idle_exit:
                reason = (
                    f"no trainer and no launcher of the job alive for {self.idle_exit:.0f} s "
                    "(fault_tolerance.idle_exit); the in-memory snapshots of this node are dropped"
                )
                logger.warning("SMP node %d: %s; exiting", self.node, reason)
                self._record_exit(reason)
                break
        for listener in (local, peer):
            listener.close()
        for f in ("smp.json", "smp.sock"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.dir, f))

    def _record_exit(self, reason: str) -> None:
        """Why this process ended, for the next launch's message (``exited.json`` in the node directory)."""
        try:
            path = os.path.join(self.dir, "exited.json")
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                json.dump({"pid": os.getpid(), "reason": reason, "time": time.time()}, f)
        except OSError:
            pass

    def _accept(self, listener: Listener, is_local: bool) -> None:
        while not self._stop.is_set():
            try:
                conn = listener.accept()
            except Exception:  # the listener closed
                if self._stop.is_set():
                    return
                continue
            threading.Thread(target=self._serve_conn, args=(conn, is_local), daemon=True).start()

    def _serve_conn(self, conn: Connection, is_local: bool = True) -> None:
        try:
            if not is_local:
                no_delay(conn)
            authenticate(conn, self.key, self.HANDSHAKE_SECONDS)
        except Exception:  # wrong key, silence past the deadline, or a closed socket: drop it
            conn.close()
            return
        if is_local:
            with self.lock:
                self.connected += 1
        try:
            while not self._stop.is_set():
                raw = conn.recv_bytes()
                try:
                    msg = json.loads(raw)
                    if not isinstance(msg, dict):
                        raise ValueError(f"a request is a JSON object, got {type(msg).__name__}")
                    if is_local and isinstance(msg.get("pid"), int):
                        with self.lock:
                            self.trainers.setdefault(msg["pid"], msg.get("rank", -1))
                    self.handle(conn, msg)
                except (EOFError, OSError):
                    raise
                except Exception as e:  # a malformed or bad request: say why, keep serving this connection
                    logger.warning("SMP node %d: refused a request: %s: %s", self.node, type(e).__name__, e)
                    send(conn, {"error": f"{type(e).__name__}: {e}"})
        except (EOFError, OSError):
            pass
        finally:
            conn.close()
            if is_local:
                with self.lock:
                    self.connected -= 1


def _pid_alive(pid: int) -> bool:
    """``pid`` runs (a zombie waiting for its parent to reap it counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="private directory for the socket (created 0700)")
    ap.add_argument("--node", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1", help="address peers reach this node's SMP on")
    ap.add_argument(
        "--port",
        type=int,
        default=0,
        help="TCP port for the peers (0: any; a re-spawn reuses its predecessor's, so the peers' addresses stay right)",
    )
    ap.add_argument(
        "--idle-exit",
        type=float,
        default=300.0,
        help="exit after this many seconds with no trainer and no launcher of the job alive",
    )
    args = ap.parse_args(argv)
    key = bytes.fromhex(sys.stdin.readline().strip())
    if len(key) < 16:
        raise SystemExit("SMP: expected a hex key of at least 16 bytes on stdin")
    logging.basicConfig(level=logging.INFO, format=f"[smp node {args.node}] %(message)s")
    SnapshotManager(args.dir, args.node, key, args.host, args.idle_exit, args.port).serve()


if __name__ == "__main__":
    main()
