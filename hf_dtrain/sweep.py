"""``hf-dtrain sweep``: a grid of ``hf-dtrain finetune`` jobs trained fused (HFTA) on one base model.

``run_sweep(SweepConfig(jobs=expand_grid(FinetuneConfig(method="lorafa", ...), learning_rate=[1e-4, 3e-4],
lora_r=[8, 16], seed=[0, 1])))`` trains the K jobs as one model (:mod:`hf_dtrain.fused`): the frozen base runs once
per step for all of them, each job keeps its own adapter, rank, alpha, learning rate, schedule, seed (adapter init,
data and data order) and optimizer state. Each job is exactly a :class:`~hf_dtrain.finetune.FinetuneConfig`: alone,
``hf-dtrain finetune`` with the same settings trains the same adapter. Each job gets a standard peft adapter
directory with a model card and ``results.json`` under ``<output_dir>/<job>/``; the sweep writes ``sweep.json``,
``sweep.md`` (one row per job) and ``sweep.png`` (every job's loss curve).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import os
import time
from dataclasses import dataclass, field

import torch
from accelerate.data_loader import prepare_data_loader
from peft import get_peft_model
from torch.utils.data import DataLoader, RandomSampler
from transformers import set_seed

from hf_dtrain import tasks
from hf_dtrain.compose import ComposeOptions
from hf_dtrain.finetune import FinetuneConfig, load_base_and_data, load_base_model
from hf_dtrain.fused import FusedConfig, FusedJob, FusedTrainer, measure_job_bytes, plan_groups, stack_batches
from hf_dtrain.fused.fuse import NOT_FUSABLE, fuse_adapters, fuse_models
from hf_dtrain.model_card import write_model_card
from hf_dtrain.run import JobRun
from hf_dtrain.tuners.finetune_method import FINETUNE_METHODS

# method name -> what it is fused as (the peft type; "full": fused copies of the whole model)
FUSABLE_METHODS = {"lora": "LORA", "lorafa": "LORAFA", "qbara": "QBARA", "smt": "SMT", "full": "full"}
# settings a job may set for itself (FinetuneConfig fields, the Trainer's settings in its `training`, `smt.` its
# section); every other setting must be the same for all jobs of a sweep
PER_JOB = (
    "learning_rate",
    "seed",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "weight_decay",
    "warmup_steps",
    "smt.num_blocks",
    "smt.warmup_steps",
    "output_dir",
    "logging_steps",
    "report",
    "progress",
    "disable_tqdm",
)
# the grid's axes on the command line (--lr 1e-4,3e-4 --r 8,16 --alpha 16 --seed 0,1 ...) -> settings, and their types
GRID_AXES = {
    "lr": "learning_rate",
    "r": "lora_r",
    "alpha": "lora_alpha",
    "seed": "seed",
    "dropout": "lora_dropout",
    "weight_decay": "weight_decay",
    "warmup_steps": "warmup_steps",
    "smt_num_blocks": "smt.num_blocks",
}
AXIS_TYPES = {
    "learning_rate": float,
    "lora_r": int,
    "lora_alpha": int,
    "seed": int,
    "lora_dropout": float,
    "weight_decay": float,
    "warmup_steps": int,
    "smt.num_blocks": int,
}


@dataclass
class SweepConfig:
    """A fused sweep: its jobs (each a full ``FinetuneConfig``) and how they are fused."""

    jobs: list = field(default_factory=list, metadata={"help": "The jobs (FinetuneConfig each); see expand_grid."})
    fused: FusedConfig = field(default_factory=FusedConfig, metadata={"help": "How the jobs are fused."})
    output_dir: str | None = field(
        default=None,
        metadata={"help": "Where the jobs' directories and the sweep table go; default outputs/sweep-<method>."},
    )
    progress: bool = field(default=True, metadata={"help": "Show the progress bar (per-job losses)."})
    report: bool = field(default=True, metadata={"help": "Print the sweep table."})

    def __post_init__(self):
        if isinstance(self.fused, dict):
            from hf_dtrain.settings import build

            self.fused = build(FusedConfig, self.fused, where="SweepConfig.fused")
        jobs = []
        for i, j in enumerate(self.jobs):
            if isinstance(j, dict):
                j = FinetuneConfig.from_dict(j, where=f"SweepConfig.jobs[{i}]")
            if not isinstance(j, FinetuneConfig):
                raise TypeError(
                    f"SweepConfig.jobs[{i}] is a {type(j).__name__}; give FinetuneConfig objects "
                    "(or mappings of its fields)."
                )
            jobs.append(j)
        self.jobs = jobs
        if not self.jobs:
            raise ValueError(
                "SweepConfig.jobs is empty: give at least one job (expand_grid, or --lr/--r/--seed "
                "lists, or --recipes)."
            )
        check_fusable(self.jobs)


def expand_grid(base: FinetuneConfig, **axes) -> list[FinetuneConfig]:
    """The cartesian product of ``axes`` (FinetuneConfig field -> list of values) over ``base``, in the order given
    (the last axis varies fastest)."""
    for name, values in axes.items():
        if name not in PER_JOB:
            raise ValueError(
                f"expand_grid: {name!r} cannot vary between fused jobs (one of {', '.join(PER_JOB)} can): "
                "jobs of one fused sweep share the base model, the data source and the step count."
            )
        if not isinstance(values, (list, tuple)) or not values:
            raise ValueError(f"expand_grid: {name}={values!r}: give a non-empty list of values.")
    jobs = []
    for combo in itertools.product(*axes.values()):
        data = _plain(base)
        for name, value in zip(axes, combo):
            section, _, key = name.rpartition(".")
            if section:
                data[section] = {**(data.get(section) or {}), key: value}
            else:
                data[name] = value
        jobs.append(FinetuneConfig.from_dict(data, where="the sweep grid"))
    return jobs


def setting(job: FinetuneConfig, name: str):
    """A job's value of a grid setting: a field, a section's (``smt.num_blocks``) or the Trainer's (``seed``)."""
    section, _, key = name.rpartition(".")
    if section:
        return getattr(getattr(job, section), key)
    if name in {f.name for f in dataclasses.fields(job)}:
        return getattr(job, name)
    return getattr(job_args(job), name)


