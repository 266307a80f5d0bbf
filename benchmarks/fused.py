"""Fused training (HFTA) against running the same jobs one after another, on the embedded default model.

A sweep of K LoRA-FA fine-tuning jobs (the default method of ``hf-dtrain finetune``; learning rate x rank x seed)
and of K full fine-tuning jobs (HFTA's original case) on the embedded default "tiny" LLaMA and the default task.
For each K in 1, 4, 8, 16 the K jobs are trained fused (``hf_dtrain.fused``, as ``hf-dtrain sweep`` runs them) and,
in the same run, one after another as a user would run them today (each job alone with peft and the Trainer, as
``hf-dtrain finetune`` runs it). Reported: aggregate training samples/s (median step time after warm-up) and the
ratio fused / sequential, plus the ratio to our own engine at K=1 run K times (the fusion alone, without the
Trainer's per-step overhead). A profile of one step at K=1 and K=8 shows where the time goes.

    python benchmarks/fused.py            # ~8 minutes on 2 idle CPU cores
    python benchmarks/fused.py --steps 10 # quick look
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import markdown_table, write

KS = [1, 4, 8, 16]
LRS = [1e-3, 2e-3, 4e-3, 8e-3]
RANKS = [4, 8]
SEEDS = [0, 1]


def jobs_for(method: str, k: int, batch: int, steps: int):
    from hf_dtrain.jobs.sft.config import FinetuneConfig
    from hf_dtrain.jobs.sweep import expand_grid

    base = FinetuneConfig.from_dict(
        dict(
            method=method,
            max_steps=steps,
            per_device_train_batch_size=batch,
            warmup_steps=2,
            train_size=4000,
            eval_size=16,
            progress=False,
            report=False,
            logging_steps=1000,
        )
    )
    grid = expand_grid(base, learning_rate=LRS, lora_r=RANKS, seed=SEEDS)  # 16 jobs
    return grid[:k]


def time_trainer(job, base_path, warm: int) -> float:
    """Median seconds per optimizer step of ``job`` alone under the Trainer (hf-dtrain finetune's arguments)."""
    import torch
    from peft import get_peft_model
    from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed

    from hf_dtrain import tasks
    from hf_dtrain.models import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(base_path)
    a = job.training_args()
    train = tasks.make_task_dataset(tok, job.train_size, seed=a.seed, split="train")
    set_seed(a.seed)
    cfg = job.build_peft_config(model)
    if cfg is not None:
        model = get_peft_model(model, cfg)
    method = job.method_entry
    own = method.owns_optimizer(job.method_settings)
    opt = method.build_optimizer(job.method_settings, model, a.learning_rate, 0.0) if own else None
    times = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    args = TrainingArguments(
        output_dir="/tmp/hf_dtrain_bench_fused",
        max_steps=a.max_steps,
        learning_rate=a.learning_rate,
        per_device_train_batch_size=a.per_device_train_batch_size,
        warmup_steps=a.warmup_steps,
        lr_scheduler_type="linear",
        seed=a.seed,
        data_seed=a.seed,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1000,
        disable_tqdm=True,
        remove_unused_columns=False,
        max_grad_norm=1.0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        data_collator=tasks.task_collator(tok),
        train_dataset=train,
        callbacks=[Clock()],
        optimizers=(opt, None),
    )
    trainer.train()
    del trainer, model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return statistics.median(times[warm:])


def time_fused(jobs, base_path, warm: int, profile: bool = False):
    """Median seconds per fused step of ``jobs`` (built as hf-dtrain sweep builds them), and optionally a profile."""
    import copy

    from peft import get_peft_model
    from transformers import set_seed

    from hf_dtrain import tasks
    from hf_dtrain.fused import FusedConfig, FusedJob, FusedTrainer, fuse_adapters, fuse_models
    from hf_dtrain.jobs.sweep.config import job_name
    from hf_dtrain.jobs.sweep.run import _job_loader
    from hf_dtrain.models import load_model_and_tokenizer

    base, tok = load_model_and_tokenizer(base_path)
    names = [job_name(j, jobs, i) for i, j in enumerate(jobs)]
    if jobs[0].method == "full":
        fused = fuse_models([copy.deepcopy(base) for _ in jobs])
    else:
        peft_model = None
        for name, job in zip(names, jobs):
            set_seed(job.seed)
            cfg = job.build_peft_config(base)
            if peft_model is None:
                peft_model = get_peft_model(base, cfg, adapter_name=name)
            else:
                peft_model.add_adapter(name, cfg)
        fused = fuse_adapters(peft_model, names)
    collator = tasks.task_collator(tok)
    args = [j.training_args() for j in jobs]
    fjobs = [
        FusedJob(
            n,
            a.learning_rate,
            _job_loader(j, tasks.make_task_dataset(tok, j.train_size, seed=a.seed, split="train"), collator, 1, 0),
            warmup_steps=int(a.warmup_steps),
        )
        for n, j, a in zip(names, jobs, args)
    ]
    method = jobs[0].method_entry
    rule = method.fused.optimizer_rule if method.owns_optimizer(jobs[0].method_settings) else "adamw"
    steps = args[0].max_steps
    trainer = FusedTrainer(fused, fjobs, steps, FusedConfig(), pad_id=tok.pad_token_id or 0, optimizer_rule=rule)
    prof = None
    for i in range(steps):
        if profile and i == warm:
            import torch.profiler as tp

            with tp.profile(activities=[tp.ProfilerActivity.CPU]) as p:
                for _ in range(3):
                    trainer.step()
            prof = _profile_rows(p)
            continue
        if trainer.global_step >= steps:
            break
        trainer.step()
    return statistics.median(trainer.step_seconds[warm:]), prof


def _profile_rows(prof) -> dict:
    """Self CPU time by kind of work, as shares of the profiled steps."""
    kinds = {
        "matmul": ("mm", "bmm", "addmm", "baddbmm", "matmul", "linear"),
        "attention": ("scaled_dot_product", "_flash_attention", "_efficient_attention"),
        "optimizer": ("lerp", "addcmul", "sqrt", "linalg", "vector_norm", "pinv"),
    }
    total, by = 0.0, dict.fromkeys((*kinds, "other"), 0.0)
    for e in prof.key_averages():
        if not e.key.startswith("aten::"):
            continue
        t = e.self_cpu_time_total
        total += t
        name = e.key[len("aten::") :]
        kind = next((k for k, keys in kinds.items() if any(name.startswith(x) or name == x for x in keys)), "other")
        by[kind] += t
    launches = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    return {
        **{k: v / max(total, 1) for k, v in by.items()},
        "aten_calls_per_step": launches / 3,
        "aten_self_ms_per_step": total / 3 / 1000,
    }


def gemm_rates(rows_per_job: int, hidden: int, ks=(1, 8)) -> list[dict]:
    """GFLOP/s of the default model's largest products (hidden x hidden, x intermediate, x vocabulary) at the row
    count of one job's micro-batch and of K jobs' stacked micro-batches: how much a bigger product gains on this CPU."""
    import torch

    from hf_dtrain.models import PRESETS

    shape = PRESETS["tiny"]
    out = []
    for n_out, what in (
        (hidden, "hidden"),
        (shape["intermediate_size"], "intermediate"),
        (shape["vocab_size"], "vocab"),
    ):
        row = dict(product=f"[rows x {hidden}] @ [{hidden} x {n_out}] ({what})")
        for k in ks:
            x, w = torch.randn(rows_per_job * k, hidden), torch.randn(hidden, n_out)
            for _ in range(3):
                x @ w
            reps, t0 = 50, time.perf_counter()
            for _ in range(reps):
                x @ w
            dt = (time.perf_counter() - t0) / reps
            row[f"gflops_k{k}"] = 2 * x.shape[0] * hidden * n_out / dt / 1e9
        row["gain"] = row[f"gflops_k{ks[-1]}"] / row[f"gflops_k{ks[0]}"]
        out.append(row)
    return out


def render(payload: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    panels = [(m, b) for m in payload["methods"] for b in payload["batch_sizes"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (method, batch) in zip(axes[0], panels):
        rs = [r for r in rows if r["method"] == method and r["batch"] == batch]
        ks = [r["k"] for r in rs]
        ax.plot(ks, [r["fused_samples_per_s"] for r in rs], "o-", label="fused (hf-dtrain sweep)")
        ax.plot(ks, [r["sequential_samples_per_s"] for r in rs], "s--", label="one after another (Trainer)")
        ax.plot(ks, [r["engine_k1_samples_per_s"] for r in rs], "^:", label="one after another (fused engine, K=1)")
        for r in rs:
            ax.annotate(
                f"{r['speedup_vs_trainer']:.1f}x",
                (r["k"], r["fused_samples_per_s"]),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize=8,
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("jobs K")
        ax.set_ylabel("aggregate training samples / s")
        ax.set_title(f"{method}, batch {batch} per job")
        ax.legend(fontsize=8)
    fig.tight_layout()
    cols = [
        ("method", "method", ""),
        ("batch", "batch/job", "d"),
        ("k", "K", "d"),
        ("fused_samples_per_s", "fused samples/s", ".0f"),
        ("sequential_samples_per_s", "sequential (Trainer) samples/s", ".0f"),
        ("speedup_vs_trainer", "fused / sequential (Trainer)", ".2f"),
        ("speedup_vs_engine_k1", "fused / sequential (engine K=1)", ".2f"),
        ("per_job_mib", "memory guard: per-job MiB", ".1f"),
    ]
    table = markdown_table(rows, cols)
    prof = payload.get("profile", {})
    if prof:
        pcols = [
            ("case", "step", ""),
            ("aten_self_ms_per_step", "aten self ms/step", ".1f"),
            ("aten_calls_per_step", "aten calls/step", ".0f"),
            ("matmul", "matmul", ".2f"),
            ("attention", "attention", ".2f"),
            ("optimizer", "optimizer", ".2f"),
            ("other", "other", ".2f"),
        ]
        table += "\n\nProfile (torch.profiler, self CPU time shares of 3 steps):\n\n" + markdown_table(
            [dict(case=k, **v) for k, v in prof.items()], pcols
        )
    if payload.get("gemm"):
        gcols = [
            ("product", "product", ""),
            ("gflops_k1", "GFLOP/s, one job's rows", ".1f"),
            ("gflops_k8", "GFLOP/s, 8 jobs' rows", ".1f"),
            ("gain", "gain", ".2f"),
        ]
        table += (
            f"\n\nMatrix products at the rows of one job ({payload['rows_per_job']}: batch x mean sequence "
            "length) and of 8 jobs stacked:\n\n" + markdown_table(payload["gemm"], gcols)
        )
    grid = payload["grid"]
    notes = (
        "Sequential = the same K jobs one after another; its samples/s is K x batch over the sum of the jobs' "
        "median step times. Each fused step trains all K jobs on their own batches. Jobs: the grid "
        f"learning rate {grid['learning_rate']} x rank {grid['lora_r']} x seed {grid['seed']} (the first K)."
    )
    return table, fig, notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=25, help="steps per run (the first --warm are not timed)")
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--batch-sizes", default="16,4", help="per job (16: hf-dtrain finetune's default)")
    ap.add_argument("--methods", default="lorafa,full")
    ap.add_argument("--from-json", metavar="PATH", help="only rebuild the table and plot from a results JSON")
    args = ap.parse_args()
    if args.from_json:
        from _report import rerender

        rerender(args.from_json, "fused", render)
        return
    import torch

    from hf_dtrain.models import build_default_model

    torch.set_num_threads(2)
    base_path = build_default_model("tiny", progress=True)
    methods = args.methods.split(",")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows, profile = [], {}
    for method, bs in [(m, b) for m in methods for b in batch_sizes]:
        all_jobs = jobs_for(method, max(KS), bs, args.steps)
        seq = [time_trainer(j, base_path, args.warm) for j in all_jobs]
        print(f"{method}: Trainer step medians {[f'{t * 1000:.1f}ms' for t in seq]}", flush=True)
        k1 = None
        for k in KS:
            prof_here = method == methods[0] and bs == batch_sizes[0] and k in (1, 8)
            t, prof = time_fused(all_jobs[:k], base_path, args.warm, profile=prof_here)
            if prof is not None:
                profile[f"{method} K={k}"] = prof
            if k == 1:
                k1 = t
            seq_time = sum(seq[:k])  # seconds for one step of each of the k jobs, one after another
            row = dict(
                method=method,
                batch=bs,
                k=k,
                fused_step_s=t,
                fused_samples_per_s=k * bs / t,
                sequential_samples_per_s=k * bs / seq_time,
                engine_k1_samples_per_s=bs / k1,
                speedup_vs_trainer=seq_time / t,
                speedup_vs_engine_k1=k * k1 / t,
            )
            rows.append(row)
            print(row, flush=True)
    for method, bs in [(m, b) for m in methods for b in batch_sizes]:  # the memory guard's per-job estimate
        per = _per_job_bytes(method, base_path, bs)
        for r in rows:
            if r["method"] == method and r["batch"] == bs:
                r["per_job_mib"] = per / 2**20
    rows_per_job = batch_sizes[0] * _mean_length(base_path)
    payload = dict(
        rows=rows,
        methods=methods,
        profile=profile,
        steps=args.steps,
        warm=args.warm,
        batch_sizes=batch_sizes,
        grid=dict(learning_rate=LRS, lora_r=RANKS, seed=SEEDS),
        rows_per_job=rows_per_job,
        gemm=gemm_rates(rows_per_job, 256),
    )
    table, fig, notes = render(payload)
    write("fused", payload, table, fig, notes=notes)
    print(table)


def _mean_length(base_path) -> int:
    from hf_dtrain import tasks
    from hf_dtrain.models import load_model_and_tokenizer

    _, tok = load_model_and_tokenizer(base_path, load_model=False)
    ds = tasks.make_task_dataset(tok, 256, seed=0, split="train")
    return round(sum(len(x["input_ids"]) for x in ds) / len(ds))


def _per_job_bytes(method, base_path, batch) -> int:
    from hf_dtrain import tasks
    from hf_dtrain.fused import measure_job_bytes, stack_batches
    from hf_dtrain.models import load_model_and_tokenizer

    jobs = jobs_for(method, 1, batch, 2)
    _, tok = load_model_and_tokenizer(base_path, load_model=False)
    import copy

    from peft import get_peft_model

    from hf_dtrain.fused import fuse_adapters, fuse_models

    base, _ = load_model_and_tokenizer(base_path)
    if method == "full":
        fused = fuse_models([copy.deepcopy(base)])
    else:
        fused = fuse_adapters(get_peft_model(base, jobs[0].build_peft_config(base), adapter_name="a"), ["a"])
    ds = tasks.make_task_dataset(tok, batch, seed=0, split="train")
    batch_ = tasks.task_collator(tok)([ds[i] for i in range(batch)])
    return measure_job_bytes(fused, stack_batches([batch_], tok.pad_token_id or 0))["per_job_bytes"]


if __name__ == "__main__":
    main()
