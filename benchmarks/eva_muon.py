"""Eva against what a 2026 user picks instead: AdamW, ``torch.optim.Muon`` (torch >= 2.9) and SOAP
(``pytorch_optimizer.SOAP``, if that package is installed; it is not a dependency), on the default model.

Full fine-tuning of the embedded default model (tiny LLaMA) on the addition task, one process, the same data order for
every optimizer within a seed. Every optimizer's learning rate is tuned on the same grid (``--lrs``): the best is the
one with the lowest final smoothed loss averaged over the seeds. Muon updates the hidden 2-D matrices (the recipe of
its authors and of torch's docs) with ``adjust_lr_fn="match_rms_adamw"``, so its learning rate is on AdamW's scale
and the grid means the same for both; the embeddings, the output projection and the norms go to AdamW at the same
learning rate. Eva wraps AdamW (damping 1e-6: at the paper's 0.03 the rank-one term vanishes on this model and Eva
is AdamW; see docs/optim.md). At each optimizer's best learning rate: steps and seconds to the target (the best
AdamW's final smoothed loss x ``--target-factor``, per seed), as ratios to AdamW's, median and range over seeds.

    python benchmarks/eva_muon.py                     # about 15 minutes on 2 CPU cores
    python benchmarks/eva_muon.py --seeds 0 --lrs 3e-4,1e-3 --steps 200
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

OPTIMIZERS = ["adamw", "muon", "eva", "soap"]
SMOOTH = 20


def _muon(model, lr):
    import torch

    hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n and "lm_head" not in n]
    ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in ids]

    class MuonWithAdamW(torch.optim.Optimizer):
        """Muon on the hidden matrices, AdamW on the rest, stepped together (one optimizer for the loop)."""

        def __init__(self):
            self.parts = [
                torch.optim.Muon(hidden, lr=lr, weight_decay=0.0, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(rest, lr=lr, weight_decay=0.0),
            ]
            self.param_groups = [g for part in self.parts for g in part.param_groups]
            self.state = {}
            self.defaults = {}

        def step(self, closure=None):
            for part in self.parts:
                part.step()

        def zero_grad(self, set_to_none=True):
            for part in self.parts:
                part.zero_grad(set_to_none=set_to_none)

    return MuonWithAdamW()


def run_one(name: str, lr: float, seed: int, steps: int, batch: int) -> dict:
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
    if name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    elif name == "muon":
        opt = _muon(model, lr)
    elif name == "eva":
        opt = Eva(model.parameters(), model=model, base_optimizer="adamw", lr=lr, weight_decay=0.0, damping=1e-6)
    else:
        from pytorch_optimizer import SOAP

        opt = SOAP(model.parameters(), lr=lr, weight_decay=0.0)
    times: list[float] = []
    losses = train_on_loader(model, opt, loader, times)
    return {"optimizer": name, "lr": lr, "seed": seed, "losses": losses, "times": times}


def main():
    import argparse

    from _report import rerender, write

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--lrs", default="1e-4,3e-4,1e-3,3e-3", help="the learning-rate grid of every optimizer")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--target-factor", type=float, default=1.05)
    ap.add_argument("--from-json", metavar="PATH")
    args = ap.parse_args()
    if args.from_json:
        rerender(args.from_json, "eva_muon", render)
        return
    from tqdm import tqdm

    from hf_dtrain.models import build_default_model

    build_default_model("tiny", progress=True)
    names = args.optimizers.split(",")
    skipped = {}
    if "soap" in names:
        try:
            import pytorch_optimizer  # noqa: F401
        except ImportError:
            names.remove("soap")
            skipped["soap"] = "pytorch_optimizer is not installed (pip install pytorch_optimizer)"
    lrs = [float(x) for x in args.lrs.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    runs = []
    for name, lr, seed in tqdm([(n, lr, s) for n in names for lr in lrs for s in seeds], desc="optimizer x lr x seed"):
        runs.append(run_one(name, lr, seed, args.steps, args.batch_size))
    payload = {"runs": runs, "args": vars(args), "skipped": skipped}
    table, fig, notes = render(payload)
    paths = write("eva_muon", payload, table, fig, notes)
    print(table)
    print("\n".join(str(p) for p in paths.values()))


def render(payload: dict):
    from _report import trailing_mean

    runs, args = payload["runs"], payload["args"]
    for r in runs:
        r["smoothed"] = trailing_mean(r["losses"], SMOOTH)
        r["final"] = r["smoothed"][-1]
    names = list(dict.fromkeys(r["optimizer"] for r in runs))
    lrs = sorted({r["lr"] for r in runs})
    seeds = sorted({r["seed"] for r in runs})
    mean_final = {
        (n, lr): statistics.mean(r["final"] for r in runs if r["optimizer"] == n and r["lr"] == lr)
        for n in names
        for lr in lrs
        if any(r["optimizer"] == n and r["lr"] == lr for r in runs)
    }
    best = {n: min((lr for (m, lr) in mean_final if m == n), key=lambda lr: mean_final[(n, lr)]) for n in names}

    def pick(n, seed):
        return next(r for r in runs if r["optimizer"] == n and r["lr"] == best[n] and r["seed"] == seed)

    def first(r, target):
        return next((i for i, x in enumerate(r["smoothed"]) if i + 1 >= SMOOTH and x <= target), None)

    rows = []
    for n in names:
        per = []
        for seed in seeds:
            ref = pick("adamw", seed)
            target = ref["final"] * args["target_factor"]
            r, i, j = pick(n, seed), None, None
            i, j = first(r, target), first(ref, target)
            per.append(
                {
                    "seed": seed,
                    "final": r["final"],
                    "steps": None if i is None else i + 1,
                    "steps_vs": None if i is None else (i + 1) / (j + 1),
                    "time_vs": None if i is None else r["times"][i] / ref["times"][j],
                    "sec_per_step": r["times"][-1] / len(r["times"]),
                }
            )
        rows.append({"optimizer": n, "lr": best[n], "per_seed": per})

    def cell(per, key, spec):
        vals = [p[key] for p in per]
        if any(v is None for v in vals):
            got = [v for v in vals if v is not None]
            return f"not reached ({len(vals) - len(got)} of {len(vals)} seeds)" + (
                f"; reached: {statistics.median(got):{spec}}" if got else ""
            )
        if len(vals) == 1:
            return format(vals[0], spec)
        return f"{statistics.median(vals):{spec}} ({min(vals):{spec}}-{max(vals):{spec}})"

    lines = [
        "| optimizer | best lr (grid " + ", ".join(f"{x:g}" for x in lrs) + ") | final loss | steps to target | "
        "steps / AdamW | time to target / AdamW | seconds per step |",
        "|" + "---|" * 7,
    ]
    for row in rows:
        p = row["per_seed"]
        lines.append(
            f"| {row['optimizer']} | {row['lr']:g} | {cell(p, 'final', '.3f')} | {cell(p, 'steps', 'd')} | "
            f"{cell(p, 'steps_vs', '.2f')} | {cell(p, 'time_vs', '.2f')} | {cell(p, 'sec_per_step', '.3f')} |"
        )
    lines += [
        "",
        "### The grid (final smoothed loss, mean over seeds)",
        "",
        "| optimizer | " + " | ".join(f"lr {x:g}" for x in lrs) + " |",
        "|" + "---|" * (len(lrs) + 1),
    ]
    for n in names:
        lines.append(
            f"| {n} | "
            + " | ".join(f"{mean_final[(n, lr)]:.3f}" if (n, lr) in mean_final else "n/a" for lr in lrs)
            + " |"
        )
    for n, why in payload.get("skipped", {}).items():
        lines.append(f"\n{n}: skipped, {why}.")
    table = "\n".join(lines)
    notes = (
        f"Full fine-tuning of the embedded default model (tiny LLaMA, 3.1M parameters) on the addition task, "
        f"{args['steps']} steps of batch {args['batch_size']}, one process; seeds {args['seeds']} (data order and "
        "initial draw); median over seeds, (min-max) in brackets. Every optimizer's learning rate from the same "
        "grid; best = lowest final smoothed loss (mean of the last 20 steps) averaged over the seeds. Weight "
        "decay 0 for all. Muon: torch.optim.Muon on the hidden 2-D matrices with adjust_lr_fn=match_rms_adamw "
        "(AdamW's learning-rate scale), AdamW on embeddings, output projection and norms. Eva: on AdamW, damping "
        "1e-6, KL clip 0.001, decay 0.95. SOAP: pytorch_optimizer.SOAP defaults (betas 0.95, 0.95, "
        "preconditioning every 10 steps) with the grid's lr. Target: the best AdamW's final smoothed loss x "
        f"{args['target_factor']}, per seed; steps and seconds to it as ratios to AdamW's in the same seed."
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for n in names:
        for k, seed in enumerate(seeds):
            r = pick(n, seed)
            color = f"C{names.index(n)}"
            axes[0].plot(
                range(1, len(r["smoothed"]) + 1),
                r["smoothed"],
                color=color,
                alpha=0.8,
                label=f"{n} (lr {best[n]:g})" if k == 0 else None,
            )
            axes[1].plot(r["times"], r["smoothed"], color=color, alpha=0.8, label=n if k == 0 else None)
    for ax, xlabel in zip(axes, ["step", "wall time (s)"]):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"training loss (mean of last {SMOOTH})")
    axes[0].legend()
    fig.suptitle("Eva, Muon, SOAP and AdamW at their best learning rate, every seed")
    return table, fig, notes


if __name__ == "__main__":
    main()
