"""Elastic data-parallel training: hosts join and leave a run while it trains.

Built on torchrun's elastic agent (a c10d rendezvous with ``--nnodes MIN:MAX``), the snapshot engine of
``hf_dtrain.fault`` and the heterogeneity-aware partitioner of ``hf_dtrain.data``:

* every host runs ``hf-dtrain elastic`` (which runs torchrun for it). When a host leaves (killed, lost) the others'
  collectives fail, their agents meet again without it and restart their workers; when a host arrives, the running
  agents see it waiting, stop at once, and meet again with it. Each new membership is a new *generation* of workers.
* a generation starts from the newest snapshot. With the same world size the engine restores from memory (the
  snapshot processes outlive the workers); on a new world size it reshards the persisted copy (a DCP checkpoint every
  ``persist_every`` steps, on storage every host reads), which newcomers load like everybody else.
* a generation measures each worker's speed (timed forward/backward steps, no gradient exchange) and deals every
  global batch in proportion to it (``HeterogeneityAwareSampler``), weighting each rank's loss so that the gradient
  is the mean over the global batch, as one process would compute it.
* rank 0 appends every step (loss, world size, batch sizes, speeds, where the generation restored from) to
  ``<output_dir>/elastic.jsonl``; steps past the restored one (a timeline that died with a host) are dropped first.

torch 2.13's c10d rendezvous shares its TCP store with the workers by default, and a host that joins an existing
run then waits forever for keys the store's owner writes only once (the first generation's master address): the
launcher sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` so each generation publishes its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_dtrain.data.partition import HeterogeneityAwareSampler
from hf_dtrain.distributed.groups import release_process_group
from hf_dtrain.errors import EndpointError, SettingsError
from hf_dtrain.fault import SnapshotConfig, SnapshotEngine
from hf_dtrain.models import PRESETS, build_llama
from hf_dtrain.run.config import JobConfig
from hf_dtrain.settings import check_fields, setting

LOG = "elastic.jsonl"


@dataclass
class ElasticConfig:
    """One elastic run. Every field is a flag of ``hf-dtrain elastic`` (``--steps``, ``--min-nodes`` ...); every
    host passes the same values, except ``slowdown`` (this host's own)."""

    output_dir: str = setting(
        "runs/elastic",
        "Where the log, the snapshots' persisted copies and the final model go: storage every host reads.",
    )
    steps: int = setting(60, "Optimizer steps of the whole run.", min=1)
    global_batch_size: int = setting(16, "Sequences per step over all workers, dealt by measured speed.", min=1)
    seq_len: int = setting(32, "Tokens per sequence.", min=2)
    samples: int = setting(2048, "Size of the synthetic training set.", min=1)
    preset: str = setting("test", "LlamaConfig preset of the model (hf_dtrain.models).")
    lr: float = setting(3e-3, "AdamW's learning rate.", gt=0)
    seed: int = setting(0, "Seed of the model and the data.", min=0)
    min_nodes: int = setting(1, "Fewest hosts the run trains with.", min=1)
    max_nodes: int = setting(4, "Most hosts that may join.", min=1)
    persist_every: int = setting(
        1,
        "Steps between persisted (resharding) snapshot copies: a membership change resumes from "
        "the newest one, so at most this many steps are recomputed.",
        min=1,
    )
    probe_steps: int = setting(
        2, "Timed forward/backward steps per worker at the start of each generation (its speed).", min=1
    )
    collective_timeout: float = setting(
        30.0, "Seconds a collective waits for a rank before the generation fails.", gt=0
    )
    slowdown: float = setting(
        1.0, "This host only: emulate a slower host (each step's compute takes this many times longer).", min=1
    )

    def __post_init__(self):
        check_fields(self)
        if self.min_nodes > self.max_nodes:
            raise SettingsError(
                f"ElasticConfig.min_nodes={self.min_nodes} is more than max_nodes={self.max_nodes}; "
                "set --min-nodes <= --max-nodes."
            )
        if self.preset not in PRESETS:
            raise SettingsError(
                f"ElasticConfig.preset={self.preset!r} is not a preset; choose one of {sorted(PRESETS)}."
            )
        if self.global_batch_size < self.max_nodes:
            raise SettingsError(
                f"ElasticConfig.global_batch_size={self.global_batch_size} cannot give each of up to "
                f"max_nodes={self.max_nodes} workers a sequence; raise --global-batch-size or lower "
                "--max-nodes."
            )


def torchrun_command(
    config: ElasticConfig,
    endpoint: str,
    run_id: str,
    nproc_per_node: int = 1,
    local_addr: str | None = None,
    store_host: bool | None = None,
) -> tuple[list, dict]:
    """The torchrun command line (and environment additions) that runs this host's share of ``config``;
    ``local_addr``: this host's address as the others reach it (default: what its hostname resolves to);
    ``store_host``: whether this host serves the rendezvous store at ``endpoint``; None lets torchrun decide (by
    comparing the endpoint with the hostname's addresses: it misses an address the hostname does not resolve to, and
    on one machine the first agent to bind the port wins). The run lives as long as the store's host: say which."""
    args = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            f"{config.min_nodes}:{config.max_nodes}",
            "--nproc-per-node",
            str(nproc_per_node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            run_id,
            "--max-restarts",
            "100",
            "--monitor-interval",
            "0.5",
            # a lost host is dropped after 3 missed 1 s heartbeats; a generation forms 2 s after its last arrival
            "--rdzv-conf",
            "join_timeout=120,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3,"
            "close_timeout=5" + ("" if store_host is None else f",is_host={str(store_host).lower()}"),
        ]
        + (["--local-addr", local_addr] if local_addr else [])
        + ["-m", "hf_dtrain.cli", "elastic", "--worker", "true"]
        + to_argv(config)
    )
    return args, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def to_argv(config: ElasticConfig) -> list[str]:
    """The flags of ``config``'s run settings (the ones every host and worker shares)."""
    out = []
    for f in dataclasses.fields(ElasticConfig):
        out += [f"--{f.name.replace('_', '-')}", str(getattr(config, f.name))]
    return out


