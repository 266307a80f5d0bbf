"""hf_dtrain's in-memory snapshots against torchft (the closest maintained system: ``pip install torchft==0.2.0``),
on the same model and machine: the tiny LLaMA preset (``hf_dtrain.models.build_llama``), AdamW, batch 8 x 128 random
tokens, 2 gloo processes:

* **per-step overhead**: the median step time of plain DDP (no fault tolerance), of DDP with hf_dtrain's snapshot
  every step (two emulated nodes, parity 1: each snapshot is also erasure coded onto the other node), and of torchft
  (two replica groups of one process each, its Manager, DDP wrapper and optimizer wrapper, a lighthouse in this
  process), each over the steps after a warm-up;
* **recovery after a lost replica**: one process SIGKILLed after step ``KILL_AT``. hf_dtrain: ``torchrun
  --max-restarts 1`` restarts both ranks, which restore the step from the snapshot processes; torchft: this script
  restarts the killed replica at once (as its launcher would), which joins the next quorum and fetches the state
  from the live replica while that one trains on. Measured: the seconds from the kill to the restarted process's
  first completed step, and what the job lost (steps redone; torchft's survivor does not stop).

JSON, markdown and a PNG under ``benchmarks/results/torchft_compare.*`` (``--name``; the runs of 2026-12-02 and before
are ``fault_tolerance_torchft.*``).

    pip install torchft==0.2.0 && python benchmarks/torchft_compare.py      # about 4 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import markdown_table, write

ROOT = Path(__file__).resolve().parent.parent
STEPS, KILL_AT, WARMUP = 30, 12, 5
BATCH, SEQ = 8, 128


def _env(**extra) -> dict:
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **extra,
    )


def _model_and_optimizer():
    import torch

    from hf_dtrain.models import build_llama

    model = build_llama("tiny", seed=0)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _batch(step: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 1000, (BATCH, SEQ), generator=g)


def _record(out: Path, who: str, step: int, loss: float) -> None:
    with open(out / f"steps-{who}.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "t": time.time(), "loss": loss, "pid": os.getpid()}) + "\n")


def _die(out: Path, who: str, step: int) -> None:
    with open(out / f"killed-{who}.json", "w") as f:
        json.dump({"step": step, "t": time.time()}, f)
    os.kill(os.getpid(), signal.SIGKILL)


# ---- workers ---------------------------------------------------------------------------------------------------------
def ddp_worker(out: Path, snapshots: bool, kill: bool) -> None:
    """One rank of plain DDP, with hf_dtrain's snapshot every step when ``snapshots`` (torchrun starts it)."""
    import torch
    import torch.distributed as dist

    from hf_dtrain.distributed.groups import init_distributed

    init_distributed() or dist.init_process_group("gloo")
    rank = dist.get_rank()
    # one emulated node per rank (as hf_dtrain.testing.elastic_launch does): parity goes to the other one
    os.environ.update(HF_DTRAIN_NODE_RANK=str(rank), LOCAL_WORLD_SIZE="1")
    model, optimizer = _model_and_optimizer()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    engine, start = None, 1
    if snapshots:
        from hf_dtrain.fault import SnapshotEngine

        engine = SnapshotEngine(ddp, optimizer, directory=str(out / "ft"), parity=1, idle_exit=30)
        restored = engine.restore()
        if restored is not None:
            start = restored.extra["next_step"]
    generation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    for step in range(start, STEPS + 1):
        loss = ddp(input_ids=_batch(step, rank), labels=_batch(step, rank)).loss
        loss.backward()
        if engine is not None:
            engine.wait()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _record(out, f"rank{rank}", step, loss.item())
        if engine is not None:
            engine.snapshot(step, extra={"next_step": step + 1})
        if kill and rank == 1 and step == KILL_AT and generation == "0":
            engine.wait()
            _die(out, f"rank{rank}", step)
    if engine is not None:
        engine.close(shutdown=True)
    dist.barrier()
    dist.destroy_process_group()


