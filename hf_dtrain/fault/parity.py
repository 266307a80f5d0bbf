"""The snapshot process's side of erasure coding across nodes: after every local rank has committed a step, the
node's shard is cut into pieces sent to the codewords' parity holders; parity blocks received from peers are kept
for the last steps; a fresh process in a lost node's place finds the steps it can rebuild and rebuilds its shard
from the survivors' shards and parity, checking every rank's checksum. A mixin of ``SnapshotManager`` (the
``_op_*`` methods answer the peers' requests).

Imports only the standard library, numpy, xxhash and zfec (the snapshot process imports it by path, without torch)."""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

import numpy as np

if __package__:
    from .erasure import ErasureCode, UnrecoverableError
    from .wire import checksum, connect, recv, recv_array, send, send_ranges
else:  # imported by the snapshot process started by path
    from erasure import ErasureCode, UnrecoverableError
    from wire import checksum, connect, recv, recv_array, send, send_ranges

logger = logging.getLogger("hf_dtrain.fault.smp")

KEEP_STEPS = 2  # complete steps kept per rank (the latest and the one before), and parity steps kept
# fault injection: seconds the exchange of every step is held back, as a loaded host or a slow link would (tests)
EXCHANGE_DELAY = float(os.environ.get("HF_DTRAIN_FT_EXCHANGE_DELAY", "0") or 0)


