"""The snapshot process's side of erasure coding across nodes: after every local rank has committed a step, the
node's shard is cut into pieces sent to the codewords' parity holders; parity blocks received from peers are kept
for the last steps; a fresh process in a lost node's place finds the steps it can rebuild and rebuilds its shard
from the survivors' shards and parity, checking every rank's checksum. A mixin of ``SnapshotManager`` (the
``_op_*`` methods answer the peers' requests).

Imports only the standard library, numpy, xxhash and zfec (the snapshot process imports it by path, without torch)."""

from __future__ import annotations

import logging
import os
import time
from multiprocessing.connection import Connection
from typing import Optional

if __package__:
    from .erasure import ErasureCode, UnrecoverableError
    from .wire import checksum, connect, recv, send
else:  # imported by the snapshot process started by path
    from erasure import ErasureCode, UnrecoverableError
    from wire import checksum, connect, recv, send

logger = logging.getLogger("hf_dtrain.fault.smp")

KEEP_STEPS = 2  # complete steps kept per rank (the latest and the one before), and parity steps kept


class ParityExchange:
    """Peer requests and parity bookkeeping of a ``SnapshotManager`` (which holds the state they use)."""

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

    def _op_piece(self, conn: Connection, msg: dict) -> None:
        piece = conn.recv_bytes()
        self.receive_piece(msg, piece)
        send(conn, {"ok": True})

    def _op_holdings(self, conn: Connection, msg: dict) -> None:
        # what this node can contribute to a rebuild
        with self.lock:
            ranks_steps = [set(self.complete_steps(r)) for r in self.local_ranks]
            local = sorted(set.intersection(*ranks_steps)) if ranks_steps else []
            send(conn, {"local_steps": local, "parity_steps": self._complete_parity_steps(),
                        "manifests": {str(s): {str(n): m for n, m in ms.items()}
                                      for s, ms in self.manifests.items()}})

    def _op_fetch_shard(self, conn: Connection, msg: dict) -> None:
        try:
            data, manifest = self.shard(msg["step"])
        except KeyError as e:
            send(conn, {"error": str(e)})
            return
        send(conn, {"manifest": manifest}, data)

    def _op_fetch_parity(self, conn: Connection, msg: dict) -> None:
        with self.lock:
            blocks = dict(self.parity_blocks.get(msg["step"], {}))
        keys = sorted(blocks)
        send(conn, {"keys": keys})
        for k in keys:
            conn.send_bytes(blocks[k])

    def _op_ping(self, conn: Connection, msg: dict) -> None:
        send(conn, {"node": self.node, "pid": os.getpid()})

    def _peer_call(self, node: int, header: dict, payload: Optional[bytes] = None, timeout: float = 30.0):
        host, port = self.peers[node]
        conn = connect((host, port), self.key, timeout)
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
        t0 = time.perf_counter()
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
        t1 = time.perf_counter()
        shard = code.rebuild(lost, shards, blocks, lengths)[me]
        t2 = time.perf_counter()
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
        logger.warning("SMP node %d: rebuilt step %d from peers' parity in %.3f s (fetched in %.3f s, decoded in "
                       "%.3f s, checked and installed in %.3f s)", self.node, step, time.perf_counter() - t0, t1 - t0,
                       t2 - t1, time.perf_counter() - t2)
