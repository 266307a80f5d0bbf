"""This node's snapshot process, as one rank sees it: the job's private directories and shared key, starting the
process (any local rank may; a lock lets one do it) or connecting to the one that answers, telling it the node's
ranks, erasure group and peers, starting a new one when it is lost, and the requests a rank makes of it (slots,
commits, the snapshots it holds, reading one back)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import struct
import subprocess
import sys

import torch

from hf_dtrain.errors import SettingsError

from .errors import SnapshotError
from .record import write_private
from .state import parse
from .wire import SMPClient, checksum, connect, private_dir, runtime_root

logger = logging.getLogger("hf_dtrain.fault.snapshot")

# connection failures that mean the node's snapshot process is gone (re-spawned by the trainers)
SMP_LOST = (EOFError, BrokenPipeError, ConnectionResetError, ConnectionRefusedError, FileNotFoundError)


def default_directory(job: str) -> str:
    """This job's private directory for its snapshot processes (sockets, key, logs) under :func:`runtime_root`:
    ``job`` is derived from the job itself (the jobs: their output directory; otherwise the run identity), never
    from a launcher variable, so two jobs never share one."""
    return os.path.join(runtime_root(), job)


class NodeProcess:
    """The snapshot process of this rank's node, reached through :attr:`client`. ``base``: the job's directory (the
    key lives there); ``dir``: the node's (its socket, log and run records)."""

    def __init__(self, base: str, ranks, timeout: float, idle_exit: float) -> None:
        self.ranks, self.timeout, self.idle_exit = ranks, timeout, idle_exit
        self.base = private_dir(base)
        self.dir = private_dir(os.path.join(self.base, f"node{ranks.node}"))
        sock = os.path.join(self.dir, "smp.sock")
        if len(sock.encode()) > 107:  # sockaddr_un's limit
            raise SettingsError(
                f"The snapshot socket path {sock} is {len(sock.encode())} bytes; Unix sockets allow 107. Set "
                "fault_tolerance.directory to a shorter path."
            )
        self.respawns = 0
        self.started: int | None = None  # the pid of the snapshot process this rank started, if it did
        self.peers: dict = {}
        self.key = self._shared_key()
        self.client = self._start()

    def _shared_key(self) -> bytes:
        """The authkey of this job's snapshot processes: made by rank 0 once (file 0600 in the 0700 job directory,
        reused by restarted trainers) and broadcast to every rank."""
        os.makedirs(self.base, mode=0o700, exist_ok=True)
        os.chmod(self.base, 0o700)
        path = os.path.join(self.base, "key")
        key = None
        if self.ranks.rank == 0:
            if os.path.exists(path):
                st = os.stat(path)
                if st.st_uid != os.getuid() or st.st_mode & 0o077:
                    raise SettingsError(f"{path} must be owned by this user with mode 0600")
                key = bytes.fromhex(open(path).read().strip())
            else:
                key = secrets.token_bytes(32)
                write_private(path, key.hex().encode())
        if self.ranks.distributed:
            key = self.ranks.broadcast_bytes(key, 32)
            if not os.path.exists(path):
                write_private(path, key.hex().encode())
        return key

    def alive(self) -> bool:
        try:
            conn = connect(os.path.join(self.dir, "smp.sock"), self.key, 0)
            conn.close()
            return True
        except Exception:
            return False

    def _start(self, port: int = 0) -> SMPClient:
        """Connects to this node's snapshot process, starting it (its own session, so it outlives this trainer) when
        none answers. Any local rank may start it: a lock file lets exactly one do so."""
        with open(os.path.join(self.dir, "start.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if not self.alive():
                    pid = self._spawn(port)
                    client = SMPClient(self.dir, self.key, self.timeout)  # waits until it listens (lock held)
                    self.started = pid
                    return client
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return SMPClient(self.dir, self.key, self.timeout)

    def _spawn(self, port: int) -> int:
        log = open(os.path.join(self.dir, "smp.log"), "ab")
        smp_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smp.py")
        host = os.environ.get("HF_DTRAIN_SMP_HOST", "127.0.0.1")
        proc = subprocess.Popen(
            [
                sys.executable,
                smp_path,
                "--dir",
                self.dir,
                "--node",
                str(self.ranks.node),
                "--host",
                host,
                "--idle-exit",
                str(self.idle_exit),
                "--port",
                str(port),
            ],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        proc.stdin.write(self.key.hex().encode() + b"\n")
        proc.stdin.close()
        log.close()
        logger.info("started the snapshot process of node %d (pid %d)", self.ranks.node, proc.pid)
        return proc.pid

    def configure(self) -> None:
        """Tells the node's snapshot process its local ranks, erasure group, the peers' addresses and the launcher
        that may restart the trainers (torchrun's / accelerate's elastic agent: while it lives, so does the snapshot
        process)."""
        address = self.client.info()["address"]
        mine = json.dumps({"node": self.ranks.node, "address": address}).encode()
        peers = {}
        for entry in self.ranks.gather_bytes(mine):
            d = json.loads(entry)
            peers[d["node"]] = d["address"]
        self.peers = {str(k): v for k, v in peers.items()}
        self._send_config()

    def _send_config(self) -> None:
        agent = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        ranks = self.ranks
        reply, _ = self.client.call(
            {
                "op": "config",
                "local_ranks": ranks.local_ranks,
                "group": ranks.node_group,
                "parity": ranks.parity,
                "peers": self.peers,
                "rank": ranks.rank,
                "agent_pid": agent,
            }
        )
        if not reply.get("ok"):
            raise SnapshotError(f"snapshot process refused its configuration: {reply}")

    def respawn(self, error: BaseException) -> None:
        """The node's snapshot process is gone (killed, crashed): start a new one on the same peer port (any local
        rank may; one does) and configure it. Logged as a warning: the snapshots it held are lost, the next one
        protects the run again."""
        port = 0
        with contextlib.suppress(OSError, ValueError, KeyError):
            port = int(self.client.info()["address"][1])
        with contextlib.suppress(OSError):
            self.client.close()
        self.client = self._start(port)
        self._send_config()
        self.respawns += 1
        logger.warning(
            "rank %d: the snapshot process of node %d was lost (%s: %s); a new one (pid %s) took its place and a "
            "fresh snapshot is taken now",
            self.ranks.rank,
            self.ranks.node,
            type(error).__name__,
            error,
            self.client.info().get("pid"),
        )

    # ---- requests ------------------------------------------------------------------------------------------------
    def slot(self, nbytes: int) -> tuple[int, int, int]:
        """``(slot, fd, size)`` of a slot of at least ``nbytes`` for this rank. The snapshot process may hold it back
        until the previous step's parity is everywhere; it answers before this client gives up on it."""
        wait = max(0.5 * self.timeout, self.timeout - 5.0)
        reply, fd = self.client.call(
            {"op": "slot", "rank": self.ranks.rank, "nbytes": nbytes, "wait": wait}, want_fd=True
        )
        if "error" in reply:
            raise SnapshotError(f"the snapshot process refused a slot: {reply['error']}")
        return reply["slot"], fd, reply["size"]

    def commit(self, slot: int, manifest: dict) -> None:
        reply, _ = self.client.call({"op": "commit", "rank": self.ranks.rank, "slot": slot, "manifest": manifest})
        if "error" in reply:
            raise SnapshotError(f"the snapshot process refused the commit: {reply['error']}")

    def available(self) -> tuple[list[int], str, str]:
        """The steps this rank's snapshots are held for, where from, and why not when none are."""
        reply, _ = self.client.call({"op": "available", "rank": self.ranks.rank})
        return reply["steps"], reply["source"], reply.get("reason", "")

    def held(self) -> dict:
        """Every rank's steps this node holds (``{rank: [steps]}``)."""
        status, _ = self.client.call({"op": "status"})
        return status.get("ranks") or {}

    def header(self, rank: int, step: int) -> dict | None:
        """The metadata of ``rank``'s snapshot at ``step`` (any rank whose slots this node holds): the slot's
        safetensors header, read alone."""
        reply, fd = self.client.call({"op": "open", "rank": rank, "step": step}, want_fd=True)
        if "error" in reply:
            return None
        try:
            (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            return json.loads(os.pread(fd, n, 8)).get("__metadata__", {})
        finally:
            os.close(fd)

    def read(self, rank: int, step: int) -> tuple[tuple[dict, dict, bool] | None, str]:
        """``rank``'s snapshot at ``step`` held by this node (rebuilt from parity if it must be): its metadata, its
        tensors (views into a private copy) and whether it was rebuilt; checksum checked. Or ``(None, why)``."""
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
            return None, f"rank {rank}'s snapshot of step {step} fails its checksum (a corrupted byte); it is not used"
        metadata, tensors = parse(buf.numpy())
        return (metadata, tensors, reply.get("rebuilt", False)), ""

    def discard_after(self, step: int) -> None:
        """Drop this rank's snapshots after ``step`` (all of them for -1)."""
        self.client.call({"op": "discard", "rank": self.ranks.rank, "after": step})

    def shutdown(self) -> None:
        self.client.call({"op": "shutdown"})

    def close(self) -> None:
        self.client.close()
