"""Asynchronous gossip under a straggler, on emulated hosts: all-reduce SGD (DDP), synchronous D-PSGD and DecentLaM
(ring), and their asynchronous forms (AD-PSGD-style, bounded staleness), 4 hosts, one of them 3x slower.

Each rank runs in its own network namespace (veth + ``tc tbf`` at ``--links``); full fine-tuning of the embedded
default model on the addition task, batch 16 per rank, SGD momentum 0.9 at lr 0.01 for every method. Rank 3 sleeps 2x
its compute time after each forward (3x slower). Every rank takes ``--steps`` steps; an asynchronous fast rank gets
there sooner and then waits in ``finish()`` for its neighbours. Loss: each rank's training loss, trailing mean of 20
steps; the run's loss at time t is the mean over ranks of each rank's latest value. Target: all-reduce SGD's final
loss under the straggler (same link and seed) x ``--target-factor``. Reports the time to the target as a ratio to
all-reduce's, median and range over seeds, and what the staleness bound did (waits, oldest value mixed).

    python benchmarks/async_gossip.py                     # about 20 minutes on 2 CPU cores
    python benchmarks/async_gossip.py --seeds 0 --steps 60 --links loopback
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit_result, parse_result

METHODS = ["allreduce", "dpsgd", "decentlam", "async_dpsgd", "async_decentlam"]
WORLD, SLOW_RANK, SLOWDOWN, LR, STALENESS = 4, 3, 3.0, 0.01, 4
SMOOTH = 20


def worker(rank, world, addr, port, method, steps, batch, seed):
    from hf_dtrain.testing import gloo_group

    with gloo_group(rank, world, addr, port, timeout_s=600):
        return _train(rank, world, method, steps, batch, seed)


def _train(rank, world, method, steps, batch, seed):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    from hf_dtrain import tasks
    from hf_dtrain.comm import register
    from hf_dtrain.decentralized import DPSGD, DecentLaM, Straggler
    from hf_dtrain.models import load_model_and_tokenizer

    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(None, progress=False)
    asynchronous = method.startswith("async_")
    ddp = DDP(model, broadcast_buffers=not asynchronous)
    if method == "allreduce":
        opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    else:
        register(ddp, "noop")
        if method.endswith("dpsgd"):
            opt = DPSGD(
                ddp.parameters(),
                topology="ring",
                lr=LR,
                momentum=0.9,
                asynchronous=asynchronous,
                max_staleness=STALENESS,
            )
        else:
            opt = DecentLaM(
                ddp.parameters(),
                lr=LR,
                momentum=0.9,
                topology="ring",
                asynchronous=asynchronous,
                max_staleness=STALENESS,
            )
    straggler = Straggler({SLOW_RANK: SLOWDOWN}, rank=rank)
    data = tasks.make_task_dataset(tok, steps * batch, seed=100 + rank + 1000 * seed, split="train")
    loader = DataLoader(data, batch_size=batch, collate_fn=tasks.task_collator(tok))
    losses, times = [], []
    dist.barrier()
    t0 = time.perf_counter()
    for full in loader:
        start = time.perf_counter()
        loss = ddp(**full).loss
        straggler.after_compute(3 * (time.perf_counter() - start))  # forward + backward ~ 3 forwards
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    done_at = time.perf_counter() - t0
    info = {}
    if asynchronous:
        eng = opt._async
        info = {"waits": eng.waits, "max_staleness_seen": eng.max_seen_staleness, "replaced_sends": eng.replaced_sends}
        opt.finish()
    gathered = [None] * world
    dist.all_gather_object(gathered, {"losses": losses, "times": times, "done_at": done_at, **info})
    sent = list(getattr(opt, "stats", None).steps) if hasattr(opt, "stats") else []
    return {
        "method": method,
        "seed": seed,
        "ranks": gathered,
        "bytes_per_step": (sum(sent) / len(sent)) if sent else sum(p.numel() * 4 for p in model.parameters()),
    }


def run(link, method, steps, batch, seed):
    from hf_dtrain.testing import free_port
    from hf_dtrain.testing.netns import available, emulated_hosts, run_on_hosts, run_ranks

    port = str(free_port())

    def argv(rank, hosts):
        addr = hosts[0].address if hosts else "127.0.0.1"
        return [
            sys.executable,
            __file__,
            "--worker",
            f"{rank}:{WORLD}:{addr}:{port}:{method}",
            "--steps",
            str(steps),
            "--batch-size",
            str(batch),
            "--seed",
            str(seed),
        ]

    env = dict(os.environ, OMP_NUM_THREADS="1")
    ok, why = available() if link != "loopback" else (False, "asked for loopback")
    if ok:
        with emulated_hosts(WORLD, rate=link) as hosts:
            outs = run_on_hosts(hosts, argv, timeout=3600, env={"OMP_NUM_THREADS": "1"})
        where = f"{WORLD} network namespaces, veth + tc tbf {link} each way"
    else:
        outs = run_ranks([argv(r, None) for r in range(WORLD)], [env] * WORLD, timeout=3600)
        where = f"loopback ({why})"
    return dict(parse_result(outs[0]), link=link, network=where)


def curve(run, full_windows: bool = False):
    """(times, loss): at each time a rank logged a step, the mean over ranks of each rank's latest smoothed loss
    (``full_windows``: only once every rank has logged a whole window of steps)."""
    from _report import trailing_mean

    per = [(r["times"], trailing_mean(r["losses"], SMOOTH)) for r in run["ranks"]]
    events = sorted((t, k, i) for k, (ts, _) in enumerate(per) for i, t in enumerate(ts))
    latest, done = [None] * len(per), [0] * len(per)
    out_t, out_l = [], []
    for t, k, i in events:
        latest[k] = per[k][1][i]
        done[k] = i + 1
        if all(x is not None for x in latest) and (not full_windows or min(done) >= SMOOTH):
            out_t.append(t)
            out_l.append(sum(latest) / len(latest))
    return out_t, out_l


def to_target(run, target):
    """Seconds until the run's loss (every rank past a whole window) first reaches ``target``, else None."""
    for time_s, value in zip(*curve(run, full_windows=True)):
        if value <= target:
            return time_s
    return None