def synthetic_corpus(samples: int, seq_len: int, vocab: int, seed: int) -> torch.Tensor:
    """``samples`` sequences of arithmetic progressions modulo ``vocab`` (random start and stride): learnable, so the
    loss curve shows whether training continued across a membership change."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (samples, 1), generator=g)
    stride = torch.randint(1, 8, (samples, 1), generator=g)
    return (start + stride * torch.arange(seq_len)) % vocab


def _speed(model, batch: torch.Tensor, steps: int, slowdown: float) -> float:
    """Sequences per second of this worker's forward/backward alone (no gradient exchange: DDP's ``no_sync``)."""
    with model.no_sync():
        model(input_ids=batch, labels=batch).loss.backward()  # warm-up
        t0 = time.perf_counter()
        for _ in range(steps):
            t = time.perf_counter()
            model(input_ids=batch, labels=batch).loss.backward()
            if slowdown > 1:
                time.sleep((slowdown - 1) * (time.perf_counter() - t))
        seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return steps * batch.shape[0] / seconds


def _append_log(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _truncate_log(path: str, after_step: int) -> None:
    """Drop the steps after ``after_step``: they belong to a timeline that died with a host."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        keep = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= after_step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)


def read_log(output_dir: str) -> list[dict]:
    path = os.path.join(output_dir, LOG)
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_worker(config: ElasticConfig) -> None:
    """One worker of one generation (what torchrun runs on each host)."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=config.collective_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(config.seed)
    model = build_llama(config.preset, seed=config.seed)
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    os.makedirs(config.output_dir, exist_ok=True)
    snapshots = SnapshotConfig(
        directory=os.path.join(config.output_dir, "snapshots"),
        parity=0,
        persist_every=config.persist_every,
        persist_dir=os.path.join(config.output_dir, "persisted"),
        timeout=config.collective_timeout,
    )
    engine = SnapshotEngine(
        ddp,
        optimizer,
        scheduler,
        config=snapshots,
        identity={"job": "elastic", "preset": config.preset, "seed": config.seed},
    )
    restored = engine.restore()
    start = restored.step + 1 if restored is not None else 0
    source = restored.source if restored is not None else "fresh"
    log = os.path.join(config.output_dir, LOG)
    generation = 0  # this membership's number: one more than the last one in the log
    if rank == 0:
        _truncate_log(log, start - 1)
        if os.path.exists(log) and start > 0:
            prior = read_log(config.output_dir)
            generation = prior[-1]["generation"] + 1 if prior else 0

    data = synthetic_corpus(config.samples, config.seq_len, model.config.vocab_size, config.seed)
    probe = data[:4]
    speed = torch.tensor([_speed(ddp, probe, config.probe_steps, config.slowdown)], dtype=torch.float64)
    speeds = [torch.zeros_like(speed) for _ in range(world)]
    dist.all_gather(speeds, speed)
    speeds = [float(s) for s in speeds]
    sampler = HeterogeneityAwareSampler(
        None, speeds, rank=rank, num_samples=len(data), seed=config.seed, global_batch_size=config.global_batch_size
    )
    batch_size = sampler.batch_size_for(config.global_batch_size)
    scale = sampler.loss_scale(config.global_batch_size)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([batch_size]))
    sizes = [int(s) for s in sizes]
    per_epoch = sampler.steps_per_epoch

    order, epoch = [], None
    for step in range(start, config.steps):
        if step // per_epoch != epoch:  # this rank's order, drawn once per epoch
            epoch = step // per_epoch
            sampler.set_epoch(epoch)
            order = list(iter(sampler))
        at = (step % per_epoch) * batch_size
        batch = data[order[at : at + batch_size]]
        t0 = time.perf_counter()
        loss = ddp(input_ids=batch, labels=batch).loss
        (loss * scale).backward()
        if config.slowdown > 1:
            time.sleep((config.slowdown - 1) * (time.perf_counter() - t0))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        total = torch.tensor([loss.item() * batch_size], dtype=torch.float64)
        dist.all_reduce(total)
        engine.snapshot(step, extra={"step": step})
        if rank == 0:
            record = {
                "step": step,
                "loss": float(total) / config.global_batch_size,
                "world_size": world,
                "generation": generation,
                "batch_sizes": sizes,
                "speeds": [round(s, 2) for s in speeds],
                "seconds": round(time.perf_counter() - t0, 4),
                "time": time.time(),
            }
            if step == start:
                record["restored_from"] = source
            _append_log(log, record)
    engine.wait()
    dist.barrier()
    if rank == 0:
        model.save_pretrained(os.path.join(config.output_dir, "model"), safe_serialization=True)
    engine.close(shutdown=True)
    del ddp
    release_process_group()


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` (``[v6-address]:port``) of ``--endpoint``, checked: an :class:`~hf_dtrain.errors.EndpointError`
    naming it when the port is missing or out of range or the host does not resolve."""
    text = endpoint.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise EndpointError(
            f"--endpoint {endpoint!r} is not host:port (e.g. 10.0.0.1:29400, [fd00::1]:29400): give the first host's "
            "address and the rendezvous port."
        )
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise EndpointError(f"--endpoint {endpoint!r}: the port {port!r} is not a number from 1 to 65535.")
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError as e:
        raise EndpointError(
            f"--endpoint {endpoint!r}: the host {host!r} does not resolve ({e.strerror or e})."
        ) from None
    return host, int(port)