class ParityExchange:
    """Peer requests and parity bookkeeping of a ``SnapshotManager`` (which holds the state they use)."""

    @property
    def code(self) -> ErasureCode:
        return ErasureCode(len(self.group), self.parity)

    @property
    def position(self) -> int:
        return self.group.index(self.node)

    def _shard_slots(self, step: int) -> tuple[list, dict]:
        """This node's slots at ``step`` (one per local rank, in rank order) and its node manifest."""
        with self.lock:
            slots = [self._slot_with(r, step) for r in self.local_ranks]
            if not self.local_ranks or any(s is None for s in slots):
                raise KeyError(f"node {self.node} has no complete snapshot of every local rank at step {step}")
            manifest = {"node": self.node, "step": step, "ranks": [s.manifest for s in slots]}
            fds = [(os.dup(s.fd), s.manifest["nbytes"]) for s in slots]
        manifest["shard_bytes"] = sum(n for _, n in fds)
        return fds, manifest

    @staticmethod
    def _ranges(fds: list, start: int, end: int) -> list[tuple[int, int, int]]:
        """Bytes ``start:end`` of the shard laid over ``fds``, as ``[(fd, offset, count)]``."""
        out, offset = [], 0
        for fd, n in fds:
            lo, hi = max(start, offset), min(end, offset + n)
            if lo < hi:
                out.append((fd, lo - offset, hi - lo))
            offset += n
        return out

    def _sender(self) -> None:
        """Sends this node's pieces of each newly complete step to the codewords' parity holders (the newest step
        first; older queued steps are dropped). A holder that cannot be reached does not stop the others."""
        while not self._stop.is_set():
            with self._send_cv:
                while not self._send_queue and not self._stop.is_set():
                    self._send_cv.wait(0.5)
                if self._stop.is_set():
                    return
                step = max(self._send_queue)
                self._send_queue.clear()
                self._sending = step
            if EXCHANGE_DELAY:
                time.sleep(EXCHANGE_DELAY)
            failed = []
            try:
                fds, manifest = self._shard_slots(step)
            except KeyError as e:  # the step's slots went away: nothing sent
                fds, manifest = [], None
                failed.append(str(e))
            try:
                code, me = self.code, self.position
                for p in code.codewords_of(me) if manifest else []:
                    ranges = self._ranges(fds, *code.piece_range(me, p, manifest["shard_bytes"]))
                    for holder in code.parity_holders(p):
                        node = self.group[holder]
                        header = {"op": "piece", "step": step, "codeword": p, "from": me, "manifest": manifest}
                        try:  # refused for 3 s: that node's snapshot process is gone
                            conn, reply = self._peer_call(node, header, ranges, connect_timeout=3.0)
                            conn.close()
                            if "error" in reply:
                                raise RuntimeError(reply["error"])
                        except Exception as e:  # that holder's parity for this step stays incomplete
                            failed.append(f"node {node}: {type(e).__name__}: {e}")
            finally:
                for fd, _ in fds:
                    os.close(fd)
            if manifest and not self._unchanged(step, manifest):
                failed.append("a slot was handed out for a newer step while it was sent (its parity is torn)")
            if failed:
                self.events.append(f"step {step}: parity exchange failed: {'; '.join(failed)}")
                logger.warning(
                    "SMP node %d: parity exchange for step %d failed: %s", self.node, step, "; ".join(failed)
                )
            with self._send_cv:
                self._sending = None
                self._send_cv.notify_all()

    def _unchanged(self, step: int, manifest: dict) -> bool:
        """Every local rank's slot still holds what ``manifest`` describes (no newer snapshot was written into it)."""
        with self.lock:
            slots = [self._slot_with(r, step) for r in self.local_ranks]
            return all(
                s is not None and s.manifest["checksum"] == m["checksum"] for s, m in zip(slots, manifest["ranks"])
            )

    def receive_piece(self, header: dict, piece) -> None:
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
        blocks = code.encode([got[n] for n in data])
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
            if step in self._complete_parity_steps() and self.position not in self.complete_at.get(step, ()):
                self._mark_complete(step, self.position)
                threading.Thread(target=self._announce, args=(step,), daemon=True).start()

    def _mark_complete(self, step: int, position: int) -> None:
        """(Under the lock.) ``position``'s parity blocks of ``step`` are complete; slot requests waiting on it
        are woken."""
        self.complete_at.setdefault(step, set()).add(position)
        for old in sorted(self.complete_at)[: -2 * KEEP_STEPS]:
            self.complete_at.pop(old)
        self._send_cv.notify_all()

    def _announce(self, step: int) -> None:
        """Tells every group peer that this node's parity blocks of ``step`` are complete."""
        for node in self.group:
            if node != self.node:
                try:
                    conn, _ = self._peer_call(
                        node, {"op": "complete", "step": step, "from": self.position}, timeout=5.0, connect_timeout=2.0
                    )
                    conn.close()
                except (OSError, EOFError, TimeoutError):
                    pass  # a peer down: it is being replaced, and asks again when it rebuilds

    def _op_complete(self, conn: Connection, msg: dict) -> None:
        with self.lock:
            self._mark_complete(int(msg["step"]), int(msg["from"]))
        send(conn, {"ok": True})

    def globally_complete(self, step: int) -> bool:
        """Every node of the group holds its complete parity blocks of ``step`` (every node is a holder)."""
        return len(self.complete_at.get(step, ())) >= len(self.group)

    def await_parity(self, rank: int, wait: float) -> None:
        """Before ``rank``'s older slot is reused: wait (at most ``wait`` seconds) until its newest snapshot's
        parity is complete at every holder. Every node then holds a step that a lost node can be rebuilt at,
        whenever it is lost: the newest step every node committed, or the one before, whose exchange every node
        finished before writing past it."""
        if not wait or not self.parity or len(self.group) < 2:
            return
        deadline = time.monotonic() + wait
        with self._send_cv:
            steps = self.complete_steps(rank)
            if not steps:
                return
            newest = steps[-1]
            while not self.globally_complete(newest) and not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    self.events.append(
                        f"step {newest}: parity not complete at every holder after {wait:.0f} s; "
                        "its older slot is reused anyway"
                    )
                    logger.warning(
                        "SMP node %d: step %d's parity is not complete at every holder after %.0f s "
                        "(a peer down?); reusing rank %d's older slot anyway",
                        self.node,
                        newest,
                        wait,
                        rank,
                    )
                    return
                self._send_cv.wait(min(left, 0.5))

    def _complete_parity_steps(self) -> list[int]:
        """Steps for which this node holds every parity block it is responsible for."""
        code, me = self.code, self.position
        mine = {(p, l) for p in range(code.group_size) for l, h in enumerate(code.parity_holders(p)) if h == me}
        return sorted(s for s, blocks in self.parity_blocks.items() if mine <= set(blocks))

    def _op_piece(self, conn: Connection, msg: dict) -> None:
        piece = recv_array(conn)
        self.receive_piece(msg, piece)
        send(conn, {"ok": True})

    def _op_holdings(self, conn: Connection, msg: dict) -> None:
        # what this node can contribute to a rebuild. Asked by a fresh snapshot process in a lost node's place: its
        # predecessor's parity blocks are gone (its notices no longer hold), and this node's exchange in flight is
        # finished first (bounded), so the answer does not miss a step that is about to be complete.
        deadline = time.monotonic() + 5.0
        with self._send_cv:
            if "from" in msg:
                for holders in self.complete_at.values():
                    holders.discard(int(msg["from"]))
            while (self._send_queue or self._sending is not None) and time.monotonic() < deadline:
                self._send_cv.wait(0.2)
        with self.lock:
            ranks_steps = [set(self.complete_steps(r)) for r in self.local_ranks]
            local = sorted(set.intersection(*ranks_steps)) if ranks_steps else []
            send(
                conn,
                {
                    "local_steps": local,
                    "parity_steps": self._complete_parity_steps() if self.parity else [],
                    "manifests": {str(s): {str(n): m for n, m in ms.items()} for s, ms in self.manifests.items()},
                },
            )

    def _op_fetch_symbols(self, conn: Connection, msg: dict) -> None:
        """What a rebuilding peer needs from this node at ``msg["step"]``: its pieces of ``msg["pieces"]`` (codewords)
        and the parity blocks ``msg["parity"]`` (``[codeword, l]``) it holds, unpadded, in that order."""
        step = msg["step"]
        with self.lock:
            blocks = dict(self.parity_blocks.get(step, {}))
        for p, l in msg.get("parity", []):
            if (p, l) not in blocks:
                send(conn, {"error": f"node {self.node} holds no parity block ({p}, {l}) of step {step}"})
                return
        fds = []
        try:
            pieces = []
            if msg.get("pieces"):
                try:
                    fds, manifest = self._shard_slots(step)
                except KeyError as e:
                    send(conn, {"error": str(e)})
                    return
                code, me = self.code, self.position
                for p in msg["pieces"]:
                    pieces.append(self._ranges(fds, *code.piece_range(me, p, manifest["shard_bytes"])))
            blocks = [blocks[(p, l)] for p, l in msg.get("parity", [])]
            send(conn, {"sizes": [sum(c for _, _, c in r) for r in pieces] + [len(b) for b in blocks]})
            for r in pieces:
                send_ranges(conn, r)
            for b in blocks:
                conn.send_bytes(b)
        finally:
            for fd, _ in fds:
                os.close(fd)

    def _op_ping(self, conn: Connection, msg: dict) -> None:
        send(conn, {"node": self.node, "pid": os.getpid()})

    def _peer_call(
        self,
        node: int,
        header: dict,
        ranges: list | None = None,
        timeout: float = 30.0,
        connect_timeout: float | None = None,
    ):
        """One request to a peer's snapshot process (``ranges``: file byte ranges sent after the header, see
        ``send_ranges``); returns the open connection and the answer."""
        host, port = self.peers[node]
        conn = connect((host, port), self.key, timeout if connect_timeout is None else connect_timeout)
        try:
            send(conn, header)
            if ranges is not None:
                send_ranges(conn, ranges)
            if not conn.poll(timeout):
                raise TimeoutError(f"SMP of node {node} did not answer {header['op']} in {timeout:.0f} s")
            return conn, recv(conn)
        except BaseException:
            conn.close()
            raise

    def _survey(self) -> tuple[dict[int, dict], list[int]]:
        """Every group peer's holdings, asked in parallel: ``({position: holdings}, [nodes that did not answer])``."""

        def ask(node):
            try:
                conn, info = self._peer_call(node, {"op": "holdings", "from": self.position}, timeout=10.0)
                conn.close()
                return None if "error" in info else info  # e.g. a peer not configured yet: it holds nothing
            except (OSError, EOFError, TimeoutError, KeyError):
                return None

        others = [(pos, node) for pos, node in enumerate(self.group) if node != self.node]
        with ThreadPoolExecutor(max(1, len(others))) as pool:
            answers = list(pool.map(ask, [node for _, node in others]))
        survivors = {pos: info for (pos, _), info in zip(others, answers) if info is not None}
        down = [node for (_, node), info in zip(others, answers) if info is None]
        with self.lock:  # a fresh process learns which peers' parity is complete (they announced it to its predecessor)
            for pos, info in survivors.items():
                for step in info.get("parity_steps", []):
                    self._mark_complete(int(step), pos)
        return survivors, down

    def recoverable_steps(self) -> tuple[list[int], str]:
        """Steps at which this (empty) node's shard can be rebuilt: every survivor holds the step and the parity of
        every codeword this node is part of survives."""
        if not self.parity:
            return [], ""  # no parity: another rank holding steps this one lacks tells the restore
        code, me = self.code, self.position
        survivors, down = self._survey()
        if not any(info["local_steps"] or info["manifests"] for info in survivors.values()):
            return [], ""  # nobody has snapshots: a fresh start, nothing to recover
        for pos in [pos for pos, info in survivors.items() if not info["local_steps"]]:
            down.append(self.group[pos])  # a fresh process in a lost node's place holds nothing
            survivors.pop(pos)
        lost = [self.group[me]] + down
        if len(lost) > code.parity:
            return [], (
                f"{len(lost)} nodes of erasure group {self.group} are lost ({sorted(lost)}); parity "
                f"{code.parity} covers {code.parity}"
            )
        candidates = None
        for info in survivors.values():
            steps = set(info["local_steps"])
            candidates = steps if candidates is None else candidates & steps
        good = []
        for step in sorted(candidates or ()):
            ok = True
            for p in range(code.group_size):
                if me not in code.data_nodes(p) and not any(self.group[h] in down for h in code.parity_holders(p)):
                    continue
                for _l, h in enumerate(code.parity_holders(p)):
                    if h in survivors and step not in survivors[h]["parity_steps"]:
                        ok = False
            if ok and any(str(self.node) in info["manifests"].get(str(step), {}) for info in survivors.values()):
                good.append(step)
        return good, "" if good else "no step has both the survivors' snapshots and complete parity"

    def _fetch_symbols(self, pos: int, step: int, pieces: list[int], parity: list[list[int]]) -> list[np.ndarray]:
        """``_op_fetch_symbols`` of the peer at group position ``pos``: each payload received into its own buffer."""
        conn, head = self._peer_call(
            self.group[pos], {"op": "fetch_symbols", "step": step, "pieces": pieces, "parity": parity}
        )
        try:
            if "error" in head:
                raise KeyError(head["error"])
            out = []
            for n in head["sizes"]:
                buf = recv_array(conn)
                if len(buf) != n:
                    raise EOFError(f"a peer sent a symbol of {len(buf)} bytes, announced {n}")
                out.append(buf)
            return out
        finally:
            conn.close()

    def rebuild(self, step: int) -> None:
        """Rebuild this node's shard at ``step`` from the survivors and install it: only the symbols of this node's
        codewords are fetched, from every survivor at once; parity 1 XORs them straight into the shard; each
        rank's checksum is verified before its slot is written."""
        code, me = self.code, self.position
        t0 = time.perf_counter()
        survivors, down = self._survey()
        t_survey = time.perf_counter()
        mine = next(
            (
                info["manifests"][str(step)][str(self.node)]
                for info in survivors.values()
                if str(self.node) in info["manifests"].get(str(step), {})
            ),
            None,
        )
        if mine is None:
            raise UnrecoverableError(f"no surviving peer holds node {self.node}'s manifest for step {step}")
        lost = [me] + [self.group.index(n) for n in down]
        if len(lost) > code.parity:
            raise UnrecoverableError(
                f"{len(lost)} nodes of erasure group {self.group} are lost; parity {code.parity} covers {code.parity}"
            )
        asks = {pos: ([], []) for pos in survivors}  # position -> (codewords of its pieces, [codeword, l] blocks)
        for p in code.codewords_of(me):
            for n in code.data_nodes(p):
                if n in asks:
                    asks[n][0].append(p)
            for l, h in enumerate(code.parity_holders(p)):
                if h in asks:
                    asks[h][1].append([p, l])
        asks = {pos: a for pos, a in asks.items() if a[0] or a[1]}

        def fetch(pos):
            try:
                return pos, self._fetch_symbols(pos, step, *asks[pos])
            except (OSError, EOFError, TimeoutError, KeyError) as e:
                logger.warning(
                    "SMP node %d: node %d could not send its symbols of step %d: %s",
                    self.node,
                    self.group[pos],
                    step,
                    e,
                )
                return pos, None

        with ThreadPoolExecutor(max(1, len(asks))) as pool:
            got = dict(pool.map(fetch, list(asks)))
        symbols: dict[int, dict[int, np.ndarray]] = {p: {} for p in code.codewords_of(me)}
        for pos, bufs in got.items():
            if bufs is None:
                continue
            pieces, blocks = asks[pos]
            for p, buf in zip(pieces, bufs[: len(pieces)]):
                symbols[p][code.data_nodes(p).index(pos)] = buf
            for (p, l), buf in zip(blocks, bufs[len(pieces) :]):
                symbols[p][code.k + l] = buf
        t1 = time.perf_counter()
        shard = code.rebuild_shard(me, mine["shard_bytes"], lambda p: symbols[p])
        t2 = time.perf_counter()
        offset, installed = 0, []
        for rank_manifest in mine["ranks"]:
            n = rank_manifest["nbytes"]
            data = shard[offset : offset + n]
            offset += n
            if checksum(data) != rank_manifest["checksum"]:
                raise UnrecoverableError(
                    f"rank {rank_manifest['rank']}'s snapshot rebuilt from parity at step {step} fails its checksum"
                )
            installed.append((rank_manifest, data))
        with self.lock:
            for rank_manifest, data in installed:
                slot = self._rank_slots(rank_manifest["rank"])[0]
                slot.manifest = None
                slot.write(data)
                slot.manifest = dict(rank_manifest, rebuilt=True)
            self.events.append(f"rebuilt step {step} from parity (lost: {sorted(self.group[p] for p in lost)})")
        logger.warning(
            "SMP node %d: rebuilt step %d from peers' parity in %.3f s (survey %.3f s, fetched in %.3f s, "
            "decoded in %.3f s, checked and installed in %.3f s)",
            self.node,
            step,
            time.perf_counter() - t0,
            t_survey - t0,
            t1 - t_survey,
            t2 - t1,
            time.perf_counter() - t2,
        )