def job_args(job: FinetuneConfig):
    """The job's Trainer settings (``SFTConfig``), as ``hf-dtrain finetune`` would train it."""
    return job.training_args()


def _plain(cfg: FinetuneConfig) -> dict:
    data = dataclasses.asdict(cfg)
    training = data.pop("training")
    return {**{k: v for k, v in data.items() if v is not None or k in PER_JOB}, **training}


def check_fusable(jobs: list[FinetuneConfig]) -> None:
    """Refuse, naming the job and the reason, a list of jobs that cannot be trained as one fused model."""
    first = jobs[0]
    compose_defaults = dataclasses.asdict(ComposeOptions())
    for i, job in enumerate(jobs):
        who = f"job {i} ({job_name(job, jobs, i)})"
        if job.method not in FUSABLE_METHODS:
            reason = NOT_FUSABLE.get(job.method.upper(), "it has no fused form")
            raise ValueError(
                f"{who}: method {job.method!r} cannot be fused: {reason}. Fusable methods: "
                f"{', '.join(FUSABLE_METHODS)}."
            )
        for f in dataclasses.fields(ComposeOptions):
            if dataclasses.asdict(job).get(f.name) != compose_defaults[f.name]:
                raise ValueError(
                    f"{who}: {f.name} is set, but a fused sweep runs its own loop (fused AdamW, one "
                    f"process or DDP over the fused array); leave {f.name} at its default, or run the "
                    "job alone with hf-dtrain finetune."
                )
        unsupported = sorted(set(job.training) - FUSED_TRAINER_SETTINGS)
        if unsupported:
            raise ValueError(
                f"{who}: {', '.join('--' + k.replace('_', '-') for k in unsupported)} given, but the fused "
                "loop takes only these Trainer settings: "
                f"{', '.join(sorted(FUSED_TRAINER_SETTINGS))}; run the job alone with hf-dtrain finetune."
            )
        if job_args(job).gradient_accumulation_steps != 1:
            raise ValueError(
                f"{who}: gradient_accumulation_steps={job_args(job).gradient_accumulation_steps}; the "
                "fused loop takes one micro-batch per job per step: raise per_device_train_batch_size "
                "instead."
            )
        mine, theirs = _settings(job), _settings(first)
        for name in sorted(set(mine) | set(theirs)):
            if name in PER_JOB or name in compose_defaults or mine.get(name) == theirs.get(name):
                continue
            what = (
                "different base models"
                if name in ("model", "base_preset", "base_steps", "quantize", "quant_group_size")
                else "different methods"
                if name == "method"
                else f"a different {name}"
            )
            raise ValueError(
                f"{who}: {what} ({name}={mine.get(name)!r}, job 0 has {theirs.get(name)!r}); fused jobs "
                "share one base model, method, data source, batch size and step count. Split the grid "
                "into one sweep per value."
            )


