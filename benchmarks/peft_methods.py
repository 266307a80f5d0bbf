"""PEFT methods on the embedded default model, at matched trainable-parameter budgets.

Compares full fine-tuning, peft LoRA, peft DoRA, peft LoRA with peft's ``create_lorafa_optimizer``, hf_dtrain LoRA-FA
and hf_dtrain SMT. Each method runs in a fresh process (so its peak RSS is its own) with the same data order, the
same number of optimizer steps and AdamW. Reported per method: trainable parameters, bytes saved for backward
(counted with ``saved_tensors_hooks``, activations only, on the training batch and on a long-sequence probe batch),
optimizer-state bytes, peak RSS, median step time as a ratio to LoRA in the same run, eval loss and exact-match
accuracy on held-out additions.

    python benchmarks/peft_methods.py            # ~21 minutes on 2 idle CPU cores: 3 seeds x 6 methods
    python benchmarks/peft_methods.py --steps 50 # quick look
"""

from __future__ import annotations

import resource
import statistics
import sys
from pathlib import Path

from hf_dtrain import processes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit_result, parse_result, timed_steps

METHODS = ["full", "lora", "dora", "lora+peft_lorafa_opt", "lorafa", "smt"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The learning rates of `hf-dtrain finetune` (each method's registered default_lr), tuned on this task.
LR = {"full": 5e-4, "lora": 4e-3, "dora": 4e-3, "lora+peft_lorafa_opt": 4e-3, "lorafa": 4e-3, "smt": 2e-3}
RANK = 8
BLOCK = 64
SMT_WARMUP = 20


def _shapes(model):
    import torch

    return [
        (m.out_features, m.in_features)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in TARGETS
    ]


def build(method: str, model):
    """The model to train and its optimizer factory, at the LoRA r=8 budget on TARGETS."""
    from peft import LoraConfig, get_peft_model

    from hf_dtrain import LoraFAConfig, SMTConfig

    shapes = _shapes(model)
    budget = sum(RANK * (o + i) for o, i in shapes)
    if method == "full":
        return model, None
    if method in ("lora", "dora", "lora+peft_lorafa_opt"):
        cfg = LoraConfig(
            r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, use_dora=method == "dora", lora_dropout=0.0
        )
        return get_peft_model(model, cfg), None
    if method == "lorafa":
        # only B (out x r) trains: the rank that matches LoRA's budget is budget / sum(out)
        r = round(budget / sum(o for o, _ in shapes))
        return get_peft_model(model, LoraFAConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS, init_seed=0)), None
    if method == "smt":
        n = round(budget / BLOCK**2)
        return get_peft_model(
            model, SMTConfig(target_modules=TARGETS, block_size=BLOCK, num_blocks=n, warmup_steps=SMT_WARMUP)
        ), None
    raise ValueError(method)


def make_optimizer(method, model, lr):
    import torch

    if method == "lora+peft_lorafa_opt":
        from peft.optimizers import create_lorafa_optimizer

        return create_lorafa_optimizer(model, r=RANK, lora_alpha=2 * RANK, lr=lr)
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)