def torchft_worker(out: Path, replica: int, lighthouse: str, kill: bool) -> None:
    """One replica group (one process) under torchft's Manager."""
    from datetime import timedelta

    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper

    model, inner = _model_and_optimizer()
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"replica{replica}",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        timeout=timedelta(seconds=30),
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = OptimizerWrapper(manager, inner)
    restarted = (out / f"killed-replica{replica}.json").exists()
    while manager.current_step() < STEPS:
        before = manager.current_step()
        optimizer.zero_grad(set_to_none=True)  # starts the quorum (a recovering replica gets the state in it)
        loss = ddp(input_ids=_batch(before + 1, replica), labels=_batch(before + 1, replica)).loss
        loss.backward()
        optimizer.step()  # steps only when every replica in the quorum committed
        step = manager.current_step()
        if step > before:
            _record(out, f"replica{replica}", step, loss.item())
            if kill and replica == 1 and step == KILL_AT and not restarted:
                _die(out, f"replica{replica}", step)
    manager.shutdown(wait=False)


# ---- the runs --------------------------------------------------------------------------------------------------------
def _steps(out: Path, who: str) -> list[dict]:
    path = out / f"steps-{who}.jsonl"
    return [json.loads(line) for line in open(path) if line.strip()] if path.exists() else []


def _median_step(records: list[dict]) -> float:
    times = [
        b["t"] - a["t"] for a, b in itertools.pairwise(records) if b["step"] == a["step"] + 1 and a["pid"] == b["pid"]
    ]
    return statistics.median(times[WARMUP:])


def run_torchrun(out: Path, snapshots: bool, kill: bool) -> None:
    from hf_dtrain import processes
    from hf_dtrain.testing import free_port

    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--monitor-interval", "0.2"]
    argv += ["--max-restarts", "1" if kill else "0", "--master-port", str(free_port()), __file__, "--worker", "ddp"]
    argv += ["--out", str(out)] + (["--snapshots"] if snapshots else []) + (["--kill"] if kill else [])
    done = processes.run(argv, env=_env(), capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])


def run_torchft(out: Path, kill: bool) -> None:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000)
    try:

        def start(replica):
            argv = [sys.executable, __file__, "--worker", "torchft", "--out", str(out), "--replica", str(replica)]
            argv += ["--lighthouse", lighthouse.address()] + (["--kill"] if kill else [])
            return subprocess.Popen(
                argv, env=_env(), stdout=subprocess.DEVNULL, stderr=open(out / f"r{replica}.err", "a")
            )

        procs = {r: start(r) for r in (0, 1)}
        deadline = time.monotonic() + 600
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            for r, p in list(procs.items()):
                if p.poll() is not None and p.returncode == -signal.SIGKILL:
                    procs[r] = start(r)  # restarted at once, as its launcher would
            time.sleep(0.05)
        for r, p in procs.items():
            if p.poll() is None:
                p.kill()
                raise RuntimeError(f"torchft replica {r} did not finish: {(out / f'r{r}.err').read_text()[-3000:]}")
            if p.returncode != 0:
                raise RuntimeError(f"torchft replica {r} failed: {(out / f'r{r}.err').read_text()[-3000:]}")
    finally:
        lighthouse.shutdown()