# the Trainer settings the fused loop honours (each job's own where PER_JOB says so); others are refused
FUSED_TRAINER_SETTINGS = {
    "learning_rate",
    "seed",
    "weight_decay",
    "warmup_steps",
    "max_steps",
    "num_train_epochs",
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "gradient_accumulation_steps",
    "output_dir",
    "logging_steps",
    "disable_tqdm",
    "report_to",
    "max_length",
    "dataset_text_field",
    "completion_only_loss",
    "use_cpu",
}


def _settings(job: FinetuneConfig) -> dict:
    """Every setting of a job by name: its fields, its sections' as ``section.field``, the Trainer's given ones."""
    out = {}
    for f in dataclasses.fields(job):
        value = getattr(job, f.name)
        if f.name == "training":
            out.update(value)
        elif dataclasses.is_dataclass(value):
            out.update({f"{f.name}.{k}": v for k, v in dataclasses.asdict(value).items()})
        else:
            out[f.name] = value
    return out


def max_steps_of(job: FinetuneConfig, train_rows: int, world: int) -> int:
    """The optimizer steps the Trainer would take: ``max_steps``, or the epochs over the sharded loader."""
    args = job_args(job)
    if args.max_steps > 0:
        return args.max_steps
    per_epoch = math.ceil(train_rows / (args.per_device_train_batch_size * world))
    return max(1, math.ceil(args.num_train_epochs * per_epoch))


def job_name(job: FinetuneConfig, jobs: list[FinetuneConfig], index: int) -> str:
    """A name from the settings that vary across the sweep (``lr0p0003-r8-seed1``: no dots, since peft adapter names
    are module names), unique within it."""
    varying = [f for f in AXIS_TYPES if len({setting(j, f) for j in jobs}) > 1]
    short = {
        "learning_rate": "lr",
        "lora_r": "r",
        "lora_alpha": "alpha",
        "lora_dropout": "dropout",
        "weight_decay": "wd",
        "warmup_steps": "warmup",
        "smt.num_blocks": "blocks",
    }

    def label(j):
        return (
            "-".join(
                f"{short.get(f, f)}{setting(j, f):g}".replace(".", "p")
                if isinstance(setting(j, f), float)
                else f"{short.get(f, f)}{setting(j, f)}"
                for f in varying
            )
            or "job"
        )

    same = [i for i, j in enumerate(jobs) if label(j) == label(job)]
    return f"{label(job)}-{same.index(index)}" if len(same) > 1 else label(job)


def _job_loader(job: FinetuneConfig, dataset, collator, world: int, rank: int):
    """The job's micro-batches in the order the Trainer draws them (accelerate's seedable sampler, seeded with the
    job's seed; sharded over the ranks as accelerate shards them), epoch after epoch."""

    loader = DataLoader(
        dataset,
        batch_size=job_args(job).per_device_train_batch_size,
        sampler=RandomSampler(dataset),
        collate_fn=collator,
    )
    loader = prepare_data_loader(
        loader, num_processes=world, process_index=rank, use_seedable_sampler=True, data_seed=job.seed
    )
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def _eval_batches(dataset, collator, batch_size: int = 64) -> list[dict]:
    from torch.utils.data import DataLoader

    return list(DataLoader(dataset, batch_size=batch_size, collate_fn=collator))


def _write_sweep(out_dir: str, rows: list[dict], histories: dict[str, list[float]]) -> None:
    with open(os.path.join(out_dir, "sweep.json"), "w") as f:
        json.dump(dict(jobs=rows, losses=histories), f, indent=2)
    head = (
        "| job | lr | r | seed | status | eval loss | accuracy | train s (group) |\n|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['job']} | {r['learning_rate']:g} | {r['lora_r']} | {r['seed']} | {r['status']} | "
        f"{r['eval_loss_after']:.4f} | {r['accuracy_after']:.3f} | {r['train_seconds']:.1f} |"
        for r in rows
    ]
    with open(os.path.join(out_dir, "sweep.md"), "w") as f:
        f.write(head + "\n".join(lines) + "\n")
    with open(os.path.join(out_dir, "README.md"), "w") as f:  # in place of the card peft writes at the root
        f.write(
            f"# Fused sweep of {len(rows)} {rows[0]['method']} jobs (hf-dtrain sweep)\n\nEach job's adapter, "
            "model card and results are in its own directory.\n\n"
            + head
            + "\n".join(lines)
            + "\n\n![loss curves](sweep.png)\n"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in histories.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("fused sweep: every job's loss")
    if len(histories) <= 16:
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "sweep.png"), dpi=120)
    plt.close(fig)


