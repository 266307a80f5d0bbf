"""Optimizers on the default model: AdamW, SGD with momentum, Eva on SGD and on AdamW (one process each), and LAMB
against 1-bit LAMB with 2 gloo ranks on loopback.

Full fine-tuning of the embedded default model (tiny LLaMA) on the addition task, the same data order for every
method. Each one-process optimizer runs over a small grid of its hyperparameters (``GRID``: learning rates, and for
Eva the paper's damping against a small one) and is reported at its best configuration (lowest final loss); the
whole sweep is in a second table. Reports the training loss against steps and against wall time (PNG), the steps and
the time to a target loss as ratios to AdamW (the target: the best AdamW's final smoothed loss times
``--target-factor``), bytes per step for LAMB and 1-bit LAMB, and Eva's extra memory against the wrapped optimizer's
state.

    python benchmarks/optimizers.py                 # about 10 minutes on 2 CPU cores
    python benchmarks/optimizers.py --steps 200 --lr eva_sgd=0.05      # one configuration for that method
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit_result, parse_result

LR = {"adamw": 5e-4, "sgd": 0.01, "eva_sgd": 0.01, "eva_adamw": 5e-4, "lamb": 2e-3, "onebit_lamb": 2e-3}
# the one-process optimizers' sweeps: learning rates, and for Eva the paper's damping (0.03) against a small one (at
# 0.03 the rank-one term is negligible on this model: ‖ā‖²‖ḡ‖² is orders of magnitude below the damping), and for Eva
# on SGD the paper's KL clip against a tighter one (with the clip active the step length is sqrt(kl_clip / damping))
GRID = {
    "adamw": [{"lr": 3e-4}, {"lr": 5e-4}, {"lr": 1e-3}],
    "sgd": [{"lr": 1e-2}, {"lr": 3e-2}],
    "eva_sgd": [{"lr": 1e-2}, {"lr": 0.1, "kl_clip": 1e-5}],
    "eva_adamw": [{"lr": 3e-4}, {"lr": 5e-4}, {"lr": 3e-4, "damping": 1e-6}, {"lr": 5e-4, "damping": 1e-6}],
}
SINGLE = list(GRID)
SMOOTH = 20


def _state_bytes(opt) -> int:
    import torch

    total = 0
    for st in opt.state.values():
        total += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return total


def run_single(method: str, steps: int, batch: int, lr: float, eva_kwargs: dict | None = None, seed: int = 0) -> dict:
    import torch
    from torch.utils.data import DataLoader

    from hf_dtrain import tasks
    from hf_dtrain.models import load_model_and_tokenizer
    from hf_dtrain.optim import Eva
    from hf_dtrain.testing import train_on_loader

    torch.manual_seed(seed)
    model, tok = load_model_and_tokenizer(None, progress=False)
    data = tasks.make_task_dataset(tok, steps * batch, seed=100 + 1000 * seed, split="train")
    loader = DataLoader(data, batch_size=batch, collate_fn=tasks.task_collator(tok))
    if method == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
    elif method == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    elif method == "eva_sgd":
        opt = Eva(model.parameters(), model=model, base_optimizer="sgd", lr=lr, momentum=0.9, **(eva_kwargs or {}))
    else:
        opt = Eva(model.parameters(), model=model, base_optimizer="adamw", lr=lr, **(eva_kwargs or {}))
    times: list[float] = []
    losses = train_on_loader(model, opt, loader, times)
    row = {"method": method, "lr": lr, "losses": losses, "times": times}
    if isinstance(opt, Eva):
        row["eva_extra_bytes"] = opt.extra_memory_bytes()
        row["base_state_bytes"] = _state_bytes(opt.base)
    else:
        row["base_state_bytes"] = _state_bytes(opt)
    return row


def worker(rank: int, world: int, port: str, method: str, steps: int, batch: int, lr: float, freeze: int) -> dict:
    from hf_dtrain.testing import gloo_group

    with gloo_group(rank, world, port=port, timeout_s=300):  # DDP lives in _train_pair only: freed before the group
        return _train_pair(rank, world, method, steps, batch, lr, freeze)


def _train_pair(rank: int, world: int, method: str, steps: int, batch: int, lr: float, freeze: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    from hf_dtrain import tasks
    from hf_dtrain.models import load_model_and_tokenizer
    from hf_dtrain.optim import OneBitLamb
    from hf_dtrain.testing import train_on_loader

    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(None, progress=False)
    ddp = DDP(model)
    OneBitLamb.attach_ddp(ddp)
    # LAMB: the same optimizer that never reaches its compression stage (warm-up = LAMB over an fp32 all-reduce)
    opt = OneBitLamb(ddp.parameters(), lr=lr, freeze_step=freeze if method == "onebit_lamb" else steps + 1)
    data = tasks.make_task_dataset(tok, steps * batch, seed=100 + rank, split="train")
    times: list[float] = []
    losses = train_on_loader(ddp, opt, DataLoader(data, batch_size=batch, collate_fn=tasks.task_collator(tok)), times)
    # the loss of the global batch (both ranks) per step, in one all-reduce after the run (not a sync per step)
    mean = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean)
    return {
        "method": method,
        "lr": lr,
        "losses": (mean / world).tolist(),
        "times": times,
        "bytes_steps": list(opt.stats.steps),
    }


def run_pair(method: str, steps: int, batch: int, lr: float, freeze: int, world: int) -> dict:
    from hf_dtrain.testing import free_port
    from hf_dtrain.testing.netns import run_ranks

    port = str(free_port())
    argv = [
        [
            sys.executable,
            __file__,
            "--worker",
            f"{r}:{world}:{port}:{method}:{freeze}",
            "--steps",
            str(steps),
            "--batch-size",
            str(batch),
            "--lr",
            f"{method}={lr}",
        ]
        for r in range(world)
    ]
    outs = run_ranks(argv, [dict(os.environ)] * world, timeout=3600)
    return parse_result(outs[0])


def main():
    from _report import apply_lr_overrides, rerender, training_parser

    ap = training_parser(__doc__, LR)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--freeze-fraction", type=float, default=0.15, help="1-bit LAMB's LAMB warm-up, share of steps")
    ap.add_argument("--target-factor", type=float, default=1.05)
    ap.set_defaults(steps=400)
    args = ap.parse_args()
    apply_lr_overrides(args.lr, LR)
    for item in args.lr:  # an explicit learning rate replaces that method's sweep
        method = item.partition("=")[0]
        if method in GRID:
            GRID[method] = [{"lr": LR[method]}]
    if args.from_json:
        rerender(args.from_json, "optimizers", render)
        return
    if args.worker:
        rank, world, port, method, freeze = args.worker.split(":")
        emit_result(worker(int(rank), int(world), port, method, args.steps, args.batch_size, LR[method], int(freeze)))
        return
    from tqdm import tqdm

    from hf_dtrain.models import build_default_model

    build_default_model("tiny", progress=True)
    freeze = max(1, int(args.freeze_fraction * args.steps))
    runs = [(m, cfg) for m in SINGLE for cfg in GRID[m]] + [
        ("lamb", {"lr": LR["lamb"]}),
        ("onebit_lamb", {"lr": LR["onebit_lamb"]}),
    ]
    rows = []
    for method, cfg in tqdm(runs, desc="optimizers"):
        if method in SINGLE:
            extra = {k: v for k, v in cfg.items() if k != "lr"}
            row = run_single(method, args.steps, args.batch_size, cfg["lr"], extra)
        else:
            row = run_pair(method, args.steps, args.batch_size, cfg["lr"], freeze, args.world)
        row["config"] = cfg
        rows.append(row)
    payload = {"rows": rows, "args": vars(args), "freeze_step": freeze}
    from _report import write

    table, fig, notes = render(payload)
    paths = write("optimizers", payload, table, fig, notes)
    print(table)
    print("\n".join(str(p) for p in paths.values()))


def _first_below(smoothed: list[float], target: float):
    return next((i for i, x in enumerate(smoothed) if x <= target), None)


def _label(row: dict) -> str:
    cfg = row.get("config") or {"lr": row["lr"]}
    return ", ".join(f"{k} {v:g}" for k, v in cfg.items())


def render(payload: dict):
    from _report import markdown_table, summarize_curve

    rows, args = payload["rows"], payload["args"]
    for r in rows:
        summarize_curve(r, SMOOTH)
        r["label"] = _label(r)
    # each method at its best configuration (lowest final loss) in the main table; the sweep in the second
    best: dict[str, dict] = {}
    for r in rows:
        if r["method"] not in best or r["final"] < best[r["method"]]["final"]:
            best[r["method"]] = r
    chosen = list(best.values())
    adamw = best["adamw"]
    target = adamw["final"] * args["target_factor"]
    lamb = best.get("lamb")
    for r in rows:
        i = _first_below(r["smoothed"], target)
        r["steps_to_target"] = None if i is None else i + 1
        r["time_to_target"] = None if i is None else r["times"][i]
        r["steps_vs_adamw"] = None if i is None else r["steps_to_target"] / adamw["steps_to_target"]
        r["time_vs_adamw"] = None if i is None else r["time_to_target"] / adamw["time_to_target"]
        if "bytes_steps" in r:
            r["bytes_per_step"] = r["bytes_steps"][-1]
            r["bytes_vs_lamb"] = r["bytes_per_step"] / lamb["bytes_steps"][-1] if lamb else None
        if "eva_extra_bytes" in r:
            r["eva_extra_vs_state"] = r["eva_extra_bytes"] / max(1, r["base_state_bytes"])
    table = markdown_table(
        chosen,
        [
            ("method", "optimizer", ""),
            ("label", "best configuration", ""),
            ("final", "final loss (smoothed)", ".3f"),
            ("steps_to_target", "steps to target", ""),
            ("steps_vs_adamw", "steps / AdamW", ".2f"),
            ("time_to_target", "time to target (s)", ".1f"),
            ("time_vs_adamw", "time / AdamW", ".2f"),
            ("seconds", "total time (s)", ".1f"),
            ("bytes_per_step", "bytes per step (after warm-up)", ""),
            ("bytes_vs_lamb", "bytes / LAMB", ".4f"),
            ("eva_extra_bytes", "Eva extra memory (B)", ""),
            ("eva_extra_vs_state", "Eva extra / optimizer state", ".4f"),
        ],
    )
    sweep = [r for r in rows if r["method"] in SINGLE]
    if len(sweep) > len([m for m in SINGLE if m in best]):
        table += "\n\n### The sweep (one-process optimizers)\n\n" + markdown_table(
            sweep,
            [
                ("method", "optimizer", ""),
                ("label", "configuration", ""),
                ("final", "final loss (smoothed)", ".3f"),
                ("steps_to_target", "steps to target", ""),
                ("steps_vs_adamw", "steps / best AdamW", ".2f"),
            ],
        )
    notes = (
        f"Full fine-tuning of the embedded default model (tiny LLaMA) on the addition task, {args['steps']} steps "
        f"of batch {args['batch_size']}; one process for AdamW, SGD (momentum 0.9) and Eva (paper defaults "
        f"unless the configuration says otherwise: damping 0.03, KL clip 0.001, decay 0.95), each at the best "
        f"configuration of its sweep (lowest final loss); {args['world']} gloo ranks on loopback for LAMB and "
        f"1-bit LAMB (batch {args['batch_size']} per rank, LAMB warm-up {payload['freeze_step']} steps). Loss: "
        f"mean of the last {SMOOTH} training losses. Target loss: the best AdamW's final smoothed loss x "
        f"{args['target_factor']} = {target:.3f}. Empty cells: the target was not reached. Bytes: what each rank "
        "hands to collectives per step (hf_dtrain.distributed.WireStats)."
    )
    rows = chosen
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for r in rows:
        axes[0].plot(range(1, len(r["smoothed"]) + 1), r["smoothed"], label=f"{r['method']} ({r['label']})")
        axes[1].plot(r["times"], r["smoothed"], label=r["method"])
    for ax, xlabel in zip(axes, ["step", "wall time (s)"]):
        ax.axhline(target, color="gray", lw=0.8, ls="--")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"training loss (mean of last {SMOOTH})")
    axes[0].legend()
    fig.suptitle("Optimizers on the default model (dashed: target loss)")
    return table, fig, notes


if __name__ == "__main__":
    main()
