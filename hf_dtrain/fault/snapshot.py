"""The snapshot engine: at a step boundary, each rank's training state goes into a host-memory slot owned by its node's
snapshot process (``smp.py``), copied by a background thread that overlaps the next forward and backward and is
awaited before the next optimizer step; then committed with a checksum. ``restore()`` brings the newest step every
rank can load back: from the snapshot processes, else rebuilt from peers' parity, else from the last snapshot
persisted to disk, and says which it used.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import sharded_engine_of
from .erasure import node_groups
from .wire import SMPClient, checksum, connect, private_dir, runtime_root
from .state import Layout, flatten_state, parse, rng_state, set_rng_state, unflatten_state

logger = logging.getLogger(__name__)


class SnapshotError(RuntimeError):
    """A run whose snapshots exist but cannot be restored (and no disk copy to fall back to)."""


class SnapshotMismatch(ValueError):
    """A snapshot of another job or world size: not resumed (the message names what differs and the way out)."""


# connection failures that mean the node's snapshot process is gone (re-spawned by the trainers)
_SMP_LOST = (EOFError, BrokenPipeError, ConnectionResetError, ConnectionRefusedError, FileNotFoundError)

FRESH_START = "--fault-tolerance.fresh-start true (YAML fault_tolerance: {fresh_start: true})"


@dataclasses.dataclass
class Restored:
    step: int
    source: str  # "memory", "parity", "disk" or "resharded" (the DCP copy, taken on another world size)
    extra: Any  # what was passed to snapshot(extra=...): the data position, trainer state
    detail: str = ""
    state: Optional[dict] = dataclasses.field(default=None, repr=False)  # everything, with restore(apply=False)


def _unwrap(model: nn.Module) -> nn.Module:
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of an FSDP2 DTensor (a view that writes through), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _as_shards(optimizer, state: dict) -> dict:
    """A restored optimizer state dict with each DTensor parameter's state tensors (stored as this rank's local
    shards) made DTensors again, with the parameter's mesh and placements: what the optimizer held when it was
    snapshotted. Scalars (AdamW's ``step``) stay as they are."""
    from torch.distributed.tensor import DTensor

    from hf_dtrain.distributed import unwrap_optimizer

    params = [p for g in unwrap_optimizer(optimizer).param_groups for p in g["params"]]
    out = dict(state)
    out["state"] = {}
    for idx, st in state.get("state", {}).items():
        # torch's optimizers key the state by index; some (hf_dtrain's own) by parameter name: no DTensor there
        i = int(idx) if isinstance(idx, int) or (isinstance(idx, str) and idx.isdigit()) else None
        p = params[i] if i is not None and i < len(params) else None
        if isinstance(p, DTensor):
            local = p.to_local().shape
            st = {k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                        stride=p.stride())
                  if torch.is_tensor(v) and v.dim() and v.shape == local else v for k, v in st.items()}
        out["state"][idx] = st
    return out


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


def _flatten(d: Any, prefix: str = "") -> dict:
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): d}


def identity_diff(theirs: dict, ours: dict, limit: int = 6) -> str:
    """The settings that differ between two run identities, as ``key: theirs -> ours``."""
    a, b = _flatten(theirs), _flatten(ours)
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    parts = [f"{k}: {a.get(k, '(absent)')!r} there, {b.get(k, '(absent)')!r} here" for k in keys[:limit]]
    return "; ".join(parts) + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")


