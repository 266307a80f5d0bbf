"""In-memory snapshots against the checkpoints users have today, on the default LLaMA ("tiny") and a larger shape
("small"), full training with AdamW (model + optimizer + scheduler + RNG state):

* **stall per snapshot**: how long the training loop is blocked by one snapshot/checkpoint. Ours: the
  ``snapshot()`` call plus the ``wait()`` before the next optimizer step; ``torch.save``: the whole save;
  DCP ``async_save``: the call (staging to host memory) plus waiting on the previous save; the HF Trainer's
  ``save_steps``: its ``_save_checkpoint``;
* **per-step overhead against the interval** (every 1, 5 and 20 steps): median step time over no saving;
* **recovery**: a fresh process restoring from the snapshot process against ``torch.load`` of the checkpoint; and,
  with 3 gloo ranks on emulated nodes, the restore after a killed trainer and after a lost node (rebuilt from the
  peers' parity), with the steps lost in each.

Each configuration runs in a fresh process on this 2-core host; batch 8 x 256 tokens. JSON, markdown and a PNG
(overhead against interval, stall per method) under ``benchmarks/results/``.

    python benchmarks/fault_tolerance.py        # about 10 minutes on 2 CPU cores
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import itertools

from _report import emit_result, run_worker

ROOT = Path(__file__).resolve().parent.parent

PRESETS = {"tiny": {"steps": 24, "intervals": [1, 5, 20]}, "small": {"steps": 11, "intervals": [1, 5]}}
BATCH, SEQ = 8, 256
METHODS = ["ours", "torch_save", "dcp_async", "trainer"]
RESULTS_PARTIAL = Path(tempfile.gettempdir()) / "hf_dtrain_fault_tolerance_partial.json"


def _state(model, opt, sched):
    import random

    import numpy as np
    import torch

    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": {
            "python": random.getstate(),
            "numpy": torch.from_numpy(np.random.get_state()[1].copy()),
            "torch": torch.get_rng_state(),
        },
    }  # loadable with torch.load(weights_only=True)


def worker(preset: str, method: str, interval: int, steps: int) -> dict:
    """One configuration: ``steps`` timed training steps (after a warm-up step) saving every ``interval``."""
    import statistics

    import torch

    from hf_dtrain.models import build_llama
    from hf_dtrain.testing import random_batch

    tmp = tempfile.mkdtemp(prefix="hf_dtrain_bench_")
    if method == "trainer":
        return trainer_worker(preset, interval, steps, tmp)
    torch.manual_seed(0)
    model = build_llama(preset, seed=0)
    vocab = model.config.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
    stalls, times = [], []
    engine, future = None, None
    if method == "ours":
        from hf_dtrain.fault import SnapshotEngine

        engine = SnapshotEngine(model, opt, sched, directory=os.path.join(tmp, "ft"), parity=0)
    pending_stall = 0.0
    for step in range(steps + 1):
        b = random_batch(batch=BATCH, seq=SEQ, vocab=vocab, seed=step)
        t0 = time.perf_counter()
        loss = model(**b).loss
        loss.backward()
        if engine is not None:
            w = time.perf_counter()
            engine.wait()
            pending_stall += time.perf_counter() - w
        opt.step()
        sched.step()
        opt.zero_grad()
        if step and step % interval == 0 and method != "none":
            s = time.perf_counter()
            if method == "ours":
                engine.snapshot(step)
            elif method == "torch_save":
                torch.save(_state(model, opt, sched), os.path.join(tmp, "ckpt.pt"))
            elif method == "dcp_async":
                import torch.distributed.checkpoint as dcp

                if future is not None:
                    future.result()  # one save in flight at a time (DCP's own rule)
                future = dcp.async_save(
                    {"model": model.state_dict(), "optimizer": opt.state_dict()},
                    checkpoint_id=os.path.join(tmp, f"dcp{step}"),
                )
            stall = time.perf_counter() - s
            if step > interval:  # the first save also allocates (our slot, DCP's staging); steady state after
                stalls.append(stall + pending_stall)
            pending_stall = 0.0
        if step:
            times.append(time.perf_counter() - t0)
    row = {
        "preset": preset,
        "method": method,
        "interval": interval,
        "step_seconds": statistics.median(times),
        "mean_step_seconds": statistics.mean(times),
        "stall_seconds": statistics.median(stalls) if stalls else None,
    }
    if engine is not None:
        row["snapshot_bytes"] = engine.stats["bytes"]
        row["copy_seconds"] = statistics.median(engine.stats["copy_seconds"][1:] or engine.stats["copy_seconds"])
        engine.wait()
        # recovery in a fresh process: restore from the snapshot process, against torch.load of a checkpoint
        torch.save(_state(model, opt, sched), os.path.join(tmp, "ckpt.pt"))
        engine.close()
        row["restore_seconds"] = _run(["--restore", f"{preset}:{tmp}"])
        _stop_snapshot_processes(os.path.join(tmp, "ft"))
    if future is not None:
        future.result()
    return row


def _stop_snapshot_processes(ft_dir: str) -> None:
    import signal

    for node in os.listdir(ft_dir):
        info = os.path.join(ft_dir, node, "smp.json")
        if os.path.exists(info):
            os.kill(json.load(open(info))["pid"], signal.SIGTERM)


def restore_worker(preset: str, tmp: str) -> dict:
    import torch

    from hf_dtrain.fault import SnapshotEngine
    from hf_dtrain.models import build_llama

    model = build_llama(preset, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
    engine = SnapshotEngine(model, opt, sched, directory=os.path.join(tmp, "ft"), parity=0)
    t0 = time.perf_counter()
    restored = engine.restore()
    ours = time.perf_counter() - t0
    assert restored is not None and restored.source == "memory"
    t0 = time.perf_counter()
    state = torch.load(os.path.join(tmp, "ckpt.pt"), weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    disk = time.perf_counter() - t0
    engine.close()
    return {"ours": ours, "torch_load": disk}


def trainer_worker(preset: str, interval: int, steps: int, tmp: str) -> dict:
    """The HF Trainer with ``save_steps=interval`` (``interval`` 0: no saving): median step time from the step
    callbacks, and the time of each ``_save_checkpoint``."""
    import statistics

    from datasets import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_dtrain.models import build_llama
    from hf_dtrain.testing import random_batch

    model = build_llama(preset, seed=0)
    rows = [
        {k: v[0].tolist() for k, v in random_batch(batch=1, seq=SEQ, vocab=model.config.vocab_size, seed=s).items()}
        for s in range(BATCH * (steps + 1))
    ]
    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            marks.append(time.perf_counter())

    args = TrainingArguments(
        output_dir=tmp,
        max_steps=steps + 1,
        per_device_train_batch_size=BATCH,
        report_to=[],
        use_cpu=True,
        logging_strategy="no",
        disable_tqdm=True,
        learning_rate=1e-4,
        save_strategy="steps" if interval else "no",
        save_steps=interval or 1,
        save_only_model=False,
        lr_scheduler_type="constant",
    )
    trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_list(rows), callbacks=[Clock()])
    saves = []
    real = trainer._save_checkpoint

    def timed(*a, **k):
        s = time.perf_counter()
        out = real(*a, **k)
        saves.append(time.perf_counter() - s)
        return out

    trainer._save_checkpoint = timed
    trainer.train()
    times = [b - a for a, b in itertools.pairwise(marks)]
    return {
        "preset": preset,
        "method": "trainer" if interval else "trainer_none",
        "interval": interval,
        "step_seconds": statistics.median(times),
        "mean_step_seconds": statistics.mean(times),
        "stall_seconds": statistics.median(saves[1:] or saves) if saves else None,
    }


def lost_node_runs() -> list[dict]:
    """The 3-rank fault runs of the test suite's worker, timed: a trainer killed, then a node lost."""
    import signal

    from hf_dtrain.testing import stop_snapshot_processes
    from hf_dtrain.testing.fault import kill_snapshot_process as _kill_smp
    from hf_dtrain.testing.fault import launch_ft_workers as _launch

    rows = []
    for name, fault, kill in [
        ("killed trainer", "1:12:after_snapshot", []),
        ("lost node (parity rebuild)", "1:12:after_snapshot", [1]),
    ]:
        tmp = Path(tempfile.mkdtemp(prefix="hf_dtrain_ft_bench_"))
        out, ft_dir = tmp / "out", tmp / "ft"
        out.mkdir()
        env = {"FT_OUT": str(out), "FT_DIR": str(ft_dir), "FT_FAULT": fault, "FT_STEPS": "16", "FT_TIME": "1"}
        try:
            codes = _launch(3, env)
            assert any(c == -signal.SIGKILL for c in codes), codes
            for node in kill:
                _kill_smp(str(ft_dir), node)
            env.pop("FT_FAULT")
            assert _launch(3, env) == [0, 0, 0]
        finally:
            stop_snapshot_processes(ft_dir)
        step, source, seconds = open(out / "rank1.restore").read().split()[:3]
        rows.append(
            {
                "case": name,
                "source": source,
                "restored_step": int(step),
                "failed_at_step": 12,
                "lost_steps": 12 - int(step),
                "restore_seconds": float(seconds),
            }
        )
    return rows