def worker(method: str, steps: int, batch_size: int, seed: int) -> dict:
    import torch
    from torch.utils.data import DataLoader
    from transformers import get_linear_schedule_with_warmup

    from hf_dtrain.models import load_model_and_tokenizer
    from hf_dtrain.tasks import exact_match, make_task_dataset, task_collator
    from hf_dtrain.testing import SavedTensorCounter
    from hf_dtrain.tuners.smt import smt_warmup

    torch.manual_seed(seed)
    base, tok = load_model_and_tokenizer(None, progress=False)
    collate = task_collator(tok)
    train = make_task_dataset(tok, steps * batch_size, seed=seed, split="train")
    evalset = make_task_dataset(tok, 500, seed=seed, split="eval")
    loader = DataLoader(train, batch_size=batch_size, shuffle=False, collate_fn=collate)
    model, _ = build(method, base)
    if method == "smt":  # scoring passes, not counted as training steps; they change no weight
        warm = DataLoader(
            make_task_dataset(tok, SMT_WARMUP * batch_size, seed=seed + 1, split="train"),
            batch_size=batch_size,
            collate_fn=collate,
        )
        smt_warmup(model, warm, progress=False)
    trainable_params = [p for p in model.parameters() if p.requires_grad]
    trainable = sum(p.numel() for p in trainable_params)
    opt = make_optimizer(method, model, LR[method])
    sched = get_linear_schedule_with_warmup(opt, 20, steps)  # hf-dtrain finetune's default warm-up
    exclude = list(model.parameters()) + list(model.buffers())

    def saved_bytes(batch):
        counter = SavedTensorCounter(exclude=exclude)
        with counter():
            loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return counter.nbytes

    model.train()
    first = next(iter(loader))
    g = torch.Generator().manual_seed(0)
    probe_ids = torch.randint(0, tok.vocab_size, (8, 256), generator=g)
    probe = {"input_ids": probe_ids, "attention_mask": torch.ones_like(probe_ids), "labels": probe_ids}
    saved_train, saved_probe = saved_bytes(first), saved_bytes(probe)

    times, losses = timed_steps(model, loader, trainable_params, opt, sched)
    opt_state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))

    model.eval()
    eval_losses, hits = [], []
    with torch.no_grad():
        for batch in DataLoader(evalset, batch_size=100, collate_fn=collate):
            out = model(**batch)
            eval_losses.append(out.loss.item())
            hits.append(exact_match(out.logits.argmax(-1).numpy(), batch["labels"].numpy()))
    return {
        "method": method,
        "trainable_params": trainable,
        "saved_bytes_train_batch": saved_train,
        "saved_bytes_probe_8x256": saved_probe,
        "optimizer_state_bytes": opt_state,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_time_median_s": statistics.median(times[10:] if len(times) > 20 else times),
        "train_loss_last50": statistics.mean(losses[-50:]),
        "eval_loss": statistics.mean(eval_losses),
        "eval_accuracy": statistics.mean(hits),
        "lr": LR[method],
        "steps": steps,
    }


def base_eval(seed: int) -> dict:
    import torch
    from torch.utils.data import DataLoader

    from hf_dtrain.models import load_model_and_tokenizer
    from hf_dtrain.tasks import exact_match, make_task_dataset, task_collator

    model, tok = load_model_and_tokenizer(None, progress=True)
    model.eval()
    losses, hits = [], []
    with torch.no_grad():
        for batch in DataLoader(
            make_task_dataset(tok, 500, seed=seed, split="eval"), batch_size=100, collate_fn=task_collator(tok)
        ):
            out = model(**batch)
            losses.append(out.loss.item())
            hits.append(exact_match(out.logits.argmax(-1).numpy(), batch["labels"].numpy()))
    return {
        "eval_loss": sum(losses) / len(losses),
        "eval_accuracy": sum(hits) / len(hits),
        "params": sum(p.numel() for p in model.parameters()),
    }


