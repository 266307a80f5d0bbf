"""The elastic job's run: this host's torchrun agent, and each worker's training."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_dtrain.data.partition import HeterogeneityAwareSampler
from hf_dtrain.distributed.groups import release_process_group
from hf_dtrain.errors import EndpointError
from hf_dtrain.fault import SnapshotConfig, SnapshotEngine
from hf_dtrain.models import build_llama

from .config import LOG, ElasticConfig, ElasticJob, is_local, parse_endpoint, torchrun_command


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