def is_local(host: str) -> bool:
    """``host`` is an address of this machine (a socket binds to it)."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in infos:
        with contextlib.suppress(OSError), socket.socket(family, kind, proto) as probe:
            probe.bind((address[0], 0))
            return True
    return False


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 sent to /dev/null for the block (C++ logging writes there, not to ``sys.stderr``)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def wait_for_endpoint(endpoint: str, timeout: float) -> None:
    """Reach the rendezvous store at ``endpoint`` (a TCP connection and the store's own handshake: a bare accept by
    a proxy or another service is not enough) within ``timeout`` seconds: an ``EndpointError`` naming the endpoint
    and what to check when it does not answer (torchrun would retry for minutes, printing C++ frames)."""
    host, port = parse_endpoint(endpoint)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, left))):
                pass
            with _quiet_stderr():  # the store client logs each failed handshake with C++ frames
                store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=max(1.0, left)))
            del store
            return
        except (OSError, RuntimeError, ValueError) as e:  # refused, unreachable, or no store's handshake
            last = " ".join(str(e).split("\n")[0].split()) or type(e).__name__
        if time.monotonic() >= deadline:
            raise EndpointError(
                f"no rendezvous store answers at --endpoint {endpoint} after {timeout:g} s ({last[:160]}): start the "
                "host that serves it (--store-host true) first, check the address, the port and the firewall, or "
                "wait longer with --connect-timeout."
            )
        time.sleep(0.5)


@dataclass
class ElasticJob(ElasticConfig, JobConfig):
    """``hf-dtrain elastic``: this host's share of an elastic run (:class:`ElasticConfig`, the same on every host) and
    how it joins (``--endpoint``, ``--store-host``...), every field a flag."""

    job = "elastic"

    endpoint: str = setting(
        "127.0.0.1:29400", "host:port of the rendezvous (the first host's address; every host passes the same)."
    )
    run_id: str = setting("hf-dtrain-elastic", "The rendezvous id (the same on every host).")
    nproc_per_node: int = setting(1, "Workers on this host.", min=1)
    store_host: bool | None = setting(
        None,
        "true: this host serves the rendezvous store at --endpoint; false: it connects to it. Default: "
        "torchrun decides by the hostname's addresses. The run lives as long as the store's host does: set true "
        "on the host that stays, false on the others.",
    )
    local_addr: str | None = setting(
        None, "This host's address as the other hosts reach it (default: what its hostname resolves to)."
    )
    connect_timeout: float = setting(
        60.0,
        "Seconds a host that does not serve the rendezvous waits for --endpoint to answer before it stops "
        "with an error naming it.",
    )
    worker: bool = setting(False, "Run as one of torchrun's workers.", hidden=True)

    def __post_init__(self):
        super().__post_init__()
        if not (isinstance(self.connect_timeout, (int, float)) and self.connect_timeout > 0):
            raise EndpointError(f"--connect-timeout must be a positive number of seconds, got {self.connect_timeout}.")


def run_elastic(cfg: ElasticJob) -> int:
    """A worker (``--worker``, started by torchrun) trains; otherwise this host's torchrun agent is started, after
    checking that the rendezvous store answers when this host joins one that another serves."""
    if cfg.worker:
        run_worker(cfg)
        return 0
    host, _ = parse_endpoint(cfg.endpoint)
    if cfg.store_host is False or (cfg.store_host is None and not is_local(host)):
        wait_for_endpoint(cfg.endpoint, cfg.connect_timeout)  # this host joins: the store must answer
    cmd, env = torchrun_command(cfg, cfg.endpoint, cfg.run_id, cfg.nproc_per_node, cfg.local_addr, cfg.store_host)
    return subprocess.call(cmd, env={**os.environ, **env})