def main():
    from _report import apply_lr_overrides, rerender, training_parser

    ap = training_parser(__doc__, LR)
    ap.add_argument("--methods", default=",".join(METHODS))
    args = ap.parse_args()
    if args.from_json:
        rerender(args.from_json, "peft_methods", render)
        return
    apply_lr_overrides(args.lr, LR)
    if args.worker:
        emit_result(worker(args.worker, args.steps, args.batch_size, args.seed))
        return

    from tqdm import tqdm

    seeds = [int(x) for x in args.seeds.split(",")]
    base = base_eval(seeds[0])  # also builds and caches the default base model once
    methods = args.methods.split(",")
    runs = []
    for seed, method in tqdm([(s, m) for s in seeds for m in methods], desc="seed x method"):
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            method,
            "--steps",
            str(args.steps),
            "--batch-size",
            str(args.batch_size),
            "--seed",
            str(seed),
            "--lr",
            f"{method}={LR[method]}",
        ]
        proc = processes.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"{method} (seed {seed}) failed:\n{proc.stderr[-4000:]}")
        runs.append(dict(parse_result(proc.stdout), seed=seed))
    rows = []
    for method in methods:
        mine = [r for r in runs if r["method"] == method]
        row = {k: v for k, v in mine[0].items() if k not in ("seed",)}  # sizes are the same for every seed
        for key in ("eval_accuracy", "eval_loss", "train_loss_last50"):
            vals = [r[key] for r in mine]
            row[key] = statistics.mean(vals)
            row[key + "_min"], row[key + "_max"] = min(vals), max(vals)
        ratios = (
            [
                r["step_time_median_s"]
                / next(x for x in runs if x["method"] == "lora" and x["seed"] == r["seed"])["step_time_median_s"]
                for r in mine
            ]
            if "lora" in methods
            else [1.0]
        )
        row["step_time_median_s"] = statistics.median(r["step_time_median_s"] for r in mine)
        row["step_time_vs_lora"] = statistics.mean(ratios)
        row["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in mine)
        row["accuracy_range"] = (
            f"{row['eval_accuracy']:.3f} [{row['eval_accuracy_min']:.3f}, {row['eval_accuracy_max']:.3f}]"
        )
        row["loss_range"] = f"{row['eval_loss']:.3f} [{row['eval_loss_min']:.3f}, {row['eval_loss_max']:.3f}]"
        rows.append(row)
    ref = next((r for r in rows if r["method"] == "lora"), rows[0])
    for r in rows:
        r["saved_probe_vs_lora"] = r["saved_bytes_probe_8x256"] / ref["saved_bytes_probe_8x256"]
        for k in ("saved_bytes_train_batch", "saved_bytes_probe_8x256", "optimizer_state_bytes", "peak_rss_bytes"):
            r[k.replace("bytes", "MiB")] = r[k] / 2**20

    payload = {"base": base, "rows": rows, "runs": runs, "lr": dict(LR), "args": vars(args)}
    from _report import write

    table, fig, notes = render(payload)
    paths = write("peft_methods", payload, table, fig, notes)
    print(table)
    print("\n".join(str(p) for p in paths.values()))


def render(payload: dict):
    """(markdown table, matplotlib figure, notes) from a results payload (a fresh run or the committed JSON)."""
    from _report import markdown_table

    rows, runs, base, args, lr = payload["rows"], payload["runs"], payload["base"], payload["args"], payload["lr"]
    seeds = [int(x) for x in args["seeds"].split(",")]
    table = markdown_table(
        rows,
        [
            ("method", "method", ""),
            ("trainable_params", "trainable params", ",d"),
            ("saved_MiB_train_batch", "saved for backward, train batch (MiB)", ".2f"),
            ("saved_MiB_probe_8x256", "saved for backward, 8x256 probe (MiB)", ".1f"),
            ("saved_probe_vs_lora", "probe saved / LoRA", ".2f"),
            ("optimizer_state_MiB", "optimizer state (MiB)", ".3f"),
            ("peak_rss_MiB", "peak RSS (MiB)", ".0f"),
            ("step_time_vs_lora", "step time / LoRA", ".2f"),
            ("loss_range", "eval loss, mean [min, max]", ""),
            ("accuracy_range", "exact match, mean [min, max]", ""),
        ],
    )
    notes = (
        f"Base model before fine-tuning: eval loss {base['eval_loss']:.3f}, exact match {base['eval_accuracy']:.3f} "
        f"({base['params']:,d} parameters). Seeds {seeds} (data order, adapter init); per seed {args['steps']} AdamW "
        f"steps of batch {args['batch_size']} for every method, same data order, linear LR schedule with 20 warm-up "
        f"steps, gradient norm clipped to 1.0 (the Trainer's defaults), learning rates {lr}; adapters on "
        f"{', '.join(TARGETS)} at the LoRA r={RANK} budget (LoRA-FA: rank raised so B alone matches it; SMT: "
        f"{BLOCK}x{BLOCK} blocks, {SMT_WARMUP} gradient-scoring passes first, not counted as steps). "
        "Saved-for-backward bytes count activations only (parameters and buffers excluded). Peak RSS is the whole "
        "process, so on this small model it is dominated by the Python and torch runtime."
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    names = [r["method"] for r in rows]
    colors = ["#888" if n == "full" else "#dd8452" if n in ("lorafa", "smt") else "#4c72b0" for n in names]
    for ax, key, title in zip(
        axes,
        ["saved_MiB_probe_8x256", "step_time_vs_lora", "eval_accuracy"],
        [
            "saved for backward, 8x256 probe (MiB)",
            "step time / LoRA",
            f"exact match after training (mean, min-max over {len(seeds)} seeds)",
        ],
    ):
        ax.bar(names, [r[key] for r in rows], color=colors)
        ax.set_title(title)
        plt.setp(ax.get_xticklabels(), rotation=25, ha="right")
    for i, r in enumerate(rows):
        accs = [x["eval_accuracy"] for x in runs if x["method"] == r["method"]]
        axes[2].plot([i] * len(accs), accs, "k.", ms=6)
        axes[2].vlines(i, min(accs), max(accs), color="k", lw=1)
    axes[2].axhline(base["eval_accuracy"], color="k", ls="--", lw=1, label="base model")
    axes[2].legend()
    fig.suptitle(f"PEFT methods on the default tiny LLaMA, {args['steps']} steps (orange: hf_dtrain)")
    return table, fig, notes


if __name__ == "__main__":
    main()