SHARDED_WORLDS = [1, 2, 4]
SHARDED_STEPS = 12


def _init_group(init_distributed) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    if not init_distributed():  # launched by elastic_launch (not under an agent's store): gloo from the environment
        dist.init_process_group("gloo", timeout=timedelta(seconds=300))


def sharded_worker(preset: str, steps: int, tmp: str) -> None:
    """One rank of an FSDP2 run (launched with ``WORLD_SIZE`` ranks, one emulated node each): ``steps`` timed steps
    without saving, then with our snapshot every step (parity on across nodes), then with DCP ``async_save`` of the
    same sharded state every step (one in flight, on a process group of its own, as DCP advises); then a final
    synchronous DCP save for the restart comparison. Rank 0 writes ``tmp/train.json``."""
    import statistics

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from hf_dtrain.distributed.groups import init_distributed
    from hf_dtrain.fault import SnapshotEngine
    from hf_dtrain.models import build_llama
    from hf_dtrain.parallel import apply_fsdp
    from hf_dtrain.testing import random_batch

    _init_group(init_distributed)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_llama(preset, seed=0)
    vocab = model.config.vocab_size
    apply_fsdp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
    dcp_group = dist.new_group(backend="gloo")
    engine = SnapshotEngine(
        model, opt, sched, directory=os.path.join(tmp, "ft"), parity=1 if world > 1 else 0, timeout=120
    )
    # the same without erasure coding: what the parity exchange between snapshot processes costs on shared cores
    plain = SnapshotEngine(model, opt, sched, directory=os.path.join(tmp, "ft_noparity"), parity=0, timeout=120)
    out: dict = {"world": world, "preset": preset}
    step = 0
    for method in ("none", "ours", "ours_noparity", "dcp_async"):
        snap = {"ours": engine, "ours_noparity": plain}.get(method)
        times, stalls, pending, future = [], [], 0.0, None
        for i in range(steps + 1):
            step += 1
            b = random_batch(batch=BATCH, seq=SEQ, vocab=vocab, seed=1000 * rank + step)
            dist.barrier()  # every rank's step starts together: the median is the job's step time
            t0 = time.perf_counter()
            model(**b).loss.backward()
            if snap is not None:
                w = time.perf_counter()
                snap.wait()
                pending += time.perf_counter() - w
            opt.step()
            sched.step()
            opt.zero_grad()
            s = time.perf_counter()
            if snap is not None:
                snap.snapshot(step)
            elif method == "dcp_async":
                if future is not None:
                    future.result()  # DCP's rule: one save in flight
                msd, osd = get_state_dict(model, opt)
                future = dcp.async_save(
                    {"model": msd, "optim": osd},
                    process_group=dcp_group,
                    checkpoint_id=os.path.join(tmp, f"dcp-async-{step % 2}"),
                )
            stall = time.perf_counter() - s
            if i:  # the first save allocates (our slot, DCP's staging); steady state after
                times.append(time.perf_counter() - t0)
                stalls.append(stall + pending)
            pending = 0.0
        if future is not None:
            future.result()
        out[method] = {"step_seconds": statistics.median(times)}
        if method != "none":
            out[method]["stall_seconds"] = statistics.median(stalls)
    engine.wait()
    out["snapshot_bytes_per_rank"] = engine.stats["bytes"]
    engine.close()  # the snapshot processes keep the snapshots: the restart reads them
    plain.close(shutdown=True)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(tmp, "dcp-final"))
    if rank == 0:
        Path(tmp, "train.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def sharded_restore_worker(preset: str, tmp: str) -> None:
    """One rank of the restart after a lost node: our restore (from the snapshot processes, the lost node's shards
    rebuilt from parity) against a DCP restart (``dcp.load`` of the same sharded state into a fresh model and
    optimizer), each the slowest rank's time. Rank 0 writes ``tmp/restore.json``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from hf_dtrain.distributed.groups import init_distributed
    from hf_dtrain.fault import SnapshotEngine
    from hf_dtrain.models import build_llama
    from hf_dtrain.parallel import apply_fsdp

    _init_group(init_distributed)
    world = dist.get_world_size()

    def fresh():
        model = build_llama(preset, seed=0)
        apply_fsdp(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    model, opt, sched = fresh()
    engine = SnapshotEngine(
        model, opt, sched, directory=os.path.join(tmp, "ft"), parity=1 if world > 1 else 0, timeout=120
    )
    dist.barrier()
    t0 = time.perf_counter()
    restored = engine.restore()
    ours = slowest(time.perf_counter() - t0)
    engine.close(shutdown=True)
    model, opt, sched = fresh()
    dist.barrier()
    t0 = time.perf_counter()
    msd, osd = get_state_dict(model, opt)  # the template DCP loads into (initialises the optimizer's state)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=os.path.join(tmp, "dcp-final"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    restart = slowest(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        Path(tmp, "restore.json").write_text(
            json.dumps({"ours": ours, "dcp_load": restart, "source": restored.source, "step": restored.step})
        )
    dist.barrier()
    dist.destroy_process_group()


def sharded_rows(preset: str = "tiny", worlds=SHARDED_WORLDS) -> list[dict]:
    """FSDP2 on 1, 2 and 4 gloo ranks (one emulated node each): the sharded snapshot against DCP ``async_save`` of
    the same state, then node 1 lost and the job restarted: our restore against a DCP restart."""
    from hf_dtrain.testing import elastic_launch, stop_snapshot_processes
    from hf_dtrain.testing.fault import kill_snapshot_process

    rows = []
    for world in worlds:
        tmp = tempfile.mkdtemp(prefix="hf_dtrain_sharded_ft_")
        ft_dir = os.path.join(tmp, "ft")
        argv = [sys.executable, __file__]
        try:
            codes = elastic_launch(
                [*argv, "--sharded-worker", f"{preset}:{SHARDED_STEPS}:{tmp}"], world, timeout=1800, log_dir=tmp
            )
            if codes != [0] * world:
                raise RuntimeError(
                    f"sharded worker failed {codes}: {open(os.path.join(tmp, 'rank0.out')).read()[-3000:]}"
                )
            if world > 1:
                kill_snapshot_process(ft_dir, 1)  # node 1 lost: its trainer is gone, and its snapshot process
            codes = elastic_launch([*argv, "--sharded-restore", f"{preset}:{tmp}"], world, timeout=1800, log_dir=tmp)
            if codes != [0] * world:
                raise RuntimeError(
                    f"restore worker failed {codes}: {open(os.path.join(tmp, 'rank0.out')).read()[-3000:]}"
                )
        finally:
            stop_snapshot_processes(ft_dir)
        row = json.loads(Path(tmp, "train.json").read_text())
        row["restore"] = json.loads(Path(tmp, "restore.json").read_text())
        rows.append(row)
        print(f"world {world}: {row}", flush=True)
    return rows


RESHARD_STEPS, RESHARD_EVERY = 10, 4  # trained steps; every 4th snapshot persisted (the last persisted is step 8)


def reshard_worker(preset: str, mode: str, tmp: str, directory: str) -> None:
    """One rank of the world-size change: ``train`` (2 ranks, FSDP2, a snapshot every step and every
    ``RESHARD_EVERY``-th persisted as a DCP copy, the snapshot processes kept), or ``restore`` (3 ranks, a fresh
    model and engine on snapshot directory ``directory``: the training run's, whose snapshot processes hold every
    old rank's newest snapshot, or a new one, so that only the persisted copy is there). Rank 0 writes
    ``tmp/<mode>-<directory>.json`` with the restore's source, step and the slowest rank's time."""
    import torch
    import torch.distributed as dist

    from hf_dtrain.distributed.groups import init_distributed
    from hf_dtrain.fault import SnapshotEngine
    from hf_dtrain.models import build_llama
    from hf_dtrain.parallel import apply_fsdp
    from hf_dtrain.testing import random_batch

    _init_group(init_distributed)
    model = build_llama(preset, seed=0)
    apply_fsdp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
    engine = SnapshotEngine(
        model,
        opt,
        sched,
        directory=os.path.join(tmp, directory),
        timeout=120,
        persist_dir=os.path.join(tmp, "disk"),
        persist_every=RESHARD_EVERY,
    )
    out: dict = {}
    if mode == "train":
        for step in range(1, RESHARD_STEPS + 1):
            b = random_batch(batch=BATCH, seq=SEQ, vocab=model.config.vocab_size, seed=1000 * dist.get_rank() + step)
            model(**b).loss.backward()
            engine.wait()
            opt.step()
            sched.step()
            opt.zero_grad()
            engine.snapshot(step, extra={"next_step": step + 1})
        engine.close()  # the snapshot processes keep the snapshots
    else:
        dist.barrier()
        t0 = time.perf_counter()
        restored = engine.restore()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out = {"source": restored.source, "step": restored.step, "seconds": float(t)}
        engine.close(shutdown=directory != "ft")
    if dist.get_rank() == 0:
        Path(tmp, f"{mode}-{directory}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def reshard_rows(preset: str = "tiny") -> list[dict]:
    """FSDP2 trained on 2 ranks (10 steps, every 4th snapshot persisted), restarted on 3: from the persisted DCP copy
    alone (new snapshot directory) against from the snapshot processes' copies (every old rank's snapshot of the
    newest step is held), each the slowest rank's restore time and the steps lost."""
    from hf_dtrain.testing import elastic_launch, stop_snapshot_processes

    tmp = tempfile.mkdtemp(prefix="hf_dtrain_reshard_")
    argv = [sys.executable, __file__, "--reshard-worker"]
    rows = []
    try:
        for world, mode, directory in ((2, "train", "ft"), (3, "restore", "ft_new"), (3, "restore", "ft")):
            codes = elastic_launch([*argv, f"{preset}:{mode}:{tmp}:{directory}"], world, timeout=1800, log_dir=tmp)
            if codes != [0] * world:
                raise RuntimeError(f"{mode} failed {codes}: {open(os.path.join(tmp, 'rank0.out')).read()[-3000:]}")
            if mode == "restore":
                r = json.loads(Path(tmp, f"restore-{directory}.json").read_text())
                rows.append(
                    {
                        "restart": "2 -> 3 ranks",
                        "from": {"ft": "the snapshot processes' copies (ours)", "ft_new": "the persisted DCP copy"}[
                            directory
                        ],
                        "source": r["source"],
                        "trained_to": RESHARD_STEPS,
                        "restored_step": r["step"],
                        "lost_steps": RESHARD_STEPS - r["step"],
                        "restore_seconds": r["seconds"],
                    }
                )
                print(rows[-1], flush=True)
    finally:
        for d in ("ft", "ft_new"):
            stop_snapshot_processes(os.path.join(tmp, d))
    return rows


def _run(argv: list[str]):
    env = dict(
        os.environ,
        OMP_NUM_THREADS="2",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    return run_worker(__file__, argv, env=env, timeout=1800)


def main():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--from-json")
    ap.add_argument("--worker")
    ap.add_argument("--restore")
    ap.add_argument("--sharded-worker")
    ap.add_argument("--sharded-restore")
    ap.add_argument("--reshard-worker")
    ap.add_argument(
        "--reshard",
        action="store_true",
        help="measure only the world-size change rows (FSDP2, 2 -> 3 ranks) and add them to the JSON",
    )
    ap.add_argument(
        "--recovery",
        action="store_true",
        help="measure only the 3-rank failure rows (a killed trainer, a lost node) into the JSON",
    )
    ap.add_argument(
        "--sharded",
        action="store_true",
        help="measure only the FSDP2 rows (1, 2 and 4 ranks) and add them to the existing JSON",
    )
    ap.add_argument(
        "--update-restore",
        action="store_true",
        help="re-measure only the restore rows (a fresh snapshot per preset) in the existing JSON",
    )
    args = ap.parse_args()
    if args.sharded_worker:
        preset, steps, tmp = args.sharded_worker.split(":", 2)
        sharded_worker(preset, int(steps), tmp)
        return
    if args.sharded_restore:
        preset, tmp = args.sharded_restore.split(":", 1)
        sharded_restore_worker(preset, tmp)
        return
    if args.reshard_worker:
        preset, mode, rest = args.reshard_worker.split(":", 2)
        tmp, directory = rest.rsplit(":", 1)
        reshard_worker(preset, mode, tmp, directory)
        return
    if args.reshard or args.sharded or args.recovery:  # one section re-measured, dated, into the existing JSON
        from _report import RESULTS, environment, write

        payload = json.loads((RESULTS / "fault_tolerance.json").read_text())
        env = payload.pop("environment")
        payload.pop("benchmark", None)
        key = "reshard" if args.reshard else "sharded" if args.sharded else "recovery"
        payload[key] = {"reshard": reshard_rows, "sharded": sharded_rows, "recovery": lost_node_runs}[key]()
        payload[f"{key}_environment"] = environment()
        payload[f"{key}_measured"] = payload[f"{key}_environment"]["date"]
        table, fig, notes = render(payload)
        write("fault_tolerance", payload, table, fig, notes, env=env)
        print(table)
        return
    if args.update_restore:
        from _report import RESULTS, write

        payload = json.loads((RESULTS / "fault_tolerance.json").read_text())
        env = payload.pop("environment")
        payload.pop("benchmark", None)
        for preset in args.presets.split(","):
            row = _run(["--worker", f"{preset}:ours:1"])
            for r in payload["rows"]:
                if r["preset"] == preset and r["method"] == "ours":
                    r["restore_seconds"] = row["restore_seconds"]
        from _report import environment

        payload["restore_environment"] = environment()
        payload["restore_remeasured"] = payload["restore_environment"]["date"]
        table, fig, notes = render(payload)
        write("fault_tolerance", payload, table, fig, notes, env=env)
        print(table)
        return
    if args.from_json:
        from _report import rerender

        rerender(args.from_json, "fault_tolerance", render)
        return
    if args.worker:
        preset, method, interval = args.worker.split(":")
        steps = max(PRESETS[preset]["steps"], 2 * int(interval) + 1)  # at least two saves: one after the first
        emit_result(worker(preset, method, int(interval), steps))
        return
    if args.restore:
        preset, tmp = args.restore.split(":", 1)
        emit_result(restore_worker(preset, tmp))
        return
    from tqdm import tqdm

    jobs = []
    for preset in args.presets.split(","):
        jobs.append((preset, "none", 1))
        jobs.append((preset, "trainer", 0))
        for interval in PRESETS[preset]["intervals"]:
            jobs += [(preset, m, interval) for m in METHODS]
    rows = []
    partial = RESULTS_PARTIAL
    for p, m, i in tqdm(jobs, desc="configurations"):
        rows.append(_run(["--worker", f"{p}:{m}:{i}"]))
        partial.write_text(json.dumps({"rows": rows}))  # measured rows survive a failure further on
    payload = {
        "rows": rows,
        "recovery": lost_node_runs(),
        "sharded": sharded_rows(),
        "reshard": reshard_rows(),
        "batch": BATCH,
        "seq": SEQ,
    }
    partial.write_text(json.dumps(payload))
    from _report import write

    table, fig, notes = render(payload)
    paths = write("fault_tolerance", payload, table, fig, notes)
    print(table)
    print("\n".join(str(p) for p in paths.values()))


def _section_environment(payload: dict, key: str) -> str:
    """The line under a section measured apart from the full run: its own environment, or, for a section measured
    before sections recorded theirs, what is known of it."""
    env = payload.get(f"{key}_environment")
    if env:
        return "\n\nEnvironment of this section: " + "; ".join(f"{k} {v}" for k, v in env.items()) + "."
    when = payload.get(f"{key}_measured") or payload.get(f"{key}_remeasured")
    if not when:
        return ""
    return (
        f"\n\nEnvironment of this section: not recorded with it (measured {when}, apart from the full run "
        "whose environment closes this file; same machine and torch). Sections measured later record theirs."
    )


def render(payload: dict):
    from _report import markdown_table

    rows = payload["rows"]
    for r in rows:
        base_method = "trainer_none" if r["method"] == "trainer" else "none"
        base = next(x for x in rows if x["preset"] == r["preset"] and x["method"] == base_method)
        r["overhead"] = r["step_seconds"] / base["step_seconds"] - 1
        r["mean_overhead"] = r["mean_step_seconds"] / base["mean_step_seconds"] - 1
        r["stall_ms"] = None if r["stall_seconds"] is None else 1000 * r["stall_seconds"]
        save = next(
            (
                x
                for x in rows
                if x["preset"] == r["preset"] and x["method"] == "torch_save" and x["interval"] == r["interval"]
            ),
            None,
        )
        r["stall_vs_save"] = (
            r["stall_seconds"] / save["stall_seconds"] if save and r["stall_seconds"] is not None else None
        )
        r["label"] = {
            "ours": "in-memory snapshot (ours)",
            "torch_save": "torch.save",
            "dcp_async": "DCP async_save",
            "trainer": "Trainer save_steps",
            "none": "no saving",
            "trainer_none": "Trainer, no saving",
        }[r["method"]]
        if "restore_seconds" in r:
            r["restore_ms"] = 1000 * r["restore_seconds"]["ours"]
            r["load_ms"] = 1000 * r["restore_seconds"]["torch_load"]
    shown = [r for r in rows if r["method"] not in ("none", "trainer_none")]
    table = markdown_table(
        shown,
        [
            ("preset", "model", ""),
            ("label", "method", ""),
            ("interval", "every N steps", ""),
            ("stall_ms", "stall per save (ms)", ".1f"),
            ("stall_vs_save", "stall / torch.save", ".3f"),
            ("overhead", "step-time overhead (median)", "+.1%"),
            ("mean_overhead", "step-time overhead (mean)", "+.1%"),
        ],
    )
    ours = [r for r in rows if r["method"] == "ours" and "restore_ms" in r and r["interval"] == 1]
    when = (
        f" (re-measured {payload['restore_remeasured']} after the restore path changed)"
        if payload.get("restore_remeasured")
        else ""
    )
    table += (
        f"\n\n### Restore in a fresh process (killed trainer, node alive){when}\n\n"
        + markdown_table(
            ours,
            [
                ("preset", "model", ""),
                ("snapshot_bytes", "snapshot bytes", ",d"),
                ("restore_ms", "from the snapshot process (ms)", ".0f"),
                ("load_ms", "torch.load of the checkpoint (ms)", ".0f"),
            ],
        )
        + _section_environment(payload, "restore")
    )
    when = f" (measured {payload['recovery_measured']})" if payload.get("recovery_measured") else ""
    table += (
        f"\n\n### Failures in a 3-rank run (test model, snapshot every step, one node per rank){when}\n\n"
        + markdown_table(
            payload["recovery"],
            [
                ("case", "failure", ""),
                ("source", "restored from", ""),
                ("failed_at_step", "failed after step", ""),
                ("restored_step", "restored step", ""),
                ("lost_steps", "steps lost", ""),
                ("restore_seconds", "restore time (s)", ".2f"),
            ],
        )
        + _section_environment(payload, "recovery")
    )
    if payload.get("sharded"):
        sharded = []
        for r in payload["sharded"]:
            base = r["none"]["step_seconds"]
            sharded.append(
                {
                    "world": r["world"],
                    "bytes": r["snapshot_bytes_per_rank"],
                    "bytes_ratio": r["snapshot_bytes_per_rank"] / payload["sharded"][0]["snapshot_bytes_per_rank"],
                    "ours_stall_ms": 1000 * r["ours"]["stall_seconds"],
                    "dcp_stall_ms": 1000 * r["dcp_async"]["stall_seconds"],
                    "stall_ratio": r["ours"]["stall_seconds"] / r["dcp_async"]["stall_seconds"],
                    "ours_overhead": r["ours"]["step_seconds"] / base - 1,
                    "noparity_overhead": r["ours_noparity"]["step_seconds"] / base - 1
                    if "ours_noparity" in r
                    else None,
                    "dcp_overhead": r["dcp_async"]["step_seconds"] / base - 1,
                    "restore_source": r["restore"]["source"],
                    "ours_restore_s": r["restore"]["ours"],
                    "dcp_restore_s": r["restore"]["dcp_load"],
                    "restore_ratio": r["restore"]["ours"] / r["restore"]["dcp_load"],
                }
            )
        when = f" (measured {payload['sharded_measured']})" if payload.get("sharded_measured") else ""
        table += (
            f"\n\n### FSDP2: sharded snapshots every step against DCP async_save of the same state{when}\n\n"
            + markdown_table(
                sharded,
                [
                    ("world", "ranks", ""),
                    ("bytes", "snapshot bytes per rank", ",d"),
                    ("bytes_ratio", "bytes / 1 rank", ".3f"),
                    ("ours_stall_ms", "stall, ours (ms)", ".1f"),
                    ("dcp_stall_ms", "stall, DCP async_save (ms)", ".1f"),
                    ("stall_ratio", "stall ratio", ".3f"),
                    ("ours_overhead", "step overhead, ours", "+.1%"),
                    ("noparity_overhead", "ours, parity off", "+.1%"),
                    ("dcp_overhead", "step overhead, DCP async", "+.1%"),
                    ("restore_source", "restored from", ""),
                    ("ours_restore_s", "restore, ours (s)", ".3f"),
                    ("dcp_restore_s", "restart, dcp.load (s)", ".3f"),
                    ("restore_ratio", "restore ratio", ".3f"),
                ],
            )
            + _section_environment(payload, "sharded")
        )
    if payload.get("reshard"):
        when = f" (measured {payload['reshard_measured']})" if payload.get("reshard_measured") else ""
        table += (
            f"\n\n### FSDP2 restarted on another world size: the survivors' in-memory snapshots against the "
            f"persisted DCP copy{when}\n\n"
            + markdown_table(
                payload["reshard"],
                [
                    ("restart", "restart", ""),
                    ("from", "restored from", ""),
                    ("source", "source", ""),
                    ("trained_to", "trained to step", ""),
                    ("restored_step", "restored step", ""),
                    ("lost_steps", "steps lost", ""),
                    ("restore_seconds", "restore time, slowest rank (s)", ".3f"),
                ],
            )
            + _section_environment(payload, "reshard")
        )
    notes = (
        f"Batch {payload['batch']} x {payload['seq']} tokens, AdamW, full training; each configuration in a fresh "
        "process on this 2-core CPU host; median over the timed steps after a warm-up step, the first save "
        "excluded from the stall (it allocates). Ours: a background thread copies into the snapshot process's "
        "memory and checksums (xxh3) while the next forward and backward run; the stall is what the loop "
        "waits for. torch.save and the Trainer write to local disk (page cache). DCP async_save stages to host "
        "memory and writes in a background thread; one save in flight. Erasure coding is off in the one-process "
        "rows (one node); the 3-rank rows have parity on. FSDP2 rows: the tiny model sharded on 1, 2 and 4 gloo "
        "ranks of this 2-core host (4 ranks oversubscribe it), one emulated node each, parity 1 above one rank; "
        "every rank's step starts at a barrier, so the median is the job's step time; 12 timed steps per "
        "method; the restart is node 1 lost (trainer and snapshot process) and every rank relaunched: ours "
        "rebuilds its shards from parity, the DCP restart loads the same state from local disk (page cache); "
        "each the slowest rank's time. World-size change rows: the tiny model on FSDP2, 2 ranks trained 10 "
        "steps with every 4th snapshot persisted, then restarted on 3 ranks (one emulated node each): once with "
        "a new snapshot directory (only the persisted copy of step 8 is there), once with the training run's "
        "(its snapshot processes hold both old ranks' snapshots of step 10, written once as a DCP checkpoint "
        "under the persist directory and loaded like the persisted copy)."
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = [p for p in PRESETS if any(r["preset"] == p for r in rows)]
    extra = 2 if payload.get("sharded") else 0
    fig, axes = plt.subplots(
        1, 2 * len(presets) + extra, figsize=(5.5 * (2 * len(presets) + extra), 4.4), squeeze=False
    )
    for i, preset in enumerate(presets):
        ax = axes[0][2 * i]
        for m in METHODS:
            pts = sorted(
                (r["interval"], 100 * r["overhead"]) for r in rows if r["preset"] == preset and r["method"] == m
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=next(r["label"] for r in rows if r["method"] == m))
        ax.set_xscale("log")
        ax.set_xlabel("save every N steps")
        ax.set_ylabel("step-time overhead (%)")
        ax.set_title(f"{preset}: overhead against the interval")
        ax.axhline(5, color="grey", ls=":", lw=1)
        ax.legend(fontsize=7)
        ax = axes[0][2 * i + 1]
        every1 = [
            r
            for r in rows
            if r["preset"] == preset
            and r["interval"] == min(PRESETS[preset]["intervals"])
            and r["stall_ms"] is not None
        ]
        ax.bar([r["label"].replace(" (ours)", "\n(ours)") for r in every1], [r["stall_ms"] for r in every1])
        ax.set_yscale("log")
        ax.set_ylabel("stall per save (ms, log)")
        ax.set_title(f"{preset}: training stall per save")
        ax.tick_params(axis="x", labelsize=7)
    if extra:
        import numpy as np

        sh = payload["sharded"]
        worlds = [r["world"] for r in sh]
        x = np.arange(len(worlds))
        ax = axes[0][-2]
        ax.bar(x - 0.2, [1000 * r["ours"]["stall_seconds"] for r in sh], 0.4, label="in-memory snapshot (ours)")
        ax.bar(x + 0.2, [1000 * r["dcp_async"]["stall_seconds"] for r in sh], 0.4, label="DCP async_save")
        ax.set_xticks(x, [f"{w} rank{'s' if w > 1 else ''}" for w in worlds])
        ax.set_ylabel("stall per save (ms)")
        ax.set_title("FSDP2 (tiny): stall per save, every step")
        ax.legend(fontsize=7)
        ax = axes[0][-1]
        ax.bar(x - 0.2, [r["restore"]["ours"] for r in sh], 0.4, label="ours (memory / parity rebuild)")
        ax.bar(x + 0.2, [r["restore"]["dcp_load"] for r in sh], 0.4, label="DCP restart (dcp.load)")
        ax.set_xticks(x, [f"{w}: {r['snapshot_bytes_per_rank'] / 1e6:.1f} MB/rank" for w, r in zip(worlds, sh)])
        ax.set_ylabel("restore (s, slowest rank)")
        ax.set_title("FSDP2: restore after node 1 is lost")
        ax.legend(fontsize=7)
    fig.suptitle("In-memory snapshots against checkpoints")
    fig.tight_layout()
    return table, fig, notes


if __name__ == "__main__":
    main()
