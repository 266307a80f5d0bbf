"""The snapshot management process (SMP): one per node, outliving the trainers on it.

It owns the snapshots: two slots per local rank, each an anonymous ``memfd`` (no name in ``/dev/shm``; only a process
the SMP hands the descriptor to over its authenticated Unix socket can map it). A trainer writes a snapshot into the
slot that does not hold its latest complete one, then commits it with a manifest (step, bytes, checksum, model
fingerprint, world size): the commit is the last thing written, so a trainer killed mid-snapshot leaves the
previous snapshot whole. After every rank of the node has committed a step, the SMP sends the pieces of the node's
shard to the peers holding the codewords' parity (``erasure.ErasureCode``) and keeps the parity blocks peers send it,
for the last two steps. A fresh SMP that replaces a lost node rebuilds its shard from the survivors' shards and
parity and checks it against the replicated manifests' checksums.

Transport: ``multiprocessing.connection`` with an ``authkey`` (HMAC challenge both ways), bytes only
(``send_bytes``/``recv_bytes``: JSON headers and raw payloads, never pickle). The Unix socket lives in a 0700
directory; the key is read from stdin, never from the command line.

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
from multiprocessing.connection import Client, Connection, Listener
from multiprocessing.reduction import recv_handle, send_handle
from typing import Optional

if __package__:
    from .erasure import ErasureCode, UnrecoverableError
else:  # started by path (what the engine does): the snapshot process never imports torch or transformers
    from erasure import ErasureCode, UnrecoverableError

logger = logging.getLogger("hf_dtrain.fault.smp")

KEEP_STEPS = 2  # complete steps kept per rank (the latest and the one before), and parity steps kept


def checksum(buf) -> str:
    """xxh3-64 of ``buf`` (hex): GB/s, so it runs on every snapshot; strong enough to catch corruption."""
    import xxhash

    return xxhash.xxh3_64_hexdigest(memoryview(buf))


def send(conn: Connection, header: dict, payload: Optional[bytes] = None) -> None:
    conn.send_bytes(json.dumps(header).encode())
    if payload is not None:
        conn.send_bytes(payload)


def recv(conn: Connection) -> dict:
    return json.loads(conn.recv_bytes())


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


class SnapshotManager:
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

    def handle_local(self, conn: Connection, msg: dict) -> None:
        op = msg["op"]
        if op == "config":
            with self.lock:
                self.local_ranks = sorted(msg["local_ranks"])
                self.group, self.parity = msg["group"], msg["parity"]
                self.peers = {int(n): tuple(a) for n, a in msg["peers"].items()}
            send(conn, {"ok": True})
        elif op == "slot":  # the slot to write the next snapshot into: never the latest complete one
            with self.lock:
                slots = self._rank_slots(msg["rank"])
                # an unfinished slot first, else the oldest complete one
                target = min(slots, key=lambda s: (s.manifest is not None, s.manifest["step"] if s.manifest else 0))
                target.manifest = None  # being written: not served until committed
                target.resize(msg["nbytes"])
            send(conn, {"slot": target.index, "size": target.size})
            send_handle(conn, target.fd, msg["pid"])
        elif op == "commit":
            with self.lock:
                slot = self._rank_slots(msg["rank"])[msg["slot"]]
                slot.manifest = dict(msg["manifest"], rank=msg["rank"])
                step = slot.manifest["step"]
                if self.parity and all(self._slot_with(r, step) for r in self.local_ranks):
                    self._send_queue.append(step)
                    self._send_cv.notify()
            send(conn, {"ok": True})
        elif op == "available":  # complete steps of a rank; for a rank with none, the steps peers can rebuild
            with self.lock:
                local = self.complete_steps(msg["rank"])
            if local or not msg.get("recover", True):
                send(conn, {"steps": local, "source": "memory"})
            else:
                steps, reason = self.recoverable_steps()
                send(conn, {"steps": steps, "source": "parity", "reason": reason})
        elif op == "open":  # the manifest and descriptor of a rank's snapshot at a step (rebuilt if needed)
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
        elif op == "discard":  # after a restore to step S: snapshots past S belong to the failed timeline
            with self.lock:
                for slot in self._rank_slots(msg["rank"]):
                    if slot.manifest and slot.manifest["step"] > msg["after"]:
                        slot.manifest = None
            send(conn, {"ok": True})
        elif op == "status":
            with self.lock:
                send(conn, {"node": self.node, "pid": os.getpid(), "ranks": {r: self.complete_steps(r)
                                                                             for r in self.slots},
                            "parity_steps": sorted(self.parity_blocks), "events": self.events[-50:]})
        elif op == "shutdown":
            send(conn, {"ok": True})
            self._stop.set()
        else:
            self.handle_peer(conn, msg)

    # ---------------------------------------------------------------- erasure coding with peers
    @property
    def code(self) -> ErasureCode:
        return ErasureCode(len(self.group), self.parity)

    @property
    def position(self) -> int:
        return self.group.index(self.node)

    def shard(self, step: int) -> tuple[bytes, dict]:
        """This node's shard at ``step`` (its ranks' snapshots, concatenated) and its node manifest."""
        with self.lock:
            slots = [self._slot_with(r, step) for r in self.local_ranks]
            if not self.local_ranks or any(s is None for s in slots):
                raise KeyError(f"node {self.node} has no complete snapshot of every local rank at step {step}")
            manifest = {"node": self.node, "step": step, "ranks": [s.manifest for s in slots]}
            data = b"".join(s.read(s.manifest["nbytes"]) for s in slots)
        manifest["shard_bytes"] = len(data)
        return data, manifest

    def _sender(self) -> None:
        """Sends this node's pieces of each newly complete step to the codewords' parity holders (the newest step
        first; older queued steps are dropped)."""
        while not self._stop.is_set():
            with self._send_cv:
                while not self._send_queue and not self._stop.is_set():
                    self._send_cv.wait(0.5)
                if self._stop.is_set():
                    return
                step = max(self._send_queue)
                self._send_queue.clear()
            try:
                data, manifest = self.shard(step)
                code, me = self.code, self.position
                for p in code.codewords_of(me):
                    piece = code.piece(me, data, p)
                    for holder in code.parity_holders(p):
                        node = self.group[holder]
                        header = {"op": "piece", "step": step, "codeword": p, "from": me, "manifest": manifest}
                        if node == self.node:
                            self.receive_piece(header, piece)
                        else:
                            self._peer_call(node, header, piece)
            except Exception as e:  # a peer down: its parity for this step stays incomplete, training goes on
                self.events.append(f"step {step}: parity exchange failed: {type(e).__name__}: {e}")
                logger.warning("SMP node %d: parity exchange for step %d failed: %s", self.node, step, e)

    def receive_piece(self, header: dict, piece: bytes) -> None:
        step, p, frm = header["step"], header["codeword"], header["from"]
        with self.lock:
            self.manifests.setdefault(step, {})[self.group[frm]] = header["manifest"]
            got = self.pieces.setdefault((step, p), {})
            got[frm] = piece
            code = self.code
            data = code.data_nodes(p)
            if not all(n in got for n in data):
                return
            self.pieces.pop((step, p))
        block = max(len(got[n]) for n in data)
        padded = [got[n] + bytes(block - len(got[n])) for n in data]
        blocks = code.encode(padded)
        with self.lock:
            store = self.parity_blocks.setdefault(step, {})
            for l, holder in enumerate(code.parity_holders(p)):
                if holder == self.position:
                    store[(p, l)] = blocks[l]
            for old in sorted(self.parity_blocks)[:-KEEP_STEPS]:
                self.parity_blocks.pop(old, None)
                self.manifests.pop(old, None)
            for key in [k for k in self.pieces if k[0] < step - KEEP_STEPS]:
                self.pieces.pop(key)

    def _complete_parity_steps(self) -> list[int]:
        """Steps for which this node holds every parity block it is responsible for."""
        code, me = self.code, self.position
        mine = {(p, l) for p in range(code.group_size) for l, h in enumerate(code.parity_holders(p)) if h == me}
        return sorted(s for s, blocks in self.parity_blocks.items() if mine <= set(blocks))

    def handle_peer(self, conn: Connection, msg: dict) -> None:
        op = msg["op"]
        if op == "piece":
            piece = conn.recv_bytes()
            self.receive_piece(msg, piece)
            send(conn, {"ok": True})
        elif op == "holdings":  # what this node can contribute to a rebuild
            with self.lock:
                ranks_steps = [set(self.complete_steps(r)) for r in self.local_ranks]
                local = sorted(set.intersection(*ranks_steps)) if ranks_steps else []
                send(conn, {"local_steps": local, "parity_steps": self._complete_parity_steps(),
                            "manifests": {str(s): {str(n): m for n, m in ms.items()}
                                          for s, ms in self.manifests.items()}})
        elif op == "fetch_shard":
            try:
                data, manifest = self.shard(msg["step"])
            except KeyError as e:
                send(conn, {"error": str(e)})
                return
            send(conn, {"manifest": manifest}, data)
        elif op == "fetch_parity":
            with self.lock:
                blocks = dict(self.parity_blocks.get(msg["step"], {}))
            keys = sorted(blocks)
            send(conn, {"keys": keys})
            for k in keys:
                conn.send_bytes(blocks[k])
        elif op == "ping":
            send(conn, {"node": self.node, "pid": os.getpid()})
        else:
            send(conn, {"error": f"unknown op {op!r}"})

    def _peer_call(self, node: int, header: dict, payload: Optional[bytes] = None, timeout: float = 30.0):
        host, port = self.peers[node]
        conn = _connect((host, port), self.key, timeout)
        try:
            send(conn, header, payload)
            if not conn.poll(timeout):
                raise TimeoutError(f"SMP of node {node} did not answer {header['op']} in {timeout:.0f} s")
            return conn, recv(conn)
        except BaseException:
            conn.close()
            raise

    def recoverable_steps(self) -> tuple[list[int], str]:
        """Steps at which this (empty) node's shard can be rebuilt: every survivor holds the step and the parity of
        every codeword this node is part of survives."""
        if not self.parity:
            return [], ""  # no parity: another rank holding steps this one lacks tells the restore
        code, me = self.code, self.position
        survivors, down = {}, []
        for pos, node in enumerate(self.group):
            if node == self.node:
                continue
            try:
                conn, info = self._peer_call(node, {"op": "holdings"}, timeout=10.0)
                conn.close()
                survivors[pos] = info
            except (OSError, EOFError, TimeoutError, KeyError):
                down.append(node)
        if not any(info["local_steps"] or info["manifests"] for info in survivors.values()):
            return [], ""  # nobody has snapshots: a fresh start, nothing to recover
        for pos in [pos for pos, info in survivors.items() if not info["local_steps"]]:
            down.append(self.group[pos])  # a fresh process in a lost node's place holds nothing
            survivors.pop(pos)
        lost = [self.group[me]] + down
        if len(lost) > code.parity:
            return [], (f"{len(lost)} nodes of erasure group {self.group} are lost ({sorted(lost)}); parity "
                        f"{code.parity} covers {code.parity}")
        candidates = None
        for pos, info in survivors.items():
            steps = set(info["local_steps"])
            candidates = steps if candidates is None else candidates & steps
        good = []
        for step in sorted(candidates or ()):
            ok = True
            for p in range(code.group_size):
                if me not in code.data_nodes(p) and not any(self.group[h] in down for h in code.parity_holders(p)):
                    continue
                for l, h in enumerate(code.parity_holders(p)):
                    if h in survivors and step not in survivors[h]["parity_steps"]:
                        ok = False
            if ok and any(str(self.node) in info["manifests"].get(str(step), {}) for info in survivors.values()):
                good.append(step)
        return good, "" if good else "no step has both the survivors' snapshots and complete parity"

    def rebuild(self, step: int) -> None:
        """Rebuild this node's shard at ``step`` from the survivors, verify each rank's checksum, and install it."""
        code, me = self.code, self.position
        shards, blocks, manifests, down = {}, {}, {}, []
        for pos, node in enumerate(self.group):
            if node == self.node:
                continue
            try:
                conn, head = self._peer_call(node, {"op": "fetch_shard", "step": step})
                try:
                    if "error" in head:
                        raise KeyError(head["error"])
                    shards[pos] = conn.recv_bytes()
                    manifests[pos] = head["manifest"]
                finally:
                    conn.close()
                conn, head = self._peer_call(node, {"op": "fetch_parity", "step": step})
                try:
                    for p, l in head["keys"]:
                        blocks[(p, l)] = conn.recv_bytes()
                finally:
                    conn.close()
                conn, info = self._peer_call(node, {"op": "holdings"})
                conn.close()
                mine = info["manifests"].get(str(step), {}).get(str(self.node))
                if mine is not None:
                    manifests[me] = mine
            except (OSError, EOFError, TimeoutError, KeyError):
                down.append(node)
        if me not in manifests:
            raise UnrecoverableError(f"no surviving peer holds node {self.node}'s manifest for step {step}")
        lost = [me] + [self.group.index(n) for n in down]
        lengths = {pos: m["shard_bytes"] for pos, m in manifests.items()}
        for pos in lost:
            if pos not in lengths:
                raise UnrecoverableError(f"{len(lost)} nodes of erasure group {self.group} are lost; parity "
                                         f"{code.parity} covers {code.parity}")
        shard = code.rebuild(lost, shards, blocks, lengths)[me]
        offset = 0
        installed = []
        for rank_manifest in manifests[me]["ranks"]:
            n = rank_manifest["nbytes"]
            data = shard[offset:offset + n]
            offset += n
            if checksum(data) != rank_manifest["checksum"]:
                raise UnrecoverableError(f"rank {rank_manifest['rank']}'s snapshot rebuilt from parity at step "
                                         f"{step} fails its checksum")
            installed.append((rank_manifest, data))
        with self.lock:
            for rank_manifest, data in installed:
                slot = self._rank_slots(rank_manifest["rank"])[0]
                slot.write(data)
                slot.manifest = dict(rank_manifest, rebuilt=True)
            self.events.append(f"rebuilt step {step} from parity (lost: {sorted(self.group[p] for p in lost)})")
        logger.warning("SMP node %d: rebuilt step %d from peers' parity", self.node, step)

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
                    self.handle_local(conn, msg)
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


def _connect(address, key: bytes, timeout: float) -> Connection:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Client(address, family="AF_UNIX" if isinstance(address, str) else "AF_INET", authkey=key)
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise


class SMPClient:
    """A trainer's connection to its node's SMP."""

    def __init__(self, directory: str, key: bytes, timeout: float = 30.0):
        self.dir, self.key, self.timeout = directory, key, timeout
        self.conn = _connect(os.path.join(directory, "smp.sock"), key, timeout)
        self.lock = threading.Lock()

    def call(self, header: dict, want_fd: bool = False):
        with self.lock:
            send(self.conn, dict(header, pid=os.getpid()))
            if not self.conn.poll(self.timeout):
                raise TimeoutError(f"the snapshot process in {self.dir} did not answer {header['op']} in "
                                   f"{self.timeout:.0f} s")
            reply = recv(self.conn)
            if "error" in reply:
                return reply, None
            fd = recv_handle(self.conn) if want_fd else None
            return reply, fd

    def info(self) -> dict:
        with open(os.path.join(self.dir, "smp.json")) as f:
            return json.load(f)

    def close(self) -> None:
        self.conn.close()


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
