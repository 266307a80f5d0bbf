"""PEFT methods on the embedded default model, at matched trainable-parameter budgets.

Compares full fine-tuning, peft LoRA, peft DoRA, peft LoRA with peft's ``create_lorafa_optimizer``, hf_dtrain LoRA-FA
and hf_dtrain SMT. Each method runs in a fresh process (so its peak RSS is its own) with the same data order, the
same number of optimizer steps and AdamW. Reported per method: trainable parameters, bytes saved for backward
(counted with ``saved_tensors_hooks``, activations only, on the training batch and on a long-sequence probe batch),
optimizer-state bytes, peak RSS, median step time as a ratio to LoRA in the same run, eval loss and exact-match
accuracy on held-out additions.

    python benchmarks/peft_methods.py            # ~10 minutes on 2 idle CPU cores (plus the base model once)
    python benchmarks/peft_methods.py --steps 50 # quick look
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

METHODS = ["full", "lora", "dora", "lora+peft_lorafa_opt", "lorafa", "smt"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The learning rates of `hf-dtrain finetune` (hf_dtrain.finetune.DEFAULT_LR), tuned on this task.
LR = {"full": 5e-4, "lora": 4e-3, "dora": 4e-3, "lora+peft_lorafa_opt": 4e-3, "lorafa": 4e-3, "smt": 2e-3}
RANK = 8
BLOCK = 64
SMT_WARMUP = 20


def _shapes(model):
    import torch

    return [(m.out_features, m.in_features) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in TARGETS]


def build(method: str, model):
    """The model to train and its optimizer factory, at the LoRA r=8 budget on TARGETS."""
    import torch
    from peft import LoraConfig, get_peft_model

    from hf_dtrain import LoraFAConfig, SMTConfig

    shapes = _shapes(model)
    budget = sum(RANK * (o + i) for o, i in shapes)
    if method == "full":
        return model, None
    if method in ("lora", "dora", "lora+peft_lorafa_opt"):
        cfg = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, use_dora=method == "dora", lora_dropout=0.0)
        return get_peft_model(model, cfg), None
    if method == "lorafa":
        # only B (out x r) trains: the rank that matches LoRA's budget is budget / sum(out)
        r = round(budget / sum(o for o, _ in shapes))
        return get_peft_model(model, LoraFAConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS, init_seed=0)), None
    if method == "smt":
        n = round(budget / BLOCK**2)
        return get_peft_model(model, SMTConfig(target_modules=TARGETS, block_size=BLOCK, num_blocks=n, warmup_steps=SMT_WARMUP)), None
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

    from hf_dtrain.data.tasks import exact_match, make_task_dataset, task_collator
    from hf_dtrain.models import load_model_and_tokenizer
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
        warm = DataLoader(make_task_dataset(tok, SMT_WARMUP * batch_size, seed=seed + 1, split="train"),
                          batch_size=batch_size, collate_fn=collate)
        smt_warmup(model, warm, progress=False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = make_optimizer(method, model, LR[method])
    sched = get_linear_schedule_with_warmup(opt, max(1, steps // 20), steps)
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

    times, losses = [], []
    for step, batch in enumerate(loader):
        t0 = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    opt_state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))

    model.eval()
    eval_losses, hits = [], []
    with torch.no_grad():
        for batch in DataLoader(evalset, batch_size=100, collate_fn=collate):
            out = model(**batch)
            eval_losses.append(out.loss.item())
            hits.append(exact_match(out.logits.argmax(-1).numpy(), batch["labels"].numpy()))
    return {
        "method": method, "trainable_params": trainable, "saved_bytes_train_batch": saved_train,
        "saved_bytes_probe_8x256": saved_probe, "optimizer_state_bytes": opt_state,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_time_median_s": statistics.median(times[10:] if len(times) > 20 else times),
        "train_loss_last50": statistics.mean(losses[-50:]), "eval_loss": statistics.mean(eval_losses),
        "eval_accuracy": statistics.mean(hits), "lr": LR[method], "steps": steps,
    }


def base_eval(seed: int) -> dict:
    import torch
    from torch.utils.data import DataLoader

    from hf_dtrain.data.tasks import exact_match, make_task_dataset, task_collator
    from hf_dtrain.models import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(None, progress=True)
    model.eval()
    losses, hits = [], []
    with torch.no_grad():
        for batch in DataLoader(make_task_dataset(tok, 500, seed=seed, split="eval"), batch_size=100, collate_fn=task_collator(tok)):
            out = model(**batch)
            losses.append(out.loss.item())
            hits.append(exact_match(out.logits.argmax(-1).numpy(), batch["labels"].numpy()))
    return {"eval_loss": sum(losses) / len(losses), "eval_accuracy": sum(hits) / len(hits),
            "params": sum(p.numel() for p in model.parameters())}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.steps, args.batch_size, args.seed)))
        return

    from tqdm import tqdm

    base = base_eval(args.seed)  # also builds and caches the default base model once
    rows = []
    methods = args.methods.split(",")
    for method in tqdm(methods, desc="methods"):
        cmd = [sys.executable, __file__, "--worker", method, "--steps", str(args.steps),
               "--batch-size", str(args.batch_size), "--seed", str(args.seed)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"{method} failed:\n{proc.stderr[-4000:]}")
        rows.append(json.loads(proc.stdout.split("RESULT ", 1)[1]))
    ref = next((r for r in rows if r["method"] == "lora"), rows[0])
    for r in rows:
        r["step_time_vs_lora"] = r["step_time_median_s"] / ref["step_time_median_s"]
        r["saved_probe_vs_lora"] = r["saved_bytes_probe_8x256"] / ref["saved_bytes_probe_8x256"]
        for k in ("saved_bytes_train_batch", "saved_bytes_probe_8x256", "optimizer_state_bytes", "peak_rss_bytes"):
            r[k.replace("bytes", "MiB")] = r[k] / 2**20

    from _report import markdown_table, write

    table = markdown_table(rows, [
        ("method", "method", ""), ("trainable_params", "trainable params", ",d"),
        ("saved_MiB_train_batch", "saved for backward, train batch (MiB)", ".2f"),
        ("saved_MiB_probe_8x256", "saved for backward, 8x256 probe (MiB)", ".1f"),
        ("saved_probe_vs_lora", "probe saved / LoRA", ".2f"),
        ("optimizer_state_MiB", "optimizer state (MiB)", ".3f"), ("peak_rss_MiB", "peak RSS (MiB)", ".0f"),
        ("step_time_vs_lora", "step time / LoRA", ".2f"), ("eval_loss", "eval loss", ".3f"),
        ("eval_accuracy", "exact match", ".3f"),
    ])
    notes = (
        f"Base model before fine-tuning: eval loss {base['eval_loss']:.3f}, exact match {base['eval_accuracy']:.3f} "
        f"({base['params']:,d} parameters). {args.steps} AdamW steps of batch {args.batch_size} for every method, "
        f"same data order; adapters on {', '.join(TARGETS)} at the LoRA r={RANK} budget (LoRA-FA: rank raised so B "
        f"alone matches it; SMT: {BLOCK}x{BLOCK} blocks, {SMT_WARMUP} gradient-scoring passes first, not counted as "
        "steps). Saved-for-backward bytes count activations only (parameters and buffers excluded). Peak RSS is the "
        "whole process, so on this small model it is dominated by the Python and torch runtime."
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    names = [r["method"] for r in rows]
    for ax, key, title in zip(axes, ["saved_MiB_probe_8x256", "step_time_vs_lora", "eval_accuracy"],
                              ["saved for backward, 8x256 probe (MiB)", "step time / LoRA", "exact match after training"]):
        ax.bar(names, [r[key] for r in rows], color=["#888" if n == "full" else "#4c72b0" if "lorafa" not in n and n != "smt" else "#dd8452" for n in names])
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
    axes[2].axhline(base["eval_accuracy"], color="k", ls="--", lw=1, label="base model")
    axes[2].legend()
    fig.suptitle(f"PEFT methods on the default tiny LLaMA, {args.steps} steps (orange: hf_dtrain)")
    paths = write("peft_methods", {"base": base, "rows": rows, "args": vars(args)}, table, fig, notes)
    print(table)
    print("\n".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    main()