def run_sweep(cfg: SweepConfig) -> dict:
    """Train ``cfg.jobs`` fused; return ``{"jobs": [row per job], "groups": [...], "memory": {...}}``."""

    jobs = cfg.jobs
    first = jobs[0]
    method = first.method
    names = [job_name(j, jobs, i) for i, j in enumerate(jobs)]
    out_dir = cfg.output_dir or os.path.join("outputs", f"sweep-{method}")
    run = JobRun(first, engine="trainer", check=False)  # the process group under a launcher; no engine to check
    world, rank, main = run.world_size, run.rank, run.is_main
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    )

    # the base model and each seed's data once, as hf-dtrain finetune loads them (rank 0 first: it builds the
    # embedded default; the others read the cache)
    data: dict[int, tuple] = {}
    for job in jobs:  # each seed its own data, as hf-dtrain finetune draws it
        if job.seed in data:
            continue
        with run.main_first():
            loaded = load_base_and_data(job, progress=cfg.progress and main, load_model=False)
        data[job.seed] = (loaded.train, loaded.eval)
    base_path, tokenizer = loaded.base_path, loaded.tokenizer
    collator = tasks.sft_collator(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    base = load_base_model(first, base_path)
    if first.quantize is None:
        base = base.to(device)
    steps = max_steps_of(first, len(data[first.seed][0]), world)

    def build_group(idx: list[int]):
        """The fused model of jobs ``idx`` (each job's adapter built as hf-dtrain finetune builds it)."""
        if method == "full":
            models = []
            for k in idx:
                set_seed(jobs[k].seed)
                models.append(copy.deepcopy(base))
            return fuse_models(models), None

        peft_model = None
        for k in idx:
            set_seed(jobs[k].seed)
            pcfg = FINETUNE_METHODS[method].build_config(
                jobs[k], base if peft_model is None else peft_model.get_base_model()
            )
            if peft_model is None:
                peft_model = get_peft_model(base, pcfg, adapter_name=names[k])
            else:
                peft_model.add_adapter(names[k], pcfg)
            if method == "smt":  # select the job's blocks on its own data before fusing
                from torch.utils.data import DataLoader, DistributedSampler

                from hf_dtrain.tuners.smt import smt_warmup

                peft_model.set_adapter(names[k])
                train_ds = data[jobs[k].seed][0]
                sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=jobs[k].seed)
                loader = DataLoader(
                    train_ds,
                    batch_size=job_args(jobs[k]).per_device_train_batch_size,
                    sampler=sampler,
                    collate_fn=collator,
                )
                smt_warmup(
                    peft_model, loader, num_steps=jobs[k].smt.warmup_steps, adapter_name=names[k], progress=False
                )
        return fuse_adapters(peft_model, [names[k] for k in idx]), peft_model

    def fused_jobs(idx):
        return [
            FusedJob(
                name=names[k],
                learning_rate=_lr(jobs[k]),
                weight_decay=job_args(jobs[k]).weight_decay,
                warmup_steps=int(job_args(jobs[k]).warmup_steps),
                batches=_job_loader(jobs[k], data[jobs[k].seed][0], collator, world, rank),
            )
            for k in idx
        ]

    # memory guard: one job's fused step, measured, before any training
    probe, probe_peft = build_group([0])
    memory = measure_job_bytes(probe, stack_batches([next(fused_jobs([0])[0].batches)], pad_id))
    base = _release(probe, probe_peft, method, base)
    groups = plan_groups(len(jobs), memory["per_job_bytes"], memory["shared_bytes"], cfg.fused)
    memory.update(budget_bytes=cfg.fused.budget_bytes(), groups=len(groups), jobs_per_group=max(len(g) for g in groups))
    if main and len(groups) > 1:
        print(
            f"hf-dtrain sweep: {len(jobs)} jobs do not fit at once; {len(groups)} fused groups of up to "
            f"{memory['jobs_per_group']} jobs run one after another.",
            flush=True,
        )

    rows: list[dict | None] = [None] * len(jobs)
    histories: dict[str, list[float]] = {}
    os.makedirs(out_dir, exist_ok=True)
    for gi, idx in enumerate(groups):
        fused, peft_model = build_group(idx)
        trainer = FusedTrainer(
            fused,
            fused_jobs(idx),
            steps,
            cfg.fused,
            pad_id=pad_id,
            optimizer_rule="lorafa" if method == "lorafa" and first.lorafa.optimizer else "adamw",
        )
        evals = [_eval_batches(data[jobs[k].seed][1], collator) for k in idx]
        before = trainer.evaluate(evals)
        t0 = time.perf_counter()
        trainer.train(
            progress=cfg.progress and main,
            desc=f"fused {method} x{len(idx)}" + (f" (group {gi + 1}/{len(groups)})" if len(groups) > 1 else ""),
        )
        seconds = time.perf_counter() - t0
        after = trainer.evaluate(evals)
        for pos, k in enumerate(idx):
            stopped = trainer.stopped.get(pos)
            losses = [row[pos] for row in trainer.history]
            histories[names[k]] = losses
            rows[k] = _result_row(
                jobs[k],
                names[k],
                base_path,
                memory,
                before[pos],
                after[pos],
                seconds,
                losses,
                stopped,
                world,
                out_dir,
                steps,
            )
        if peft_model is not None:
            fused.unfuse()  # every job's values into its peft adapter, peft's layers back in place
        if main:
            _save_group(fused, peft_model, idx, jobs, names, rows, out_dir, tokenizer, method, base)
        base = _release(fused, peft_model, method, base)
    if main:
        _write_sweep(out_dir, rows, histories)
        if cfg.report:
            with open(os.path.join(out_dir, "sweep.md")) as f:
                print(f.read(), flush=True)
    return dict(jobs=rows, groups=groups, memory=memory, output_dir=out_dir)