class SnapshotEngine:
    """In-memory snapshots for one rank.

    ``snapshot_hooks``: callables ``hook(engine, step)`` run after each ``snapshot()`` has started its copy (metrics, or
    the fault injector of :mod:`hf_dtrain.testing.fault`); an engine starts with the class-wide
    ``default_snapshot_hooks``.

    ``engine.snapshot(step, extra)`` after ``optimizer.step()`` (and the scheduler's), ``engine.wait()`` before the
    next ``optimizer.step()``; ``engine.restore()`` at start-up. ``extra``: JSON-able or tensor state you want back
    (the data position). ``stateful``: more objects with ``state_dict()`` / ``load_state_dict()`` to keep (a
    communication hook's state: error feedback); their ``state_dict()`` must return copies of anything that changes
    before the next optimizer step. With a frozen base (PEFT), only trainable parameters are stored. A snapshot process with
    no trainer connected for ``idle_exit`` seconds exits (the job is gone), so crashed jobs do not hold memory.
    """

    default_snapshot_hooks: list = []

    def __init__(self, model: nn.Module, optimizer=None, scheduler=None, scaler=None, config=None, *,
                 stateful: Optional[dict] = None, process_group=None, identity: Optional[dict] = None,
                 job_key: Optional[str] = None, **settings):
        from .config import SnapshotConfig

        self.config = config = SnapshotConfig.from_any(config, **settings)
        directory, parity, group_size = config.directory, config.parity, config.group_size
        persist_dir, persist_every = config.persist_dir, config.persist_every
        timeout, idle_exit, trainable_only = config.timeout, config.idle_exit, config.trainable_only
        if persist_every and not persist_dir:
            raise ValueError("SnapshotConfig.persist_every > 0 needs persist_dir (where every N-th snapshot is "
                             "written); set fault_tolerance.persist_dir.")
        from .zero import ZeroPartitions, find_zero_optimizer

        zero = find_zero_optimizer(model, optimizer)
        self._zero = ZeroPartitions(zero, model) if zero is not None else None
        sharded = next(filter(None, map(sharded_engine_of, _unwrap(model).parameters())), None)
        if sharded is not None and not sharded.startswith("FSDP2") and self._zero is None:
            raise ValueError(f"This model's parameters are held by {sharded}, and no ZeRO optimizer was given: its "
                             "partitions live in the DeepSpeed optimizer, with the fp32 master weights. Pass the "
                             "DeepSpeed engine as the model (SnapshotEngine(engine, engine.optimizer, ...)).")
        if self._zero is not None and trainable_only is False:
            raise ValueError("SnapshotConfig.trainable_only=False with DeepSpeed ZeRO: the snapshot holds the ZeRO "
                             "optimizer's partitions, which are the trainable parameters; leave trainable_only unset.")
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.snapshot_hooks: list = list(type(self).default_snapshot_hooks)
        self.stateful = dict(stateful or {})
        for name, obj in self.stateful.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"stateful[{name!r}] ({type(obj).__name__}) needs state_dict() and load_state_dict()")
        self.group = process_group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.world = dist.get_world_size(process_group) if self.distributed else 1
        self.node, self.num_nodes, self.local_ranks = _node_info(self.rank, self.world)
        group_size = group_size or self.num_nodes
        if parity and self.num_nodes > 1:
            if parity >= group_size:
                raise ValueError(f"parity={parity} needs erasure groups of more than {parity} nodes; group_size is "
                                 f"{group_size} ({self.num_nodes} nodes). Lower parity or use more nodes.")
            self.groups = node_groups(self.num_nodes, group_size)
        else:
            parity, self.groups = 0, [[n] for n in range(self.num_nodes)]
        self.parity = parity
        self.node_group = next(g for g in self.groups if self.node in g)
        self.persist_dir, self.persist_every = persist_dir, persist_every
        self.timeout, self.idle_exit = timeout, idle_exit
        if trainable_only is None:
            trainable_only = any(not p.requires_grad for p in _unwrap(model).parameters())
        self.trainable_only = trainable_only
        self.fingerprint = self._fingerprint()
        self.identity = self._identity(identity or {})
        self.identity_hash = hashlib.sha256(json.dumps(self.identity, sort_keys=True, default=str).encode()
                                            ).hexdigest()[:16]
        self._identity_json = json.dumps(self.identity, sort_keys=True)  # written into every snapshot's header
        self.layout: Optional[Layout] = None
        self._maps: dict[int, tuple[int, mmap.mmap]] = {}
        self._registered: dict[int, int] = {}
        # read again at each snapshot: Accelerate's FSDP2 route moves the model to the GPU after the engine is built
        self._cuda = any(p.is_cuda for p in _unwrap(model).parameters())
        # one long-lived copy thread fed by a queue: starting a thread per snapshot would stall the training thread
        # for up to the interpreter's switch interval (5 ms) while the new thread runs Python code
        self._worker: Optional[threading.Thread] = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._in_flight = False
        self._error: Optional[BaseException] = None
        self._persist: Optional[threading.Thread] = None
        self.stats = {"snapshots": 0, "stall_seconds": [], "copy_seconds": [], "wait_seconds": [],
                      "bytes": 0}
        self.base = private_dir(directory or default_directory(job_key or f"job-{self.identity_hash}"))
        self.dir = private_dir(os.path.join(self.base, f"node{self.node}"))
        sock = os.path.join(self.dir, "smp.sock")
        if len(sock.encode()) > 107:  # sockaddr_un's limit
            raise ValueError(f"The snapshot socket path {sock} is {len(sock.encode())} bytes; Unix sockets allow 107. "
                             "Set fault_tolerance.directory to a shorter path.")
        self.marker = os.path.join(self.dir, f"run-rank{self.rank}.json")
        self._marked = False
        self.respawns = 0
        self._peers: dict = {}
        self._last: Optional[tuple[int, Any]] = None  # (step, extra) of the newest committed or restored snapshot
        self._pending = None
        self.started_smp: Optional[int] = None
        if self.rank == self.local_ranks[0]:  # what a writer killed midway left (no snapshot is being written now)
            self.clean_temporaries(self.dir)
            if self.persist_dir and os.path.isdir(self.persist_dir):
                self.clean_temporaries(self.persist_dir)
        self.key = self._shared_key()
        self.client = self._start_smp()
        self._configure()
        self._step_hook = None
        if self._zero is not None:
            # DeepSpeed's step may run inside accelerator.backward (before the loop's wait()): the base optimizer
            # waits for the copy in flight before it changes what the copy reads (removed again by close())
            self._step_hook = self._zero.base.register_step_pre_hook(lambda *_: self.wait())
        # every persist_every-th snapshot is also a DCP checkpoint (restorable onto another world size), written
        # by the persist thread over a process group of its own
        self._shards, self._persist_group = None, None  # the ShardMap is read at the first snapshot (the Trainer
        if self.persist_every:                             # hands the optimizer over after the engine is built)
            from datetime import timedelta

            if self.distributed:
                ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
                self._persist_group = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout))

    # ---------------------------------------------------------------- set-up
    def _model_state(self, local: bool = True) -> dict[str, torch.Tensor]:
        """The model's tensors to snapshot; FSDP2's DTensor parameters as this rank's local shards (views that write
        through), unless ``local`` is false."""
        if self._zero is not None:  # every trainable parameter lives in the ZeRO partitions (state["zero"])
            return {}
        m = _unwrap(self.model)
        if self.trainable_only:
            state = {n: p.detach() for n, p in m.named_parameters() if p.requires_grad}
        else:
            state = {k: v.detach() for k, v in m.state_dict(keep_vars=True).items()}
        return {k: _local(v) for k, v in state.items()} if local else state

    def _identity(self, job: dict) -> dict:
        """What makes this job this job: the caller's settings (``identity=``: the job's config, seed, data source)
        and what the engine sees itself: the trainable parameter set, the model config, the optimizer's and
        scheduler's classes and hyper-parameters, hf_dtrain's version. Recorded in every snapshot; a restore into a
        job whose identity differs is refused, naming what differs."""
        from hf_dtrain.settings import RELEASE

        model = _unwrap(self.model)
        out = {"job": job, "hf_dtrain": RELEASE, "parameters": self.fingerprint}
        config = getattr(model, "config", None)
        if hasattr(config, "to_dict"):
            cfg = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
            out["model_config"] = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]
        if self.optimizer is not None:
            from hf_dtrain.distributed import unwrap_optimizer

            opt = unwrap_optimizer(self.optimizer)
            groups = [{k: v for k, v in g.items() if k not in ("params", "lr") and isinstance(v, (int, float, str,
                                                                                                     bool, tuple))}
                      for g in opt.param_groups]
            out["optimizer"] = {"class": type(opt).__name__, "groups": groups}
        if self.scheduler is not None:
            out["scheduler"] = type(self.scheduler).__name__
        return json.loads(json.dumps(out, default=str))

    def _fingerprint(self) -> str:
        h = hashlib.sha256()
        for name, t in self._model_state(local=False).items():  # global shapes: the same on every rank
            placements = getattr(t, "placements", None)
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{placements};".encode())
        if self._zero is not None:
            h.update(f"zero{self._zero.stage};".encode())
            for name, shape, dtype in self._zero.describe():
                h.update(f"{name}:{shape}:{dtype};".encode())
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
        import fcntl

        with open(os.path.join(self.dir, "start.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if not self._smp_alive():
                    log = open(os.path.join(self.dir, "smp.log"), "ab")
                    smp_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smp.py")
                    proc = subprocess.Popen([sys.executable, smp_path, "--dir", self.dir, "--node", str(self.node),
                                             "--host", os.environ.get("HF_DTRAIN_SMP_HOST", "127.0.0.1"),
                                             "--idle-exit", str(self.idle_exit), "--port", str(port)],
                                            stdin=subprocess.PIPE, stdout=log, stderr=log, start_new_session=True)
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
            buf[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
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
        reply, _ = self.client.call({"op": "config", "local_ranks": self.local_ranks, "group": self.node_group,
                                     "parity": self.parity, "peers": self._peers, "rank": self.rank,
                                     "agent_pid": agent})
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
        logger.warning("rank %d: the snapshot process of node %d was lost (%s: %s); a new one (pid %s) took its "
                       "place and a fresh snapshot is taken now", self.rank, self.node, type(error).__name__, error,
                       self.client.info().get("pid"))

    # ---------------------------------------------------------------- snapshot
    def _capture(self, extra: Any) -> dict:
        """What must be read at the step boundary, in the training thread: references to the model's tensors (FSDP2
        swaps unsharded parameters onto the modules during forward and backward), the RNG states (the next step
        draws from them), the ``stateful`` objects' copies, DeepSpeed's ZeRO state (read through its optimizer)."""
        state = {"model": self._model_state(), "rng": rng_state(), "extra": extra}
        if self._zero is not None:
            state["zero"] = self._zero.state()  # partitions, fp32 masters, optimizer state, DeepSpeed's counters
        if self.stateful:
            state["stateful"] = {name: obj.state_dict() for name, obj in self.stateful.items()}
        return state

    def _collect(self, step: int, state: dict) -> tuple[dict, dict[str, torch.Tensor]]:
        """The rest of the snapshot, on the copy thread while the next forward and backward run (nothing it reads
        changes before the next optimizer step, which waits for this thread): the optimizer's, scheduler's and
        scaler's state dicts, then the whole state split into tensors and a JSON skeleton."""
        if self._zero is None and self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        tensors: dict[str, torch.Tensor] = {}
        skeleton = flatten_state(state, tensors)
        metadata = {"step": str(step), "rank": str(self.rank), "world_size": str(self.world),
                    "fingerprint": self.fingerprint, "identity": self._identity_json,
                    "skeleton": json.dumps(skeleton, separators=(",", ":"))}
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
        if self.persist_every and self._shards is None and self._zero is None:
            from hf_dtrain.distributed import unwrap_optimizer

            from .reshard import ShardMap

            self._shards = ShardMap(self._model_state(local=False), _unwrap(self.model),
                                    None if self.optimizer is None else unwrap_optimizer(self.optimizer))
        self._cuda = self._cuda or any(p.is_cuda for p in _unwrap(self.model).parameters())
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
        reply, fd = self.client.call({"op": "slot", "rank": self.rank, "nbytes": total}, want_fd=True)
        if "error" in reply:
            raise SnapshotError(f"the snapshot process refused a slot: {reply['error']}")
        return reply["slot"], self._map(reply["slot"], fd, reply["size"])

    def _copy(self, step, slot, buf, header, tensors, total, stream, extra=None) -> None:
        try:
            t0 = time.perf_counter()
            buf[:len(header)] = header
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
            manifest = {"step": step, "nbytes": total, "checksum": digest, "fingerprint": self.fingerprint,
                        "identity": self.identity_hash, "world_size": self.world}
            reply, _ = self.client.call({"op": "commit", "rank": self.rank, "slot": slot, "manifest": manifest})
            if "error" in reply:
                raise SnapshotError(f"the snapshot process refused the commit: {reply['error']}")
            self.stats["copy_seconds"].append(time.perf_counter() - t0)
            self.stats["snapshots"] += 1
            self.stats["bytes"] = total
            self._last = (step, extra)
            if not self._marked:
                self._write_marker({"identity": self.identity, "identity_hash": self.identity_hash,
                                    "first_step": step, "completed": False})
            if self.persist_every and step % self.persist_every == 0:
                self._start_persist(step, bytearray(memoryview(buf)[:total]), manifest)
        except BaseException as e:  # surfaced by wait()
            self._error = e

    def _write_marker(self, record: dict) -> None:
        """``run-rank<r>.json`` in the node directory: this rank has committed snapshots (so a relaunch whose
        snapshot process holds none of them says what was lost instead of starting over), or the job completed."""
        self._marked = True
        self._write_private(self.marker, json.dumps(record, default=str).encode())

    def _read_marker(self) -> Optional[dict]:
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
            raise SnapshotError(f"snapshot failed on rank {self.rank}: {type(e).__name__}: {e}") from e
        self._pending = None

    # ---------------------------------------------------------------- disk persistence
    def _start_persist(self, step: int, data: bytes, manifest: dict) -> None:
        if self._persist is not None:
            self._persist.join()

        def write():
            d = os.path.join(self.persist_dir, f"snapshot-{step}")
            os.makedirs(d, mode=0o700, exist_ok=True)
            self._write_private(os.path.join(d, f"rank{self.rank}.safetensors"), data)  # the slot is safetensors
            self._write_private(os.path.join(d, f"rank{self.rank}.json"), json.dumps(manifest).encode())
            if self._shards is not None:
                try:
                    self._persist_resharding(d, step, data)
                except Exception as e:  # the exact per-rank copy is written; only the resharding copy is missing
                    logger.error("rank %d: the DCP copy of step %d failed (%s: %s); a restart on another world size "
                                 "cannot use it", self.rank, step, type(e).__name__, e)

        self._persist = threading.Thread(target=write, daemon=True)
        self._persist.start()

    def _persist_resharding(self, d: str, step: int, data) -> None:
        """The snapshot in ``data`` (this rank's slot bytes) as a DCP checkpoint under ``d/dcp`` (each rank its own
        shards), then ``d/replicated.safetensors`` from rank 0 once every rank's shards are written."""
        from . import reshard

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
            reshard.write_replicated(os.path.join(d, reshard.REPLICATED), replicated, {
                "step": str(step), "world_size": str(self.world), "fingerprint": self.fingerprint,
                "identity": json.dumps(self.identity, sort_keys=True),
                "model_keys": json.dumps(sorted(sharded["model"]))}, self._write_private)

    def _disk_steps(self) -> list[int]:
        """Steps with a disk snapshot of this rank (``snapshot-<step>/rank<r>.json``) or a complete DCP copy
        (``snapshot-<step>/replicated.safetensors``); other names are ignored."""
        if not self.persist_dir or not os.path.isdir(self.persist_dir):
            return []
        steps = []
        for name in os.listdir(self.persist_dir):
            number = name[len("snapshot-"):]
            if name.startswith("snapshot-") and number.isdigit() and any(os.path.exists(
                    os.path.join(self.persist_dir, name, f)) for f in (f"rank{self.rank}.json", "replicated.safetensors")):
                steps.append(int(number))
        return sorted(steps)

    def _read_disk(self, step: int) -> tuple[Optional[Any], str]:
        """This rank's disk snapshot of ``step`` as bytes, checked against its manifest, or ``(None, why)``."""
        d = os.path.join(self.persist_dir, f"snapshot-{step}")
        path = os.path.join(d, f"rank{self.rank}.json")
        try:
            with open(path) as f:
                manifest = json.load(f)
            nbytes, digest = int(manifest["nbytes"]), str(manifest["checksum"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            return None, f"{path} is damaged ({type(e).__name__}: {e})"
        data_path = os.path.join(d, f"rank{self.rank}.safetensors")
        try:
            if os.path.getsize(data_path) < nbytes:
                return None, f"{data_path} is truncated ({os.path.getsize(data_path)} of {nbytes} bytes)"
            data = torch.from_file(data_path, size=nbytes, dtype=torch.uint8).numpy()  # a private mapping
        except (RuntimeError, OSError) as e:
            return None, f"{data_path} cannot be read ({e})"
        if checksum(data) != digest:
            return None, f"{data_path} fails its checksum (a corrupted byte)"
        return data, ""

    # ---------------------------------------------------------------- restore
    def _agree(self, steps: list[int]) -> list[int]:
        """The steps every rank has, newest first."""
        if not self.distributed:
            return sorted(steps, reverse=True)
        buf = torch.full((64,), -1, dtype=torch.int64)
        mine = sorted(steps)[-64:]
        buf[:len(mine)] = torch.tensor(mine, dtype=torch.int64)
        out = [torch.zeros_like(buf) for _ in range(self.world)]
        dist.all_gather(out, buf, group=self.group)
        common = set(int(s) for s in out[0].tolist() if s >= 0)
        for t in out[1:]:
            common &= set(int(s) for s in t.tolist() if s >= 0)
        return sorted(common, reverse=True)

    def _vote(self, flag: bool, every: bool) -> bool:
        """``flag`` on every rank (``every``) or on any rank: one all-reduce of 0/1 (MIN or MAX)."""
        if not self.distributed:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN if every else dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def _all(self, flag: bool) -> bool:
        return self._vote(flag, every=True)

    def _any(self, flag: bool) -> bool:
        return self._vote(flag, every=False)

    def _check_all(self, metadata: dict, where: str) -> None:
        """``_check`` on every rank at once: a mismatch anywhere is a ``ValueError`` everywhere (no rank is left
        waiting in a collective)."""
        problem = None
        try:
            self._check(metadata, where)
        except ValueError as e:
            problem = e
        if self._any(problem is not None):
            raise problem or SnapshotMismatch(f"another rank's snapshot {where} does not match this run (see its "
                                              "error)")

    def _check(self, metadata: dict, where: str) -> None:
        if int(metadata["world_size"]) != self.world:
            raise SnapshotMismatch(f"The snapshot {where} was taken with world size {metadata['world_size']}; this run "
                                   f"has {self.world}. Restart with the same number of processes, or set "
                                   "fault_tolerance.persist_every so that a restart on another world size reshards "
                                   "the newest persisted DCP snapshot.")
        theirs = json.loads(metadata.get("identity") or "{}")
        if theirs != self.identity:
            raise SnapshotMismatch(f"The snapshot {where} belongs to another job: "
                                   f"{identity_diff(theirs, self.identity)}. This run does not resume it. To train "
                                   f"this job from step 0 and discard those snapshots, relaunch with "
                                   f"{FRESH_START}; to keep them, give this job its own fault_tolerance.directory "
                                   "(or output directory).")

    def _load(self, metadata: dict, tensors: dict[str, torch.Tensor], apply: bool = True) -> dict:
        """The snapshot's state (its tensors are views into a private copy of the slot); with ``apply``, loaded into
        the model, optimizer, scheduler, scaler and RNGs."""
        state = unflatten_state(json.loads(metadata["skeleton"]), tensors)
        if apply:
            self._apply(state)
        return state

    def _apply(self, state: dict) -> None:
        self.apply_model(state)
        self.apply_optimizer(state)
        self.apply_rest(state)
        self.rebuild_ddp_buckets()

    def rebuild_ddp_buckets(self) -> None:
        """A DDP model (passed wrapped): its buckets rebuilt before the first step after the restore, so that step
        reduces as the uninterrupted run's did (``hf_dtrain.fault.ddp``)."""
        from .ddp import rebuild_ddp_buckets

        rebuild_ddp_buckets(self.model)

    def apply_model(self, state: dict) -> None:
        """The restored model tensors (and DeepSpeed's ZeRO partitions), copied in place into this rank's live
        tensors: FSDP2's local shards, DDP's replicas, the trainable parameters of a PEFT model."""
        if self._zero is not None:
            why = self._zero.check(state.get("zero", {}))
            if self._any(why is not None):
                raise SnapshotMismatch(f"The snapshot does not fit this run's DeepSpeed ZeRO partitions: "
                                       f"{why or 'see the other ranks'}. Resume with the ZeRO settings and world size "
                                       f"that took it, or train from step 0 with {FRESH_START}.")
            self._zero.load(state["zero"])
        live = self._model_state()
        missing = sorted(set(state["model"]) - set(live))
        if self._any(bool(missing)):
            raise SnapshotMismatch(f"The snapshot holds tensors this model does not have ({', '.join(missing[:4])}"
                                   f"{' ...' if len(missing) > 4 else ''}); resume it with the model that took it, "
                                   f"or train from step 0 with {FRESH_START}.")
        with torch.no_grad():
            for name, t in state["model"].items():
                live[name].copy_(t)

    def apply_optimizer(self, state: dict) -> None:
        """The restored optimizer state, loaded into ``self.optimizer`` (an FSDP2 parameter's state as DTensor
        shards again)."""
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(_as_shards(self.optimizer, state["optimizer"]))

    def apply_rest(self, state: dict) -> None:
        """The scheduler, scaler, RNGs and ``stateful`` objects."""
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"])
        for name, obj in self.stateful.items():
            if name in state.get("stateful", {}):
                obj.load_state_dict(state["stateful"][name])

    def _try_memory(self, step: int) -> tuple[Optional[tuple[dict, dict, bool]], str]:
        reply, fd = self.client.call({"op": "open", "rank": self.rank, "step": step}, want_fd=True)
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
            return None, (f"rank {self.rank}'s snapshot of step {step} fails its checksum (a corrupted byte); "
                          "it is not used")
        metadata, tensors = parse(buf.numpy())  # views into the private copy
        return (metadata, tensors, reply.get("rebuilt", False)), ""

    def available(self) -> tuple[list[int], str, str]:
        reply, _ = self.client.call({"op": "available", "rank": self.rank})
        return reply["steps"], reply["source"], reply.get("reason", "")

    def restore(self, apply: bool = True) -> Optional[Restored]:
        """Load the newest step every rank has: from memory, else rebuilt from parity, else from disk (with
        ``apply=False`` the state is returned in ``Restored.state`` and nothing is loaded). Returns ``None`` on a
        fresh start: nothing anywhere and no record of earlier snapshots, or ``fresh_start`` set. Raises
        ``SnapshotError`` when this job had snapshots but none can be restored (saying which copies were lost and
        what remains), ``ValueError`` for a snapshot of another world size or another job (naming what differs).
        A job that already completed returns ``Restored(source="completed")`` with the extra of its last step."""
        if self.config.fresh_start:
            self._start_fresh()
            return None
        marker = self._read_marker()
        steps, source, reason = self.available()
        reasons = [reason] if reason else []
        disk_steps = self._disk_steps()
        # lost: this rank committed snapshots (its record says so) and its snapshot process holds none now. Ranks
        # that all hold snapshots but share no step never finished a first one together: a fresh start is right.
        lost_here = marker is not None and not marker.get("completed") and not steps
        had_any = self._any(lost_here or bool(reason) or bool(disk_steps))
        other_world = None  # the world size of in-memory snapshots taken on another number of ranks
        for step in self._agree(steps):
            got, why = self._try_memory(step)
            if self._all(got is not None):
                theirs = int(got[0]["world_size"])
                if self._any(theirs != self.world):
                    other_world = theirs
                    logger.warning("the in-memory snapshots were taken on %d ranks and this run has %d: they cannot "
                                   "be loaded here; trying the persisted DCP snapshots, which reshard", theirs,
                                   self.world)
                    break
                self._check_all(got[0], f"in memory at step {step}")
                metadata, tensors, rebuilt = got
                state = self._load(metadata, tensors, apply)
                used = "parity" if self._any(rebuilt) else "memory"
                self._discard_after(step)
                self._marked = False  # written again at the next commit
                self._last = (step, state["extra"])
                detail = "rebuilt from peers' parity" if used == "parity" else "held by the snapshot processes"
                logger.warning("restored step %d from %s (%s)", step, used, detail)
                return Restored(step, used, state["extra"], detail, state)
            if why:
                reasons.append(why)
                logger.error("cannot use step %d from memory: %s", step, why)
        completed = self._completed(marker)
        if completed is not None:
            return completed
        if reasons:
            logger.error("in-memory restore failed: %s; falling back to the disk snapshots", "; ".join(reasons))
        skipped = []
        for step in self._agree(disk_steps):
            resharded = self._try_resharded(step, apply, reasons)
            if resharded is not None:
                return resharded
            data, why = self._read_disk(step)
            if why:
                reasons.append(why)
            if self._all(data is not None):
                d = os.path.join(self.persist_dir, f"snapshot-{step}")
                metadata, tensors = parse(data)
                if self._any(int(metadata["world_size"]) != self.world):
                    # taken on another world size and its DCP copy is incomplete (a host was lost while writing
                    # it): an older step's copy may reshard
                    why = (f"the copy of step {step} was taken on {metadata['world_size']} ranks and its resharding "
                           "(DCP) copy is incomplete")
                    reasons.append(why)
                    skipped.append(step)
                    logger.error("%s; trying an older one", why)
                    continue
                self._check_all(metadata, f"on disk at {d}")
                state = self._load(metadata, tensors, apply)
                self._discard_after(-1)
                self._marked = False
                self._last = (step, state["extra"])
                detail = f"{d}" + (f" (newer copies unusable: {'; '.join(reasons)})" if reasons else "")
                logger.warning("restored step %d from disk (%s)", step, detail)
                return Restored(step, "disk", state["extra"], detail, state)
            skipped.append(step)
            logger.error("disk snapshot of step %d is unusable on some rank (%s); trying an older one", step,
                         why or "another rank's copy")
        if other_world is not None:
            raise SnapshotMismatch(
                f"This job's snapshots were taken on {other_world} ranks and this run has {self.world}; in-memory "
                "snapshots load only into the world size that took them, and no persisted DCP snapshot "
                f"{'exists in ' + self.persist_dir if self.persist_dir else 'is configured'} to reshard from. "
                f"Relaunch on {other_world} ranks to resume from memory; set fault_tolerance.persist_every (and "
                "persist_dir, on storage every node reads) so a later restart on another world size can reshard; "
                f"or train from step 0 with {FRESH_START}.")
        if had_any or self._any(bool(reasons)):
            raise SnapshotError(self._lost_message(marker, reasons, skipped))
        return None

    def _try_resharded(self, step: int, apply: bool, reasons: list[str]) -> Optional[Restored]:
        """Restore ``step`` from its DCP copy when it was taken on another world size (every rank agrees), loading
        the model's and optimizer's shards into this run's sharding; None when the step was taken on this world size
        (the exact per-rank copy is used) or has no complete DCP copy. A copy of another job, or one whose tensors
        do not map onto this model and optimizer, is refused on every rank naming what differs."""
        from . import reshard

        d = os.path.join(self.persist_dir, f"snapshot-{step}")
        path = os.path.join(d, reshard.REPLICATED)
        metadata, state, why = None, None, ""
        if os.path.exists(path):
            try:
                metadata, state = reshard.read_replicated(path)
            except Exception as e:  # a damaged file: the step is not used
                why = f"{path} cannot be read ({type(e).__name__}: {e})"
        other = metadata is not None and int(metadata["world_size"]) != self.world
        if not self._any(other):
            return None
        if not self._all(metadata is not None):
            reasons.append(why or f"{path} is missing on some rank")
            return None
        self._check_all({**metadata, "world_size": str(self.world)}, f"on disk at {d}")
        model_keys = json.loads(metadata["model_keys"])
        opt = None
        if self.optimizer is not None:
            from hf_dtrain.distributed import unwrap_optimizer

            opt = unwrap_optimizer(self.optimizer)
        if apply:
            target, osd = reshard.template(_unwrap(self.model), opt, model_keys)
            problems = reshard.differences(target, os.path.join(d, reshard.DCP_DIR), model_keys)
            if self._any(bool(problems)):
                raise SnapshotMismatch(
                    f"The snapshot on disk at {d} (taken on {metadata['world_size']} ranks) does not map onto this "
                    f"model and optimizer: {'; '.join(problems[:6]) or 'see the other ranks'}"
                    f"{f' (and {len(problems) - 6} more)' if len(problems) > 6 else ''}. Resume it with the model "
                    f"and optimizer that took it, or train from step 0 with {FRESH_START}.")
            reshard.load(_unwrap(self.model), opt, os.path.join(d, reshard.DCP_DIR), target, osd, state)
            if self.scheduler is not None and "scheduler" in state:
                self.scheduler.load_state_dict(state["scheduler"])
            if self.scaler is not None and "scaler" in state:
                self.scaler.load_state_dict(state["scaler"])
            set_rng_state(state["rng"])  # rank 0's: the old ranks' streams do not map onto the new ranks
            self.rebuild_ddp_buckets()
            if self.stateful:
                logger.warning("restored on another world size: %s start afresh (their per-rank state, such as "
                               "error feedback, does not map onto the new ranks)", ", ".join(self.stateful))
        self._discard_after(-1)
        self._marked = False
        self._last = (step, state["extra"])
        detail = (f"{d}, taken on {metadata['world_size']} ranks and resharded onto {self.world} by "
                  "torch.distributed.checkpoint")
        logger.warning("restored step %d from disk (%s)", step, detail)
        return Restored(step, "resharded", state["extra"], detail, state)

    def _completed(self, marker: Optional[dict]) -> Optional[Restored]:
        """A relaunch after the job finished (its snapshot processes shut down): the completed record, agreed by
        every rank, or None."""
        done = bool(marker) and marker.get("completed") is True and marker.get("identity_hash") == self.identity_hash
        if not self._all(done):
            return None
        logger.warning("this job already completed at step %s; nothing to resume", marker.get("last_step"))
        return Restored(int(marker.get("last_step") or 0), "completed", marker.get("extra"),
                        f"the job completed at step {marker.get('last_step')} ({self.marker})")

    def _lost_message(self, marker: Optional[dict], reasons: list[str], skipped: list[int]) -> str:
        parts = [f"This job took snapshots (rank {self.rank}, node {self.node}: {self.dir}) but none can be "
                 "restored, so it will not silently start over."]
        if marker and marker.get("identity_hash") not in (None, self.identity_hash):
            parts.append(f"They belonged to another job ({identity_diff(marker.get('identity', {}), self.identity)}).")
        exited = os.path.join(self.dir, "exited.json")
        if os.path.exists(exited):
            with contextlib.suppress(OSError, ValueError):
                parts.append(f"Node {self.node}'s snapshot process exited: {json.load(open(exited))['reason']}.")
        elif self.started_smp is not None and marker is not None:
            parts.append(f"Node {self.node}'s snapshot process was lost (a new one was started by this launch), "
                         "and its snapshots with it.")
        if reasons:
            parts.append("Lost or unusable: " + "; ".join(reasons) + ".")
        if skipped:
            parts.append(f"Disk snapshots of steps {skipped} are not usable on every rank.")
        elif not self.persist_dir:
            parts.append("No disk copy to fall back to (set fault_tolerance.persist_dir and persist_every).")
        else:
            parts.append(f"No disk snapshot in {self.persist_dir}.")
        parts.append(f"To train from step 0, relaunch with {FRESH_START}.")
        return " ".join(parts)

    def _start_fresh(self) -> None:
        """``fresh_start``: drop this job's snapshots (memory, the record of them) and move its disk snapshots
        aside to ``<persist_dir>.discarded-<time>`` (kept, never read again), on every rank, then train from 0."""
        self._discard_after(-1)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.marker)
        if self.persist_dir and os.path.isdir(self.persist_dir) and self.rank == 0:
            aside = f"{self.persist_dir}.discarded-{time.strftime('%Y%m%d-%H%M%S')}"
            os.replace(self.persist_dir, aside)
            logger.warning("fresh start: the disk snapshots moved to %s", aside)
        if self.distributed:
            dist.barrier(group=self.group)
        logger.warning("fresh start (fault_tolerance.fresh_start): this job's earlier snapshots are discarded")

    def _discard_after(self, step: int) -> None:
        self.client.call({"op": "discard", "rank": self.rank, "after": step})

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
        for slot, (_, m) in self._maps.items():
            self._unregister(slot)
            m.close()
        self._maps.clear()
        if shutdown:
            if self.distributed:
                dist.barrier(group=self.group)
            step, extra = self._last or (0, None)
            self._write_marker({"identity": self.identity, "identity_hash": self.identity_hash, "completed": True,
                                "last_step": step, "extra": extra})
            if self.distributed:
                dist.barrier(group=self.group)
            if self.rank == self.local_ranks[0]:
                self.client.call({"op": "shutdown"})
        self.client.close()
