"""The learning-rate sweep behind ``benchmarks/quantized_adapters.py``'s rates, as one command.

Each method (QLoRA, QA-LoRA, Q-BaRA, QA-HiRA) trains on one 4-bit base at each rate of a doubling grid, one fresh
process per (rate, method), with ``quantized_adapters.py``'s own worker (same data, schedule and evaluation). A
method stops climbing the grid once it has diverged: its held-out loss above 1.5x the best it reached at a lower
rate. The chosen rate is the lowest-loss one; of two within 2% of each other, the lower.

    python benchmarks/quantized_adapters_lr_sweep.py    # 500 steps, seed 0, hqq4 (about 15 min on 2 cores)
    python benchmarks/quantized_adapters_lr_sweep.py --from-json benchmarks/results/quantized_adapters_lr_sweep.json

Writes ``benchmarks/results/quantized_adapters_lr_sweep.{json,md,png}``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from _report import rerender, run_worker, write
from quantized_adapters import LR, METHODS
from tqdm import tqdm

from hf_dtrain.models import build_default_model

GRID = [2e-3, 4e-3, 1e-2, 2e-2, 4e-2, 8e-2, 1.6e-1]
DIVERGED = 1.5  # a loss above this times the method's best so far ends its climb
NEAR = 0.02  # two rates whose losses are within 2% count as equal; the lower rate is chosen


def chosen_rates(runs: list[dict]) -> dict[str, float]:
    out = {}
    for method in dict.fromkeys(r["method"] for r in runs):
        mine = sorted((r for r in runs if r["method"] == method), key=lambda r: r["lr"])
        best = min(r["eval_loss"] for r in mine)
        out[method] = next(r["lr"] for r in mine if r["eval_loss"] <= best * (1 + NEAR))
    return out


def render(payload: dict) -> tuple[str, object, str]:
    runs, methods = payload["runs"], payload["methods"]
    rates = sorted({r["lr"] for r in runs})
    cell = {(r["method"], r["lr"]): r for r in runs}
    lines = ["| learning rate | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for lr in rates:
        row = [f"{lr:g}"]
        for m in methods:
            r = cell.get((m, lr))
            row.append(f"{r['eval_loss']:.3f} / {r['eval_accuracy']:.3f}" if r else "-")
        lines.append("| " + " | ".join(row) + " |")
    chosen = payload["chosen"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for m in methods:
        mine = sorted((r for r in runs if r["method"] == m), key=lambda r: r["lr"])
        ax.plot(
            [r["lr"] for r in mine], [r["eval_loss"] for r in mine], marker="o", label=f"{m} (chosen {chosen[m]:g})"
        )
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("held-out loss")
    ax.set_title(
        f"{payload['args']['steps']} steps on the {payload['args']['base']} base, seed {payload['args']['seed']}"
    )
    ax.legend(fontsize=8)
    a = payload["args"]
    notes = (
        f"{a['steps']} AdamW steps of batch {a['batch_size']} on the {a['base']} base (embedded default model), seed "
        f"{a['seed']}, `benchmarks/quantized_adapters.py`'s worker otherwise. Cells: held-out loss / exact match on "
        f"its 500 held-out additions; `-`: not run, the method had diverged at a lower rate (loss above {DIVERGED}x "
        f"its best so far). Chosen (lowest loss; of two within {NEAR:.0%}, the lower rate): "
        + ", ".join(f"{m} {chosen[m]:g}" for m in methods)
        + ". `benchmarks/quantized_adapters.py` uses "
        + ", ".join(f"{m} {lr:g}" for m, lr in payload["benchmark_rates"].items())
        + "."
    )
    return "\n".join(lines), fig, notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base", default="hqq4", choices=["hqq4", "nf4"])
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--grid", default=",".join(f"{x:g}" for x in GRID), help="learning rates, lowest first")
    ap.add_argument("--name", default="quantized_adapters_lr_sweep")
    ap.add_argument("--from-json", metavar="PATH", help="only rebuild the table and plot from a results JSON")
    args = ap.parse_args()
    if args.from_json:
        rerender(args.from_json, args.name, render)
        return
    build_default_model("tiny", progress=True)  # built and cached once, before the workers
    methods = args.methods.split(",")
    grid = sorted(float(x) for x in args.grid.split(","))
    script = str(Path(__file__).with_name("quantized_adapters.py"))
    runs, stopped = [], set()
    for lr in tqdm(grid, desc="learning rates"):
        for method in methods:
            if method in stopped:
                continue
            argv = [
                "--worker",
                f"{args.base}:{method}",
                "--steps",
                str(args.steps),
                "--batch-size",
                str(args.batch_size),
            ]
            argv += ["--seed", str(args.seed), "--lr", f"{method}={lr}"]
            r = dict(run_worker(script, argv, timeout=3600, what=f"{method} at lr {lr:g}"), lr=lr)
            runs.append({k: r[k] for k in ("method", "lr", "eval_loss", "eval_accuracy", "train_loss_last50")})
            best = min(x["eval_loss"] for x in runs if x["method"] == method)
            if r["eval_loss"] > DIVERGED * best:
                stopped.add(method)
    payload = {
        "runs": runs,
        "methods": methods,
        "chosen": chosen_rates(runs),
        "benchmark_rates": {m: LR[m] for m in methods},
        "args": {"steps": args.steps, "batch_size": args.batch_size, "seed": args.seed, "base": args.base},
    }
    table, fig, notes = render(payload)
    for path in write(args.name, payload, table, fig, notes).values():
        print("wrote", path)


if __name__ == "__main__":
    main()
