"""Adapters for 4-bit LLaMA at one trainable-parameter budget: QLoRA, QA-LoRA, Q-BaRA and QA-HiRA, then a merge into
the 4-bit model.

One run, the embedded default base model quantized two ways (bitsandbytes NF4, the QLoRA habit; HQQ 4-bit with
zero-points, groups of 32 along in_features), the same data and data order, the same number of AdamW steps:

* ``qlora``: peft LoRA (r=5) on the 4-bit base (peft's own bitsandbytes / HQQ layers);
* ``qa-lora``: QA-LoRA-style pooling (input averaged over each quantization group, B @ A with r=9), expressed as
  ``QAHiRAConfig(r=9, lambda_out=1)``;
* ``qbara``: Q-BaRA, r=5, lambda=2 (rank 10 at LoRA's parameter count);
* ``qahira``: QA-HiRA, one matrix (out x in/32 per layer, lambda_out=1).

Reported per (base, method): trainable parameters, eval loss and exact-match accuracy after training, the effective
rank of the learned delta W (Roy & Vetterli's exp-entropy of the singular values, mean over adapted layers) and its
numerical rank, median step time as a ratio to QLoRA on the same base, and the merge into the 4-bit model: the
largest logit difference between the merged 4-bit model and the unmerged adapter model on the eval set, and the
accuracy after merging. QLoRA's merge is peft's (dequantize, add, re-quantize); Q-BaRA and every method on NF4 merge
the same way (NF4 has no zero-point); QA-LoRA and QA-HiRA on HQQ fold the update into the zero-points.

    python benchmarks/quantized_adapters.py              # about 25 minutes on 2 idle CPU cores
    python benchmarks/quantized_adapters.py --steps 100  # quick look
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from hf_dtrain import processes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit_result, parse_result, timed_steps

BASES = ["nf4", "hqq4"]
METHODS = ["qlora", "qa-lora", "qbara", "qahira"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GROUP = 32  # HQQ quantization group along in_features = the pooling factor of qa-lora and qahira
RANK = 5  # qlora and qbara (qbara's rank is 2 * RANK)
QA_LORA_RANK = 9  # the nearest QA-LoRA budget to LoRA r=5 on these shapes
# Chosen by a 500-step sweep on the hqq4 base, seed 0, over 2e-3 ... 1.6e-1 (the docs list it): the pooled methods
# average g=32 inputs, so their single matrices need far larger steps than LoRA's factors.
LR = {"qlora": 4e-3, "qa-lora": 2e-2, "qbara": 4e-3, "qahira": 8e-2}


def peft_config(method: str):
    from peft import LoraConfig

    from hf_dtrain import QAHiRAConfig, QBaRAConfig

    if method == "qlora":
        return LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules=TARGETS)
    if method == "qa-lora":
        return QAHiRAConfig(group_size=GROUP, lambda_out=1, r=QA_LORA_RANK, scaling=2.0, target_modules=TARGETS)
    if method == "qbara":
        return QBaRAConfig(r=RANK, lora_alpha=2 * RANK, pool=2, target_modules=TARGETS)
    if method == "qahira":
        return QAHiRAConfig(group_size=GROUP, lambda_out=1, target_modules=TARGETS)
    raise ValueError(method)


def _tuner_layers(model):
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]


def delta_ranks(model) -> tuple[float, float]:
    """(mean effective rank, mean numerical rank) of the learned delta W over the adapted layers."""
    import torch

    eff, num = [], []
    for _, layer in _tuner_layers(model):
        delta = layer.get_delta_weight("default").float()
        s = torch.linalg.svdvals(delta)
        if s.max() == 0:
            eff.append(0.0)
            num.append(0)
            continue
        p = s / s.sum()
        p = p[p > 0]
        eff.append(float(torch.exp(-(p * p.log()).sum())))
        num.append(int((s > s.max() * max(delta.shape) * torch.finfo(torch.float32).eps).sum()))
    return statistics.mean(eff), statistics.mean(num)


def requantize_merge(model, kind: str):
    """Merge by re-quantizing (what peft does for LoRA on 4-bit bases): dequantize, add delta W, quantize again into
    the same format, for every adapted layer; returns the unloaded 4-bit model."""
    import torch
    from torch import nn

    from hf_dtrain.quantization import quantize_model_hqq

    for name, layer in _tuner_layers(model):
        base = layer.get_base_layer()
        if kind == "nf4":
            import bitsandbytes as bnb

            dense = bnb.functional.dequantize_4bit(base.weight.data, base.weight.quant_state).float()
        else:
            dense = base.dequantize().float()
        dense = dense + layer.get_delta_weight("default").float()
        lin = nn.Linear(base.in_features, base.out_features, bias=False)
        lin.weight.data = dense
        if kind == "nf4":
            import bitsandbytes as bnb

            new = bnb.nn.Linear4bit(
                base.in_features,
                base.out_features,
                bias=False,
                compute_dtype=torch.float32,
                quant_type=base.weight.quant_type,
            )
            new.weight = bnb.nn.Params4bit(
                dense, requires_grad=False, quant_type=base.weight.quant_type, blocksize=base.weight.blocksize
            )
            new = new.to("cpu")
            new.support_avx512bf16_for_cpu = False
        else:
            holder = nn.Sequential(lin)
            quantize_model_hqq(holder, group_size=GROUP, skip=())
            new = holder[0]
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        setattr(parent, name.rsplit(".", 1)[1], new)
    return model


def evaluate(model, loader):
    import torch

    from hf_dtrain.tasks import exact_match

    model.eval()
    losses, hits, logits = [], [], []
    with torch.no_grad():
        for batch in loader:
            out = model(**batch)
            losses.append(out.loss.item())
            hits.append(exact_match(out.logits.argmax(-1).numpy(), batch["labels"].numpy()))
            logits.append(out.logits)
    return statistics.mean(losses), statistics.mean(hits), logits


def worker(base_kind: str, method: str, steps: int, batch_size: int, seed: int) -> dict:
    import torch
    from peft import get_peft_model
    from torch.utils.data import DataLoader
    from transformers import get_linear_schedule_with_warmup

    from hf_dtrain.models import build_default_model, load_model_and_tokenizer
    from hf_dtrain.quantization import load_quantized_model
    from hf_dtrain.tasks import make_task_dataset, task_collator

    torch.manual_seed(seed)
    path = build_default_model("tiny", progress=False)
    _, tok = load_model_and_tokenizer(path, load_model=False)
    base = load_quantized_model(path, base_kind, group_size=GROUP)
    collate = task_collator(tok)
    train = make_task_dataset(tok, steps * batch_size, seed=seed, split="train")
    eval_loader = DataLoader(make_task_dataset(tok, 500, seed=seed, split="eval"), batch_size=100, collate_fn=collate)
    quant_loss, quant_acc, _ = evaluate(base, eval_loader)
    model = get_peft_model(base, peft_config(method))
    trainable_params = [p for p in model.parameters() if p.requires_grad]
    trainable = sum(p.numel() for p in trainable_params)
    opt = torch.optim.AdamW(trainable_params, lr=LR[method], weight_decay=0.0)
    sched = get_linear_schedule_with_warmup(opt, 20, steps)

    model.train()
    times, losses = timed_steps(
        model, DataLoader(train, batch_size=batch_size, shuffle=False, collate_fn=collate), trainable_params, opt, sched
    )
    eval_loss, eval_acc, ref_logits = evaluate(model, eval_loader)
    eff_rank, num_rank = delta_ranks(model)

    exact = base_kind == "hqq4" and method in ("qa-lora", "qahira")
    if exact:
        merged = model.merge_and_unload()  # zero-points move, no weight code changes
        merge_kind = "exact (zero-point fold)"
    elif method == "qlora":
        merged = model.merge_and_unload()  # peft: dequantize, add, re-quantize
        merge_kind = "peft: re-quantize"
    else:
        merged = requantize_merge(model.base_model.model, base_kind)
        merge_kind = "re-quantize"
    merged_loss, merged_acc, merged_logits = evaluate(merged, eval_loader)
    merge_err = max((a - b).abs().max().item() for a, b in zip(merged_logits, ref_logits))
    return {
        "base": base_kind,
        "method": method,
        "trainable_params": trainable,
        "lr": LR[method],
        "steps": steps,
        "quantized_base_eval_loss": quant_loss,
        "quantized_base_eval_accuracy": quant_acc,
        "step_time_median_s": statistics.median(times[10:] if len(times) > 20 else times),
        "train_loss_last50": statistics.mean(losses[-50:]),
        "eval_loss": eval_loss,
        "eval_accuracy": eval_acc,
        "effective_rank": eff_rank,
        "numerical_rank": num_rank,
        "merge": merge_kind,
        "merge_max_logit_err": merge_err,
        "merged_eval_loss": merged_loss,
        "merged_eval_accuracy": merged_acc,
    }


def main():
    from _report import apply_lr_overrides, rerender, training_parser

    ap = training_parser(__doc__, LR)
    ap.add_argument("--name", default="quantized_adapters", help="results file name under benchmarks/results/")
    ap.add_argument("--bases", default=",".join(BASES))
    ap.add_argument("--methods", default=",".join(METHODS))
    args = ap.parse_args()
    if args.from_json:
        rerender(args.from_json, args.name, render)
        return
    apply_lr_overrides(args.lr, LR)
    if args.worker:
        base_kind, method = args.worker.split(":")
        emit_result(worker(base_kind, method, args.steps, args.batch_size, args.seed))
        return

    from tqdm import tqdm

    from hf_dtrain.models import build_default_model

    build_default_model("tiny", progress=True)  # build and cache the base once, before the workers
    bases, methods = args.bases.split(","), args.methods.split(",")
    seeds = [int(x) for x in args.seeds.split(",")]
    runs = []
    for seed, base_kind, method in tqdm(
        [(s, b, m) for s in seeds for b in bases for m in methods], desc="seed x base x method"
    ):
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            f"{base_kind}:{method}",
            "--steps",
            str(args.steps),
            "--batch-size",
            str(args.batch_size),
            "--seed",
            str(seed),
            "--lr",
            f"{method}={LR[method]}",
        ]
        proc = processes.run(cmd, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"{base_kind}:{method} (seed {seed}) failed:\n{proc.stderr[-4000:]}")
        runs.append(dict(parse_result(proc.stdout), seed=seed))
    for r in runs:
        ref = next((x for x in runs if (x["base"], x["method"], x["seed"]) == (r["base"], "qlora", r["seed"])), None)
        r["step_time_vs_qlora"] = r["step_time_median_s"] / ref["step_time_median_s"] if ref else None
    rows = []
    for base_kind in bases:
        for method in methods:
            mine = [r for r in runs if (r["base"], r["method"]) == (base_kind, method)]
            row = dict(mine[0])
            row.pop("seed")
            for key in (
                "eval_loss",
                "eval_accuracy",
                "effective_rank",
                "numerical_rank",
                "train_loss_last50",
                "merge_max_logit_err",
                "merged_eval_loss",
                "merged_eval_accuracy",
                "step_time_median_s",
                "quantized_base_eval_loss",
                "quantized_base_eval_accuracy",
            ):
                vals = [r[key] for r in mine]
                row[key] = statistics.mean(vals)
                row[key + "_min"], row[key + "_max"] = min(vals), max(vals)
            row["merge_max_logit_err"] = row["merge_max_logit_err_max"]  # the worst seed
            ratios = [r["step_time_vs_qlora"] for r in mine if r["step_time_vs_qlora"] is not None]
            row["step_time_vs_qlora"] = statistics.mean(ratios) if ratios else None
            rows.append(row)
    for r in rows:
        ref = next((x for x in rows if (x["base"], x["method"]) == (r["base"], "qlora")), None)
        r["params_vs_qlora"] = r["trainable_params"] / ref["trainable_params"] if ref else None
        r["accuracy_range"] = f"{r['eval_accuracy']:.3f} [{r['eval_accuracy_min']:.3f}, {r['eval_accuracy_max']:.3f}]"
        r["loss_range"] = f"{r['eval_loss']:.3f} [{r['eval_loss_min']:.3f}, {r['eval_loss_max']:.3f}]"
    payload = {"rows": rows, "runs": runs, "lr": dict(LR), "args": vars(args)}
    from _report import write

    table, fig, notes = render(payload)
    paths = write(args.name, payload, table, fig, notes)
    print(table)
    print("\n".join(str(p) for p in paths.values()))


def render(payload: dict):
    """(markdown table, matplotlib figure, notes) from a results payload (a fresh run or the committed JSON)."""
    from _report import markdown_table

    rows, args, lr = payload["rows"], payload["args"], payload["lr"]
    table = markdown_table(
        rows,
        [
            ("base", "base", ""),
            ("method", "method", ""),
            ("trainable_params", "trainable params", ",d"),
            ("params_vs_qlora", "params / QLoRA", ".2f"),
            ("loss_range", "eval loss, mean [min, max]", ""),
            ("accuracy_range", "exact match, mean [min, max]", ""),
            ("effective_rank", "effective rank of delta W", ".1f"),
            ("numerical_rank", "numerical rank", ".1f"),
            ("step_time_vs_qlora", "step time / QLoRA", ".2f"),
            ("merge", "merge into 4-bit", ""),
            ("merge_max_logit_err", "max abs logit change by the merge", ".2e"),
            ("merged_eval_accuracy", "exact match after merge (mean)", ".3f"),
        ],
    )
    seeds = [int(x) for x in args["seeds"].split(",")]
    quant = {r["base"]: (r["quantized_base_eval_loss"], r["quantized_base_eval_accuracy"]) for r in rows}
    quant_txt = "; ".join(f"{b}: eval loss {l:.3f}, exact match {a:.3f}" for b, (l, a) in quant.items())
    notes = (
        f"The embedded default base model (tiny LLaMA), quantized before fine-tuning ({quant_txt}). Seeds {seeds} "
        f"(data order, adapter init); per seed {args['steps']} AdamW steps of batch {args['batch_size']} for every "
        "method, same data order, linear LR schedule with 20 warm-up steps, gradient norm clipped to 1.0; learning "
        f"rates {lr}. All seven projections adapted. QA-LoRA and QA-HiRA pool the input over groups of {GROUP} (the "
        f"HQQ group size); QLoRA r={RANK}, Q-BaRA r={RANK} with lambda=2, QA-LoRA r={QA_LORA_RANK}. Effective rank: "
        "exp of the entropy of the normalised singular values of delta W, averaged over the 28 adapted layers; "
        "numerical rank: singular values above max(shape) * eps * the largest. The merge error is the largest "
        "absolute logit difference between the merged 4-bit model and the unmerged adapter model over 500 eval "
        "examples (fp32), worst seed. Step time: median per run, as a ratio to QLoRA on the same base and seed, mean "
        "over seeds."
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    bases = list(dict.fromkeys(r["base"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    width = 0.8 / len(bases)
    for j, b in enumerate(bases):
        sub = {r["method"]: r for r in rows if r["base"] == b}
        xs = [i + (j - (len(bases) - 1) / 2) * width for i in range(len(methods))]
        axes[0].bar(xs, [sub[m]["eval_accuracy"] for m in methods], width, label=b)
        axes[0].vlines(
            xs,
            [sub[m]["eval_accuracy_min"] for m in methods],
            [sub[m]["eval_accuracy_max"] for m in methods],
            color="k",
            lw=1,
        )
        axes[1].bar(xs, [sub[m]["effective_rank"] for m in methods], width, label=b)
        axes[2].bar(xs, [max(sub[m]["merge_max_logit_err"], 1e-8) for m in methods], width, label=b)
    for ax, title in zip(
        axes,
        [
            f"exact match after training (mean, min-max over {len(seeds)} seeds)",
            "effective rank of delta W",
            "max |logit change| from merging into 4 bits (log)",
        ],
    ):
        ax.set_xticks(range(len(methods)), methods)
        ax.set_title(title)
    axes[1].legend(title="4-bit base", loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=len(bases))
    axes[2].set_yscale("log")
    fig.suptitle(f"4-bit adapters on the default tiny LLaMA, {args['steps']} steps, one parameter budget")
    return table, fig, notes


if __name__ == "__main__":
    main()