def recovery(out: Path, who: str, survivor: str) -> dict:
    killed = json.load(open(out / f"killed-{who}.json"))
    after = [r for r in _steps(out, who) if r["t"] > killed["t"]]
    steps = [r["step"] for r in _steps(out, who)]
    # the survivor's own steps before the one the restarted process joins it at (that step they take together, and the
    # survivor may log it a moment first)
    survivor_during = [
        r for r in _steps(out, survivor) if killed["t"] < r["t"] < after[0]["t"] and r["step"] < after[0]["step"]
    ]
    return {
        "killed_after_step": killed["step"],
        "first_step_after": after[0]["step"],
        "seconds_to_first_step": after[0]["t"] - killed["t"],
        "steps_redone": len(steps) - len(set(steps)),
        "survivor_steps_meanwhile": len(survivor_during),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", choices=["ddp", "torchft"])
    parser.add_argument("--out")
    parser.add_argument("--snapshots", action="store_true")
    parser.add_argument("--kill", action="store_true")
    parser.add_argument("--replica", type=int, default=0)
    parser.add_argument("--lighthouse")
    parser.add_argument("--name", default="torchft_compare", help="the results' file name under benchmarks/results/")
    args = parser.parse_args()
    if args.worker == "ddp":
        return ddp_worker(Path(args.out), args.snapshots, args.kill)
    if args.worker == "torchft":
        return torchft_worker(Path(args.out), args.replica, args.lighthouse, args.kill)

    from importlib.metadata import version

    torchft_version = version("torchft")
    raw, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name in ("ddp", "ours", "torchft", "ours-kill", "torchft-kill"):
            out = tmp / name
            out.mkdir()
            if name.startswith("torchft"):
                run_torchft(out, kill=name.endswith("kill"))
            else:
                run_torchrun(out, snapshots=name != "ddp", kill=name.endswith("kill"))
            first = "replica0" if name.startswith("torchft") else "rank0"
            raw[name] = {"median_step_s": _median_step(_steps(out, first))}
            if name.endswith("kill"):
                who, survivor = ("replica1", "replica0") if name.startswith("torchft") else ("rank1", "rank0")
                raw[name]["recovery"] = recovery(out, who, survivor)
            print(name, raw[name], flush=True)
    base = raw["ddp"]["median_step_s"]
    for name, label in (
        ("ddp", "DDP, no fault tolerance"),
        ("ours", "hf_dtrain snapshots (every step, parity 1)"),
        ("torchft", f"torchft {torchft_version} (Manager, 2 replica groups)"),
    ):
        kill = raw.get(f"{name}-kill", {}).get("recovery")
        rows.append(
            {
                "system": label,
                "step_ms": raw[name]["median_step_s"] * 1e3,
                "overhead": raw[name]["median_step_s"] / base - 1,
                "recovery_s": None if kill is None else kill["seconds_to_first_step"],
                "redone": None if kill is None else kill["steps_redone"],
                "meanwhile": None if kill is None else kill["survivor_steps_meanwhile"],
            }
        )
    columns = [
        ("system", "system", ""),
        ("step_ms", "median step (ms)", ".1f"),
        ("overhead", "over DDP", "+.1%"),
        ("recovery_s", f"kill after step {KILL_AT} to the restarted process's first step (s)", ".2f"),
        ("redone", "steps redone", "d"),
        ("meanwhile", "survivor's steps meanwhile", "d"),
    ]
    notes = (
        "Same model, batch, optimizer and machine for all three; step times from each run's rank 0 (replica 0), "
        f"median over steps {WARMUP + 2}..{STEPS}. Recovery: hf_dtrain restarts every rank (torchrun --max-restarts) "
        "and resumes at the killed step from the snapshot processes, so no step is redone and the survivor waits; "
        "torchft keeps the surviving replica training while the restarted one starts, joins a quorum and fetches the "
        "state from it over HTTP. Both include a new Python process's start (imports, model build). torchft replicas "
        "train on different data here (replica id seeds the batch), as replica groups do."
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    a.bar([r["system"].split(" (")[0] for r in rows], [r["step_ms"] for r in rows])
    a.set_ylabel("median step (ms)")
    kills = [r for r in rows if r["recovery_s"] is not None]
    b.bar([r["system"].split(" (")[0] for r in kills], [r["recovery_s"] for r in kills])
    b.set_ylabel("kill to first step after (s)")
    paths = write(args.name, {"rows": rows, "raw": raw}, markdown_table(rows, columns), fig, notes)
    print(paths["md"].read_text())


if __name__ == "__main__":
    main()
