"""The snapshot engine: at a step boundary, each rank's training state goes into a host-memory slot owned by its node's
snapshot process (``smp.py``), copied by a background thread that overlaps the next forward and backward and is
awaited before the next optimizer step; then committed with a checksum. ``restore()`` (the restore policy,
``restore.py``) brings the newest step every rank can load back: from the snapshot processes, else rebuilt from
peers' parity, else from the last snapshot persisted to disk, and says which it used. What each layout stores and
how it loads in place is the layout's :class:`~hf_dtrain.fault.source.SnapshotSource` (``source.py``: the model's
tensors for DDP replicas, FSDP2 shards, DTensor layouts and pipeline stages; ``zero.py``: DeepSpeed ZeRO partitions);
the DCP copy that reshards onto another world size or layout: ``reshard.py``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import mmap
import os
import queue
import secrets
import shutil
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from hf_dtrain.errors import WriteFailure, check_writable
from hf_dtrain.settings import RELEASE

from . import reshard
from .config import SnapshotConfig
from .ddp import unwrap as _unwrap
from .erasure import node_groups

# Restored and the errors are also imported from here (their names before the restore policy moved out)
from .restore import Restored, RestorePolicy, SnapshotError, SnapshotMismatch  # noqa: F401
from .source import source_for
from .state import Layout, flatten_state, parse, rng_state, unflatten_state
from .wire import SMPClient, checksum, connect, private_dir, runtime_root

logger = logging.getLogger(__name__)


# connection failures that mean the node's snapshot process is gone (re-spawned by the trainers)
_SMP_LOST = (EOFError, BrokenPipeError, ConnectionResetError, ConnectionRefusedError, FileNotFoundError)


def _node_info(rank: int, world: int) -> tuple[int, int, list[int]]:
    """(node id, number of nodes, local ranks): ``HF_DTRAIN_NODE_RANK`` or torchrun's ``GROUP_RANK``, else
    consecutive ranks by ``LOCAL_WORLD_SIZE``."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if world % local:
        raise ValueError(f"LOCAL_WORLD_SIZE={local} does not divide the world size {world}")
    node = int(os.environ.get("HF_DTRAIN_NODE_RANK", os.environ.get("GROUP_RANK", rank // local)))
    return node, world // local, [node * local + i for i in range(local)]


def default_directory(job: str) -> str:
    """This job's private directory for its snapshot processes (sockets, key, logs) under :func:`runtime_root`:
    ``job`` is derived from the job itself (the jobs: their output directory; otherwise the run identity), never
    from a launcher variable, so two jobs never share one."""
    return os.path.join(runtime_root(), job)


def job_key_for(output_dir: str) -> str:
    """The default snapshot directory name of a job writing to ``output_dir`` (its absolute path, hashed)."""
    return "out-" + hashlib.sha256(os.path.abspath(output_dir).encode()).hexdigest()[:16]


class SnapshotEngine(RestorePolicy):
    """In-memory snapshots for one rank.

    ``snapshot_hooks``: callables ``hook(engine, step)`` run after each ``snapshot()`` has started its copy (metrics, or
    the fault injector of :mod:`hf_dtrain.testing.fault`); an engine starts with the class-wide
    ``default_snapshot_hooks``.

    ``engine.snapshot(step, extra)`` after ``optimizer.step()`` (and the scheduler's), ``engine.wait()`` before the
    next ``optimizer.step()``; ``engine.restore()`` at start-up. ``extra``: JSON-able or tensor state you want back
    (the data position). ``stateful``: more objects with ``state_dict()`` / ``load_state_dict()`` to keep (a
    communication hook's state: error feedback); their ``state_dict()`` must return copies of anything that changes
    before the next optimizer step. With a frozen base (PEFT), only trainable parameters are stored. A snapshot process
    with no trainer connected for ``idle_exit`` seconds exits (the job is gone), so crashed jobs do not hold memory.
    """

    default_snapshot_hooks: ClassVar[list] = []

    def __init__(
        self,
        model: nn.Module,
        optimizer=None,
        scheduler=None,
        scaler=None,
        config=None,
        *,
        stateful: dict | None = None,
        process_group=None,
        identity: dict | None = None,
        job_key: str | None = None,
        placement: dict | None = None,
        **settings,
    ):

        self.config = config = SnapshotConfig.from_any(config, **settings)
        directory, parity, group_size = config.directory, config.parity, config.group_size
        persist_dir, persist_every = config.persist_dir, config.persist_every
        timeout, idle_exit, trainable_only = config.timeout, config.idle_exit, config.trainable_only
        if persist_every and not persist_dir:
            raise ValueError(
                "SnapshotConfig.persist_every > 0 needs persist_dir (where every N-th snapshot is "
                "written); set fault_tolerance.persist_dir."
            )
        # what the snapshot holds of this layout and how it loads in place (source.py)
        self.source = source_for(model, optimizer, trainable_only)
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.snapshot_hooks: list = list(type(self).default_snapshot_hooks)
        self.stateful = dict(stateful or {})
        for name, obj in self.stateful.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"stateful[{name!r}] ({type(obj).__name__}) needs state_dict() and load_state_dict()")
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.world = dist.get_world_size(process_group) if self.distributed else 1
        # the engine's own collectives (key, addresses, votes, steps) are small CPU tensors: over gloo, on a group of
        # its own when the job's group has no CPU backend (NCCL alone, as Accelerate sets it up on GPUs)
        self.group = self._control_group(process_group, timeout) if self.distributed else process_group
        self.node, self.num_nodes, self.local_ranks = _node_info(self.rank, self.world)
        group_size = group_size or self.num_nodes
        if parity and self.num_nodes > 1:
            if parity >= group_size:
                raise ValueError(
                    f"parity={parity} needs erasure groups of more than {parity} nodes; group_size is "
                    f"{group_size} ({self.num_nodes} nodes). Lower parity or use more nodes."
                )
            self.groups = node_groups(self.num_nodes, group_size)
        else:
            parity, self.groups = 0, [[n] for n in range(self.num_nodes)]
        self.parity = parity
        self.node_group = next(g for g in self.groups if self.node in g)
        self.persist_dir, self.persist_every = persist_dir, persist_every
        self.timeout, self.idle_exit = timeout, idle_exit
        self.trainable_only = self.source.trainable_only
        self.fingerprint = self._fingerprint()
        self.identity = self._identity(identity or {})
        self.identity_hash = hashlib.sha256(
            json.dumps(self.identity, sort_keys=True, default=str).encode()
        ).hexdigest()[:16]
        self._identity_json = json.dumps(self.identity, sort_keys=True)  # written into every snapshot's header
        # how the job lays the model over its ranks (its parallel degrees and layout settings): a snapshot of another
        # placement does not load rank by rank; like one of another world size, it reshards from the DCP copy
        self.placement = json.loads(json.dumps(placement or {}, sort_keys=True, default=str))
        self._placement_json = json.dumps(self.placement, sort_keys=True)
        self.layout: Layout | None = None
        self._maps: dict[int, tuple[int, mmap.mmap]] = {}
        self._registered: dict[int, int] = {}
        # read at the first snapshot: Accelerate's FSDP2 route moves the model to the GPU after the engine is built
        self._cuda: bool | None = None
        # one long-lived copy thread fed by a queue: starting a thread per snapshot would stall the training thread
        # for up to the interpreter's switch interval (5 ms) while the new thread runs Python code
        self._worker: threading.Thread | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._in_flight = False
        self._error: BaseException | None = None
        self._persist: threading.Thread | None = None
        self._persist_error: WriteFailure | None = None
        if persist_dir:  # before any step: a directory that cannot be written fails now, not in the background
            check_writable(persist_dir, "--fault-tolerance.persist-dir", mode=0o700)
        self.stats = {"snapshots": 0, "stall_seconds": [], "copy_seconds": [], "wait_seconds": [], "bytes": 0}
        self.base = private_dir(directory or default_directory(job_key or f"job-{self.identity_hash}"))
        self.dir = private_dir(os.path.join(self.base, f"node{self.node}"))
        sock = os.path.join(self.dir, "smp.sock")
        if len(sock.encode()) > 107:  # sockaddr_un's limit
            raise ValueError(
                f"The snapshot socket path {sock} is {len(sock.encode())} bytes; Unix sockets allow 107. "
                "Set fault_tolerance.directory to a shorter path."
            )
        self.marker = os.path.join(self.dir, f"run-rank{self.rank}.json")
        self._marked = False
        self.respawns = 0
        self._peers: dict = {}
        self._last: tuple[int, Any] | None = None  # (step, extra) of the newest committed or restored snapshot
        self._pending = None
        self.started_smp: int | None = None
        if self.rank == self.local_ranks[0]:  # what a writer killed midway left (no snapshot is being written now)
            self.clean_temporaries(self.dir)
            if self.persist_dir and os.path.isdir(self.persist_dir):
                self.clean_temporaries(self.persist_dir)
        self.key = self._shared_key()
        self.client = self._start_smp()
        self._configure()
        self._step_hook = self.source.guard_step(self.wait)  # removed again by close()
        # every persist_every-th snapshot is also a DCP checkpoint (restorable onto another world size), written
        # by the persist thread over a process group of its own
        self._shards, self._persist_group = None, None  # the ShardMap is read at the first snapshot (the Trainer
        if self.persist_every and self.distributed:  # hands the optimizer over after the engine is built)
            self._persist_group = self._gloo_group(process_group, timeout)

    # ---------------------------------------------------------------- set-up
    @staticmethod
    def _gloo_group(process_group, timeout: float):
        """A new gloo group of ``process_group``'s ranks (every rank builds the engine, so every rank joins it)."""

        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        return dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout))

    @classmethod
    def _control_group(cls, process_group, timeout: float):
        """``process_group`` when it carries CPU tensors (gloo, or a ``cpu:gloo`` part), else a gloo group of the
        same ranks."""
        if "gloo" in str(dist.get_backend(process_group)):
            return process_group
        return cls._gloo_group(process_group, timeout)

    def _identity(self, job: dict) -> dict:
        """What makes this job this job: the caller's settings (``identity=``: the job's config, seed, data source)
        and what the engine sees itself: the trainable parameter set, the model config, the optimizer's and
        scheduler's classes and hyper-parameters, hf_dtrain's version. Recorded in every snapshot; a restore into a
        job whose identity differs is refused, naming what differs."""

        model = _unwrap(self.model)
        out = {"job": job, "hf_dtrain": RELEASE, "parameters": self.fingerprint}
        config = getattr(model, "config", None)
        if hasattr(config, "to_dict"):
            cfg = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
            out["model_config"] = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]
        if self.optimizer is not None:
            from hf_dtrain.distributed.engines import unwrap_optimizer

            opt = unwrap_optimizer(self.optimizer)
            groups = [
                {
                    k: v
                    for k, v in g.items()
                    if k not in ("params", "lr") and isinstance(v, (int, float, str, bool, tuple))
                }
                for g in opt.param_groups
            ]
            out["optimizer"] = {"class": type(opt).__name__, "groups": groups}
        if self.scheduler is not None:
            out["scheduler"] = type(self.scheduler).__name__
        return json.loads(json.dumps(out, default=str))

    def _fingerprint(self) -> str:
        h = hashlib.sha256()
        for entry in self.source.describe():
            h.update(f"{entry};".encode())
        return h.hexdigest()[:16]

    def _shared_key(self) -> bytes:
        """The authkey of this job's snapshot processes: made by rank 0 once (file 0600 in the 0700 job
        directory, reused by restarted trainers) and broadcast to every rank."""
        os.makedirs(self.base, mode=0o700, exist_ok=True)
        os.chmod(self.base, 0o700)
        path = os.path.join(self.base, "key")
        key = None
        if self.rank == 0:
            if os.path.exists(path):
                st = os.stat(path)
                if st.st_uid != os.getuid() or st.st_mode & 0o077:
                    raise PermissionError(f"{path} must be owned by this user with mode 0600")
                key = bytes.fromhex(open(path).read().strip())
            else:
                key = secrets.token_bytes(32)
                self._write_private(path, key.hex().encode())
        if self.distributed:
            t = torch.zeros(32, dtype=torch.uint8)
            if key is not None:
                t.copy_(torch.frombuffer(bytearray(key), dtype=torch.uint8))
            dist.broadcast(t, src=0, group=self.group)
            key = bytes(t.tolist())
            if not os.path.exists(path):
                self._write_private(path, key.hex().encode())
        return key

    @staticmethod
    def _write_private(path: str, data: bytes) -> None:
        """Write ``path`` (0600) all at once: into ``<path>.<pid>.tmp``, then renamed. A writer killed midway leaves
        only the temporary, which the next engine on that directory removes (``clean_temporaries``).
        (``O_TMPFILE`` + ``linkat`` through ``/proc`` would leave nothing at all, but fails with EXDEV in
        containers.)"""
        tmp = f"{path}.{os.getpid()}.tmp"
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    @staticmethod
    def clean_temporaries(directory: str) -> None:
        """Remove ``*.tmp`` files a killed writer left under ``directory``."""
        for root, _, files in os.walk(directory):
            for name in files:
                if name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(root, name))

    def _smp_alive(self) -> bool:
        try:
            conn = connect(os.path.join(self.dir, "smp.sock"), self.key, 0)
            conn.close()
            return True
        except Exception:
            return False

    def _start_smp(self, port: int = 0) -> SMPClient:
        """Connects to this node's snapshot process, starting it (its own session, so it outlives this trainer) when
        none answers. Any local rank may start it: a lock file lets exactly one do so."""

        with open(os.path.join(self.dir, "start.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if not self._smp_alive():
                    log = open(os.path.join(self.dir, "smp.log"), "ab")
                    smp_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smp.py")
                    proc = subprocess.Popen(
                        [
                            sys.executable,
                            smp_path,
                            "--dir",
                            self.dir,
                            "--node",
                            str(self.node),
                            "--host",
                            os.environ.get("HF_DTRAIN_SMP_HOST", "127.0.0.1"),
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
                    logger.info("started the snapshot process of node %d (pid %d)", self.node, proc.pid)
                    client = SMPClient(self.dir, self.key, self.timeout)  # waits until it listens
                    self.started_smp = proc.pid
                    return client
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return SMPClient(self.dir, self.key, self.timeout)

    def _configure(self) -> None:
        """Tells the node's snapshot process its local ranks, erasure group, the peers' addresses and the launcher
        that may restart the trainers (torchrun's / accelerate's elastic agent: while it lives, so does the snapshot
        process)."""
        address = self.client.info()["address"]
        mine = json.dumps({"node": self.node, "address": address}).encode()
        entries = [mine]
        if self.distributed:
            buf = torch.zeros(256, dtype=torch.uint8)
            buf[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
            out = [torch.zeros_like(buf) for _ in range(self.world)]
            dist.all_gather(out, buf, group=self.group)
            entries = [bytes(t.tolist()).rstrip(b"\0") for t in out]
        peers = {}
        for e in entries:
            d = json.loads(e)
            peers[d["node"]] = d["address"]
        self._peers = {str(k): v for k, v in peers.items()}
        self._send_config()

    def _send_config(self) -> None:
        agent = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        reply, _ = self.client.call(
            {
                "op": "config",
                "local_ranks": self.local_ranks,
                "group": self.node_group,
                "parity": self.parity,
                "peers": self._peers,
                "rank": self.rank,
                "agent_pid": agent,
            }
        )
        if not reply.get("ok"):
            raise SnapshotError(f"snapshot process refused its configuration: {reply}")

    def _respawn(self, error: BaseException) -> None:
        """The node's snapshot process is gone (killed, crashed): start a new one on the same peer port (any local
        rank may; one does), configure it, and go on; the caller takes a fresh snapshot at once. Logged as a
        warning: the snapshots it held are lost, the next one protects the run again."""
        port = 0
        with contextlib.suppress(OSError, ValueError, KeyError):
            port = int(self.client.info()["address"][1])
        with contextlib.suppress(OSError):
            self.client.close()
        for slot in list(self._maps):
            self._unregister(slot)
            self._maps.pop(slot)[1].close()
        self.client = self._start_smp(port)
        self._send_config()
        self.respawns += 1
        logger.warning(
            "rank %d: the snapshot process of node %d was lost (%s: %s); a new one (pid %s) took its "
            "place and a fresh snapshot is taken now",
            self.rank,
            self.node,
            type(error).__name__,
            error,
            self.client.info().get("pid"),
        )

    # ---------------------------------------------------------------- snapshot
    def _capture(self, extra: Any) -> dict:
        """What must be read at the step boundary, in the training thread: the source's references (the model's
        tensors: FSDP2 swaps unsharded parameters onto the modules during forward and backward; DeepSpeed's ZeRO
        state), the RNG states (the next step draws from them), the ``stateful`` objects' copies."""
        state = {**self.source.capture(), "rng": rng_state(), "extra": extra}
        if self.stateful:
            state["stateful"] = {name: obj.state_dict() for name, obj in self.stateful.items()}
        return state

    def _collect(self, step: int, state: dict) -> tuple[dict, dict[str, torch.Tensor]]:
        """The rest of the snapshot, on the copy thread while the next forward and backward run (nothing it reads
        changes before the next optimizer step, which waits for this thread): the optimizer's, scheduler's and
        scaler's state dicts, then the whole state split into tensors and a JSON skeleton."""
        self.source.collect(state, self.optimizer)
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        tensors: dict[str, torch.Tensor] = {}
        skeleton = flatten_state(state, tensors)
        metadata = {
            "step": str(step),
            "rank": str(self.rank),
            "world_size": str(self.world),
            "placement": self._placement_json,
            "fingerprint": self.fingerprint,
            "identity": self._identity_json,
            "skeleton": json.dumps(skeleton, separators=(",", ":")),
        }
        if self._shards is not None:  # where this rank's shards sit in the global tensors (a restart on another
            metadata["offsets"] = json.dumps(self._shards.offsets)  # world size reads them: restore.py)
        return metadata, tensors

    def _map(self, slot: int, fd: int, size: int) -> mmap.mmap:
        old = self._maps.get(slot)
        if old is not None and old[0] >= size:
            os.close(fd)
            return old[1]
        if old is not None:
            self._unregister(slot)
            old[1].close()
        m = mmap.mmap(fd, size)
        os.close(fd)
        if self._cuda:  # page-locked, so the device-to-host copies run asynchronously on the side stream
            import ctypes

            ptr = ctypes.addressof(ctypes.c_char.from_buffer(m))
            torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
            self._registered[slot] = ptr
        self._maps[slot] = (size, m)
        return m

    def _unregister(self, slot: int) -> None:
        ptr = self._registered.pop(slot, None)
        if ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(ptr)

    def snapshot(self, step: int, extra: Any = None) -> None:
        """Start a snapshot of the state after ``step``: what the next step changes is captured now, the rest
        collected and copied in the background. The previous snapshot is awaited first (one in flight at a time)."""
        t0 = time.perf_counter()
        self.wait()
        if self.persist_every and self._shards is None:
            self._shards = self.source.shard_map(self.optimizer)  # None: this layout does not reshard (ZeRO)
        if self._cuda is None:
            self._cuda = any(p.is_cuda for p in _unwrap(self.model).parameters())
        state = self._capture(extra)
        self._pending = None  # set by the copy thread once the snapshot's bytes are laid out
        stream = None
        if self._cuda:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())  # the copy reads what the optimizer step just wrote
        if self._worker is None:
            self._worker = threading.Thread(target=self._serve_jobs, daemon=True, name="hf_dtrain-snapshot")
            self._worker.start()
        self._done.clear()
        self._in_flight = True
        self._jobs.put((step, state, stream, extra))
        self.stats["stall_seconds"].append(time.perf_counter() - t0)
        for hook in self.snapshot_hooks:
            hook(self, step)

    def _serve_jobs(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._background(*job)
            finally:
                self._done.set()

    def _background(self, step: int, state: dict, stream, extra: Any) -> None:
        """The copy thread: the snapshot's layout and header, a slot from the snapshot process, the copy, the
        commit. A lost snapshot process is left to ``wait()``, which starts a new one and writes the same snapshot
        (``_pending``) into it."""
        try:
            metadata, tensors = self._collect(step, state)
            if self.layout is None or not self.layout.matches(tensors):
                self.layout = Layout(tensors)
            header = self.layout.header(metadata)
            total = self.layout.total_bytes
            self._pending = (step, header, tensors, total, extra)
            slot, buf = self._slot(total)
        except BaseException as e:  # surfaced by wait()
            self._error = e
            return
        self._copy(step, slot, buf, header, tensors, total, stream, extra)

    def _slot(self, total: int) -> tuple[int, mmap.mmap]:
        # the snapshot process may hold the slot back until the previous step's parity is everywhere; it answers
        # before this client gives up on it
        reply, fd = self.client.call(
            {"op": "slot", "rank": self.rank, "nbytes": total, "wait": max(0.5 * self.timeout, self.timeout - 5.0)},
            want_fd=True,
        )
        if "error" in reply:
            raise SnapshotError(f"the snapshot process refused a slot: {reply['error']}")
        return reply["slot"], self._map(reply["slot"], fd, reply["size"])

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
            digest = checksum(memoryview(buf)[:total])
            manifest = {
                "step": step,
                "nbytes": total,
                "checksum": digest,
                "fingerprint": self.fingerprint,
                "identity": self.identity_hash,
                "world_size": self.world,
            }
            reply, _ = self.client.call({"op": "commit", "rank": self.rank, "slot": slot, "manifest": manifest})
            if "error" in reply:
                raise SnapshotError(f"the snapshot process refused the commit: {reply['error']}")
            self.stats["copy_seconds"].append(time.perf_counter() - t0)
            self.stats["snapshots"] += 1
            self.stats["bytes"] = total
            self._last = (step, extra)
            if not self._marked:
                self._write_marker(
                    {
                        "identity": self.identity,
                        "identity_hash": self.identity_hash,
                        "first_step": step,
                        "completed": False,
                    }
                )
            if self.persist_every and step % self.persist_every == 0:
                self._start_persist(step, bytearray(memoryview(buf)[:total]), manifest)
        except BaseException as e:  # surfaced by wait()
            self._error = e

    def _write_marker(self, record: dict) -> None:
        """``run-rank<r>.json`` in the node directory: this rank has committed snapshots (so a relaunch whose
        snapshot process holds none of them says what was lost instead of starting over), or the job completed."""
        self._marked = True
        self._write_private(self.marker, json.dumps(record, default=str).encode())

    def _read_marker(self) -> dict | None:
        try:
            with open(self.marker) as f:
                record = json.load(f)
            return record if isinstance(record, dict) else None
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {"damaged": True}

    def wait(self) -> None:
        """Block until the snapshot in flight is committed (call before the next optimizer step). When the node's
        snapshot process died meanwhile, a new one is started and the same snapshot written into it (the state
        has not changed yet: this runs before the optimizer step)."""
        if self._in_flight:
            t0 = time.perf_counter()
            self._done.wait()
            self._in_flight = False
            self.stats["wait_seconds"].append(time.perf_counter() - t0)
        if self._error is not None:
            e, self._error = self._error, None
            if isinstance(e, _SMP_LOST) and self._pending is not None:
                self._respawn(e)
                step, header, tensors, total, extra = self._pending
                slot, buf = self._slot(total)
                self._copy(step, slot, buf, header, tensors, total, None, extra)
                if self._error is None:
                    self._pending = None
                    return
                e, self._error = self._error, None
            if isinstance(e, WriteFailure):  # a persisted copy that could not be written: named as it is
                raise e
            raise SnapshotError(f"snapshot failed on rank {self.rank}: {type(e).__name__}: {e}") from e
        self._pending = None
        if self._persist is not None and not self._persist.is_alive():
            self._raise_persist_error()

    # ---------------------------------------------------------------- disk persistence
    def _start_persist(self, step: int, data: bytes, manifest: dict) -> None:
        if self._persist is not None:
            self._persist.join()

        self._raise_persist_error()

        def write():
            d = os.path.join(self.persist_dir, f"snapshot-{step}")
            what = "persisted snapshot"
            try:
                os.makedirs(d, mode=0o700, exist_ok=True)
                self._write_private(os.path.join(d, f"rank{self.rank}.safetensors"), data)  # the slot's bytes
                self._write_private(os.path.join(d, f"rank{self.rank}.json"), json.dumps(manifest).encode())
                if self._shards is not None:
                    what = "resharding (DCP) copy"
                    self._persist_resharding(d, step, data)
            except Exception as e:  # raised on the training thread by the next wait(), snapshot or close()
                self._persist_error = WriteFailure(
                    f"rank {self.rank}: the {what} of step {step} could not be written to {d} "
                    f"({type(e).__name__}: {e}). Set fault_tolerance.persist_dir to a writable directory with "
                    "room, or persist_every 0 to keep snapshots in memory only; relaunch the same command to "
                    "resume from the snapshots in memory."
                )
                self._persist_error.__cause__ = e

        self._persist = threading.Thread(target=write, daemon=True)
        self._persist.start()

    def _raise_persist_error(self) -> None:
        """A persisted write that failed in the background fails the run on the training thread."""
        if self._persist_error is not None:
            e, self._persist_error = self._persist_error, None
            raise e

    def _persist_resharding(self, d: str, step: int, data) -> None:
        """The snapshot in ``data`` (this rank's slot bytes) as a DCP checkpoint under ``d/dcp`` (each rank its own
        shards), then ``d/replicated.safetensors`` from rank 0 once every rank's shards are written."""

        metadata, tensors = parse(data)
        state = unflatten_state(json.loads(metadata["skeleton"]), tensors)
        sharded, replicated = self._shards.split(state)
        if self.rank == 0:  # a copy of this step from a failed timeline (or another world size): gone first
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(d, reshard.REPLICATED))
            shutil.rmtree(os.path.join(d, reshard.DCP_DIR), ignore_errors=True)
        if self.distributed:
            dist.barrier(group=self._persist_group)
        reshard.save(os.path.join(d, reshard.DCP_DIR), sharded, self._persist_group)  # returns once all have written
        if self.rank == 0:
            reshard.write_replicated(
                os.path.join(d, reshard.REPLICATED),
                replicated,
                {
                    "step": str(step),
                    "world_size": str(self.world),
                    "placement": self._placement_json,
                    "fingerprint": self.fingerprint,
                    "identity": json.dumps(self.identity, sort_keys=True),
                },
                self._write_private,
            )

    def close(self, shutdown: bool = False) -> None:
        """Finish the snapshot in flight; with ``shutdown`` (the run is over) stop the node's snapshot process."""
        self.wait()
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join()
            self._worker = None
        if self._persist is not None:
            self._persist.join()
            self._persist = None
        for slot, (_, m) in self._maps.items():
            self._unregister(slot)
            m.close()
        self._maps.clear()
        if shutdown:
            if self.distributed:
                dist.barrier(group=self.group)
            step, extra = self._last or (0, None)
            self._write_marker(
                {
                    "identity": self.identity,
                    "identity_hash": self.identity_hash,
                    "completed": True,
                    "last_step": step,
                    "extra": extra,
                }
            )
            if self.distributed:
                dist.barrier(group=self.group)
            if self.rank == self.local_ranks[0]:
                self.client.call({"op": "shutdown"})
        self.client.close()
        self._raise_persist_error()  # the last persisted write failed: the run fails, after its cleanup