def _lr(job: FinetuneConfig) -> float:
    return job_args(job).learning_rate


def _release(fused, peft_model, method, base):
    """Undo a group's fusion and adapters; return the clean base model for the next group."""
    if method == "full":
        return base
    fused.unfuse()  # a no-op when the group was already unfused for saving
    return peft_model.unload()


def _result_row(job, name, base_path, memory, before, after, seconds, losses, stopped, world, out_dir, steps) -> dict:
    trainable = memory["trainable_bytes"] // 4
    args = job_args(job)
    return dict(
        job=name,
        method=job.method,
        status="ok" if stopped is None else f"stopped at step {stopped['step']}: {stopped['reason']}",
        learning_rate=_lr(job),
        lora_r=job.lora_r,
        lora_alpha=job.lora_alpha,
        seed=job.seed,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        base_model=job.model or f"hf_dtrain default ({job.base_preset})",
        base_path=base_path,
        quantize=job.quantize,
        dataset=job.dataset or "default addition task (hf_dtrain.tasks)",
        eval_loss_before=before["eval_loss"],
        eval_loss_after=after["eval_loss"],
        accuracy_before=before["accuracy"],
        accuracy_after=after["accuracy"],
        train_loss=float(sum(v for v in losses if v == v) / max(1, sum(1 for v in losses if v == v))),
        losses={i + 1: v for i, v in enumerate(losses)},
        train_seconds=seconds,
        trainable_params=trainable,
        total_params=memory["shared_bytes"] // 4 + trainable,
        trainable_pct=100.0 * trainable / max(1, memory["shared_bytes"] // 4 + trainable),
        max_steps=steps,
        per_device_train_batch_size=args.per_device_train_batch_size,
        world_size=world,
        output_dir=os.path.join(out_dir, name),
        engine="fused (hf_dtrain.fused)",
        config=dataclasses.asdict(job),
    )


def _save_group(fused, peft_model, idx, jobs, names, rows, out_dir, tokenizer, method, base) -> None:

    for pos, k in enumerate(idx):
        job_dir = os.path.join(out_dir, names[k])
        if rows[k]["status"] != "ok":  # a diverged job: its row says why; no weights are written
            os.makedirs(job_dir, exist_ok=True)
        elif method == "full":
            model = fused.export(pos, copy.deepcopy(base))
            model.save_pretrained(job_dir)
            tokenizer.save_pretrained(job_dir)
        else:
            # peft writes a non-default adapter to <dir>/<adapter name>/: the job's own directory
            peft_model.save_pretrained(out_dir, selected_adapters=[names[k]])
        write_model_card(job_dir, rows[k], jobs[k].model or f"hf_dtrain/default-{jobs[k].base_preset}")
        with open(os.path.join(job_dir, "results.json"), "w") as f:
            json.dump(rows[k], f, indent=2)