def main():
    import argparse

    from _report import rerender, write

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--links", default="1gbit")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--target-factor", type=float, default=1.02)
    ap.add_argument("--from-json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.from_json:
        rerender(args.from_json, "async_gossip", render)
        return
    if args.worker:
        rank, world, addr, port, method = args.worker.split(":")
        emit_result(worker(int(rank), int(world), addr, port, method, args.steps, args.batch_size, args.seed))
        return
    from tqdm import tqdm

    from hf_dtrain.models import build_default_model

    build_default_model("tiny", progress=True)
    runs, failures = [], []
    combos = [
        (l, s, m)
        for l in args.links.split(",")
        for s in map(int, args.seeds.split(","))
        for m in args.methods.split(",")
    ]
    for link, seed, method in tqdm(combos, desc="link x seed x method"):
        try:
            runs.append(run(link, method, args.steps, args.batch_size, seed))
        except (RuntimeError, TimeoutError) as e:
            print(f"{link} seed {seed} {method} failed: {e}", file=sys.stderr, flush=True)
            failures.append({"link": link, "seed": seed, "method": method, "error": str(e)[-3000:]})
    payload = {"runs": runs, "failures": failures, "args": vars(args)}
    table, fig, notes = render(payload)
    paths = write("async_gossip", payload, table, fig, notes)
    print(table)
    print("\n".join(str(p) for p in paths.values()))


def render(payload):
    runs, args = payload["runs"], payload["args"]
    rows = []
    for link in dict.fromkeys(r["link"] for r in runs):
        for method in dict.fromkeys(r["method"] for r in runs):
            per = []
            for r in (x for x in runs if x["link"] == link and x["method"] == method):
                ref = next(
                    (x for x in runs if x["link"] == link and x["method"] == "allreduce" and x["seed"] == r["seed"]),
                    None,
                )
                if ref is None:
                    continue
                target = curve(ref)[1][-1] * args["target_factor"]
                got, base = to_target(r, target), to_target(ref, target)
                per.append(
                    {
                        "seed": r["seed"],
                        "time": got,
                        "ratio": None if got is None else got / base,
                        "final": curve(r)[1][-1],
                        "fast_steps_per_s": statistics.mean(
                            len(x["times"]) / x["done_at"] for k, x in enumerate(r["ranks"]) if k != SLOW_RANK
                        ),
                        "waits": max((x.get("waits", 0) for x in r["ranks"]), default=0),
                        "stale": max((x.get("max_staleness_seen", 0) for x in r["ranks"]), default=0),
                        "bytes": r["bytes_per_step"],
                    }
                )
            if per:
                rows.append({"link": link, "method": method, "per": per})

    def cell(per, key, spec):
        vals = [p[key] for p in per]
        if any(v is None for v in vals):
            return f"not reached ({sum(v is None for v in vals)} of {len(vals)} seeds)"
        if len(vals) == 1:
            return format(vals[0], spec)
        return f"{statistics.median(vals):{spec}} ({min(vals):{spec}}-{max(vals):{spec}})"

    lines = [
        "| link | method | time to target (s) | time / all-reduce | final loss | fast ranks' steps per s | "
        "bytes per step per rank | staleness waits (max over ranks) | oldest value mixed (steps) |",
        "|" + "---|" * 9,
    ]
    for r in rows:
        p = r["per"]
        lines.append(
            f"| {r['link']} | {r['method']} | {cell(p, 'time', '.1f')} | {cell(p, 'ratio', '.2f')} | "
            f"{cell(p, 'final', '.3f')} | {cell(p, 'fast_steps_per_s', '.2f')} | {cell(p, 'bytes', '.0f')} | "
            f"{cell(p, 'waits', 'd')} | {cell(p, 'stale', 'd')} |"
        )
    for f in payload.get("failures", []):
        lines.append(
            f"| {f['link']} | {f['method']} (seed {f['seed']}) | failed: "
            f"{f['error'].strip().splitlines()[-1][:160]} |" + " |" * 6
        )
    table = "\n".join(lines)
    where = sorted({r["network"] for r in runs})
    notes = (
        f"Full fine-tuning of the embedded default model (tiny LLaMA) on the addition task, {WORLD} ranks "
        f"({'; '.join(where)}), {args['steps']} steps of batch {args['batch_size']} per rank, SGD momentum 0.9 "
        f"at lr {LR} for every method; rank {SLOW_RANK} computes {SLOWDOWN:g}x slower. D-PSGD and DecentLaM on "
        f"a ring, synchronous or asynchronous (AD-PSGD-style, max_staleness {STALENESS}); all-reduce SGD is DDP. "
        f"Loss at time t: mean over ranks of each rank's latest trailing mean of {SMOOTH} training losses. "
        f"Target: all-reduce SGD's final loss (same link, seed) x {args['target_factor']}. Median over seeds "
        f"{args['seeds']}, (min-max) in brackets. Bytes: each rank's payload per step (neighbour messages, or "
        "DDP's all-reduce payload)."
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(r["link"] for r in runs))
    fig, axes = plt.subplots(1, len(links), figsize=(7 * len(links), 4.5), squeeze=False)
    for ax, link in zip(axes[0], links):
        seed0 = min(r["seed"] for r in runs)
        for r in (x for x in runs if x["link"] == link and x["seed"] == seed0):
            t, loss = curve(r)
            ax.plot(t, loss, label=r["method"])
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel(f"training loss (mean over ranks, last {SMOOTH})")
        ax.set_title(f"{link}, rank {SLOW_RANK} {SLOWDOWN:g}x slower, seed {seed0}")
        ax.legend(fontsize=8)
    fig.suptitle("Asynchronous gossip under a straggler")
    return table, fig, notes


if __name__ == "__main__":
    main()
