"""``hf-dtrain sweep``: a grid of ``hf-dtrain finetune`` jobs trained fused (HFTA) on one base model.

``run_sweep(SweepConfig(jobs=expand_grid(FinetuneConfig(method=..., ...), learning_rate=[1e-4, 3e-4],
lora_r=[8, 16], seed=[0, 1])))`` trains the K jobs as one model (:mod:`hf_dtrain.fused`): the frozen base runs once
per step for all of them, each job keeps its own adapter, rank, alpha, learning rate, schedule, seed (adapter init,
data and data order) and optimizer state. Each job is exactly a :class:`~hf_dtrain.jobs.sft.config.FinetuneJob`: alone,
``hf-dtrain finetune`` with the same settings trains the same adapter. Each job gets a standard peft adapter
directory with a model card and ``results.json`` under ``<output_dir>/<job>/``; the sweep writes ``sweep.json``,
``sweep.md`` (one row per job) and ``sweep.png`` (every job's loss curve).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import math
import os
import time
from dataclasses import dataclass

import torch
from accelerate.data_loader import prepare_data_loader
from peft import get_peft_model
from torch.utils.data import DataLoader, RandomSampler
from transformers import set_seed

from hf_dtrain import tasks
from hf_dtrain.errors import RunFailure
from hf_dtrain.fused import FusedConfig, FusedJob, FusedTrainer, measure_job_bytes, plan_groups, stack_batches
from hf_dtrain.fused.fuse import fuse_adapters, fuse_models
from hf_dtrain.jobs.sft.config import FinetuneJob, finetune_config_class
from hf_dtrain.jobs.sft.data import load_base_and_data, load_base_model
from hf_dtrain.jobs.sft.model_card import write_model_card
from hf_dtrain.run.flags import add_config_arguments, add_job_arguments, args_to_data, flag_of, list_of, load_recipe
from hf_dtrain.run.job import JobRun
from hf_dtrain.settings import SettingsError, merge, setting
from hf_dtrain.tuners.finetune_method import FINETUNE_METHODS, WHOLE_MODEL, MethodData


def fusable_methods() -> list[str]:
    """The registered methods that train fused (their form, or a whole model's copies)."""
    return [name for name, m in FINETUNE_METHODS.items() if m.fused is not None and not _refused(m)]


def _refused(method) -> bool:
    return isinstance(method.fused, str) and method.fused != WHOLE_MODEL


# settings a job may set for itself (FinetuneConfig fields, the Trainer's settings in its `training`, and what each
# method declares of its own section: FinetuneMethod.sweep_settings); every other setting must be the same for all
# jobs of a sweep
SHARED_PER_JOB = (
    "learning_rate",
    "seed",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "weight_decay",
    "warmup_steps",
    "output_dir",
    "logging_steps",
    "report",
    "progress",
    "disable_tqdm",
)
# the grid's axes on the command line (--lr 1e-4,3e-4 --r 8,16 --alpha 16 --seed 0,1 ...) -> (setting, type, label)
SHARED_AXES = {
    "lr": ("learning_rate", float, "lr"),
    "r": ("lora_r", int, "r"),
    "alpha": ("lora_alpha", int, "alpha"),
    "seed": ("seed", int, "seed"),
    "dropout": ("lora_dropout", float, "dropout"),
    "weight_decay": ("weight_decay", float, "wd"),
    "warmup_steps": ("warmup_steps", int, "warmup"),
}


def per_job() -> tuple[str, ...]:
    own = (f"{m.name}.{s}" for m in FINETUNE_METHODS.values() for s in m.sweep_settings)
    return (*SHARED_PER_JOB, *own)


def grid_axes() -> dict[str, tuple[str, type, str]]:
    """Every grid axis: its short name on the command line -> (the setting, its type, its label in job names); the
    methods' own (``<method>_<setting>`` -> ``<method>.<setting>``) from their registrations."""
    out = dict(SHARED_AXES)
    for m in FINETUNE_METHODS.values():
        for name, (kind, label) in m.sweep_axes.items():
            out[f"{m.name}_{name}"] = (f"{m.name}.{name}", kind, label)
    return out


def axis_types() -> dict[str, type]:
    return {name: kind for name, kind, _ in grid_axes().values()}


@dataclass
class SweepConfig:
    """A fused sweep: its jobs (each a full ``FinetuneConfig``) and how they are fused."""

    jobs: list = setting(help="The jobs (FinetuneConfig each); see expand_grid.", factory=list)
    fused: FusedConfig = setting(help="How the jobs are fused.", factory=FusedConfig)
    output_dir: str | None = setting(
        None, "Where the jobs' directories and the sweep table go; default outputs/sweep-<method>."
    )
    progress: bool = setting(True, "Show the progress bar (per-job losses).")
    report: bool = setting(True, "Print the sweep table.")

    def __post_init__(self):
        if isinstance(self.fused, dict):
            from hf_dtrain.settings import build

            self.fused = build(FusedConfig, self.fused, where="SweepConfig.fused")
        jobs = []
        for i, j in enumerate(self.jobs):
            if isinstance(j, dict):
                j = finetune_config_class().from_dict(j, where=f"SweepConfig.jobs[{i}]")
            if not isinstance(j, FinetuneJob):
                raise TypeError(
                    f"SweepConfig.jobs[{i}] is a {type(j).__name__}; give FinetuneConfig objects "
                    "(or mappings of its fields)."
                )
            jobs.append(j)
        self.jobs = jobs
        if not self.jobs:
            raise SettingsError(
                "SweepConfig.jobs is empty: give at least one job (expand_grid, or --lr/--r/--seed "
                "lists, or --recipes)."
            )
        check_fusable(self.jobs)


def expand_grid(base: FinetuneJob, **axes) -> list[FinetuneJob]:
    """The cartesian product of ``axes`` (FinetuneConfig field -> list of values) over ``base``, in the order given
    (the last axis varies fastest)."""
    for name, values in axes.items():
        if name not in per_job():
            raise SettingsError(
                f"expand_grid: {name!r} cannot vary between fused jobs (one of {', '.join(per_job())} can): "
                "jobs of one fused sweep share the base model, the data source and the step count."
            )
        if not isinstance(values, (list, tuple)) or not values:
            raise SettingsError(f"expand_grid: {name}={values!r}: give a non-empty list of values.")
    jobs = []
    for combo in itertools.product(*axes.values()):
        data = _plain(base)
        for name, value in zip(axes, combo):
            section, _, key = name.rpartition(".")
            if section:
                data[section] = {**(data.get(section) or {}), key: value}
            else:
                data[name] = value
        jobs.append(finetune_config_class().from_dict(data, where="the sweep grid"))
    return jobs


def job_setting(job: FinetuneJob, name: str):
    """A job's value of a grid setting: a field, a section's (``<method>.<setting>``) or the Trainer's (``seed``)."""
    section, _, key = name.rpartition(".")
    if section:
        return getattr(getattr(job, section), key)
    if name in {f.name for f in dataclasses.fields(job)}:
        return getattr(job, name)
    return getattr(job_args(job), name)


def job_args(job: FinetuneJob):
    """The job's Trainer settings (``SFTConfig``), as ``hf-dtrain finetune`` would train it."""
    return job.training_args()


def _plain(cfg: FinetuneJob) -> dict:
    data = dataclasses.asdict(cfg)
    training = data.pop("training")
    return {**{k: v for k, v in data.items() if v is not None or k in per_job()}, **training}


def check_fusable(jobs: list[FinetuneJob]) -> None:
    """Refuse, naming the job and the reason, a list of jobs that cannot be trained as one fused model."""
    first = jobs[0]
    for i, job in enumerate(jobs):
        who = f"job {i} ({job_name(job, jobs, i)})"
        try:
            job.method_entry.fused_form()
        except ValueError as e:
            raise SettingsError(f"{who}: {e}. Fusable methods: {', '.join(fusable_methods())}.") from None
        for name in job.engine_settings_given():
            raise SettingsError(
                f"{who}: {name} is set, but a fused sweep runs its own loop (fused AdamW, one process or DDP over the "
                f"fused array); leave {name} at its default, or run the job alone with hf-dtrain finetune."
            )
        unsupported = sorted(set(job.training) - FUSED_TRAINER_SETTINGS)
        if unsupported:
            raise SettingsError(
                f"{who}: {', '.join('--' + k.replace('_', '-') for k in unsupported)} given, but the fused "
                "loop takes only these Trainer settings: "
                f"{', '.join(sorted(FUSED_TRAINER_SETTINGS))}; run the job alone with hf-dtrain finetune."
            )
        if job_args(job).gradient_accumulation_steps != 1:
            raise SettingsError(
                f"{who}: gradient_accumulation_steps={job_args(job).gradient_accumulation_steps}; the "
                "fused loop takes one micro-batch per job per step: raise per_device_train_batch_size "
                "instead."
            )
        mine, theirs = _settings(job), _settings(first)
        for name in sorted(set(mine) | set(theirs)):
            if name in per_job() or mine.get(name) == theirs.get(name):
                continue
            what = (
                "different base models"
                if name in ("model", "base_preset", "base_steps", "quantize", "quant_group_size")
                else "different methods"
                if name == "method"
                else f"a different {name}"
            )
            raise SettingsError(
                f"{who}: {what} ({name}={mine.get(name)!r}, job 0 has {theirs.get(name)!r}); fused jobs "
                "share one base model, method, data source, batch size and step count. Split the grid "
                "into one sweep per value."
            )


# the Trainer settings the fused loop honours (each job's own where per_job() says so); others are refused
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


def _settings(job: FinetuneJob) -> dict:
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


def max_steps_of(job: FinetuneJob, train_rows: int, world: int) -> int:
    """The optimizer steps the Trainer would take: ``max_steps``, or the epochs over the sharded loader."""
    args = job_args(job)
    if args.max_steps > 0:
        return args.max_steps
    per_epoch = math.ceil(train_rows / (args.per_device_train_batch_size * world))
    return max(1, math.ceil(args.num_train_epochs * per_epoch))


def job_name(job: FinetuneJob, jobs: list[FinetuneJob], index: int) -> str:
    """A name from the settings that vary across the sweep (``lr0p0003-r8-seed1``: no dots, since peft adapter names
    are module names), unique within it."""
    varying = [(f, short) for f, _, short in grid_axes().values() if len({job_setting(j, f) for j in jobs}) > 1]

    def label(j):
        return (
            "-".join(
                f"{short}{job_setting(j, f):g}".replace(".", "p")
                if isinstance(job_setting(j, f), float)
                else f"{short}{job_setting(j, f)}"
                for f, short in varying
            )
            or "job"
        )

    same = [i for i, j in enumerate(jobs) if label(j) == label(job)]
    return f"{label(job)}-{same.index(index)}" if len(same) > 1 else label(job)


def _job_loader(job: FinetuneJob, dataset, collator, world: int, rank: int):
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
    sweep = _Sweep(cfg)
    groups, memory = sweep.plan()
    for gi, idx in enumerate(groups):
        sweep.train_group(idx, f" (group {gi + 1}/{len(groups)})" if len(groups) > 1 else "")
    if sweep.run.is_main:
        _write_sweep(sweep.out_dir, sweep.rows, sweep.histories)
        if cfg.report:
            with open(os.path.join(sweep.out_dir, "sweep.md")) as f:
                print(f.read(), flush=True)
    return dict(jobs=sweep.rows, groups=groups, memory=memory, output_dir=sweep.out_dir)


class _Sweep:
    """One sweep's shared parts: the process group, each seed's data, the base model, the jobs' names; and how a
    group of jobs is built fused (each job's adapter as ``hf-dtrain finetune`` builds it, the method's prepare step on
    its own data), trained, saved and released."""

    def __init__(self, cfg: SweepConfig) -> None:
        self.cfg, self.jobs = cfg, cfg.jobs
        first = self.jobs[0]
        self.method = first.method_entry
        self.names = [job_name(j, self.jobs, i) for i, j in enumerate(self.jobs)]
        self.out_dir = cfg.output_dir or os.path.join("outputs", f"sweep-{first.method}")
        self.run = JobRun(first)  # the process group under a launcher (the engine sections are refused)
        world = self.run.world_size
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
        # the base model and each seed's data once, as hf-dtrain finetune loads them (rank 0 first: it builds the
        # embedded default; the others read the cache)
        self.data: dict[int, tuple] = {}
        for job in self.jobs:  # each seed its own data, as hf-dtrain finetune draws it
            if job.seed not in self.data:
                with self.run.main_first():
                    loaded = load_base_and_data(job, progress=cfg.progress and self.run.is_main, load_model=False)
                self.data[job.seed] = (loaded.train, loaded.eval)
        self.base_path, self.tokenizer = loaded.base_path, loaded.tokenizer
        self.collator = tasks.sft_collator(self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.base = load_base_model(first, self.base_path)
        if first.quantize is None:
            self.base = self.base.to(device)
        self.steps = max_steps_of(first, len(self.data[first.seed][0]), world)
        self.rows: list[dict | None] = [None] * len(self.jobs)
        self.histories: dict[str, list[float]] = {}
        self.memory: dict = {}

    @property
    def whole_model(self) -> bool:
        return self.method.fused == WHOLE_MODEL

    def build_group(self, idx: list[int]):
        """The fused model of jobs ``idx``, and the peft model holding their adapters (None for whole models)."""
        jobs, base = self.jobs, self.base
        if self.whole_model:
            models = []
            for k in idx:
                set_seed(jobs[k].seed)
                models.append(copy.deepcopy(base))
            return fuse_models(models), None
        peft_model = None
        for k in idx:
            set_seed(jobs[k].seed)
            pcfg = jobs[k].build_peft_config(base if peft_model is None else peft_model.get_base_model())
            if peft_model is None:
                peft_model = get_peft_model(base, pcfg, adapter_name=self.names[k])
            else:
                peft_model.add_adapter(self.names[k], pcfg)
            if self.method.prepare is not None:  # the job's own data (a method that selects what trains)
                self.method.prepare(peft_model, jobs[k].method_settings, self._method_data(k))
        return fuse_adapters(peft_model, [self.names[k] for k in idx]), peft_model

    def _method_data(self, k: int) -> MethodData:
        job = self.jobs[k]
        return MethodData(
            train=self.data[job.seed][0],
            collator=self.collator,
            batch_size=job_args(job).per_device_train_batch_size,
            seed=job.seed,
            world_size=self.run.world_size,
            rank=self.run.rank,
            wrapped=True,  # fused: shapes are fixed from here on
            adapter_name=self.names[k],
            progress=False,
        )

    def fused_jobs(self, idx):
        return [
            FusedJob(
                name=self.names[k],
                learning_rate=_lr(self.jobs[k]),
                weight_decay=job_args(self.jobs[k]).weight_decay,
                warmup_steps=int(job_args(self.jobs[k]).warmup_steps),
                batches=_job_loader(self.jobs[k], self.data[self.jobs[k].seed][0], self.collator, *self._world()),
            )
            for k in idx
        ]

    def _world(self) -> tuple[int, int]:
        return self.run.world_size, self.run.rank

    def plan(self):
        """The memory guard: one job's fused step, measured before any training, and the groups that fit."""
        probe, probe_peft = self.build_group([0])
        batch = stack_batches([next(self.fused_jobs([0])[0].batches)], self.pad_id)
        memory = self.memory = measure_job_bytes(probe, batch)
        self.base = self._release(probe, probe_peft)
        groups = plan_groups(len(self.jobs), memory["per_job_bytes"], memory["shared_bytes"], self.cfg.fused)
        memory.update(
            budget_bytes=self.cfg.fused.budget_bytes(), groups=len(groups), jobs_per_group=max(len(g) for g in groups)
        )
        if self.run.is_main and len(groups) > 1:
            print(
                f"hf-dtrain sweep: {len(self.jobs)} jobs do not fit at once; {len(groups)} fused groups of up to "
                f"{memory['jobs_per_group']} jobs run one after another.",
                flush=True,
            )
        return groups, memory

    def optimizer_rule(self) -> str:
        """FusedAdamW's rule: the method's own (LoRA-FA's) while its own optimizer is on, else AdamW's."""
        first = self.jobs[0]
        form = self.method.fused
        own = not self.whole_model and self.method.owns_optimizer(first.method_settings)
        return getattr(form, "optimizer_rule", "adamw") if own else "adamw"

    def train_group(self, idx: list[int], which: str) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        fused, peft_model = self.build_group(idx)
        trainer = FusedTrainer(
            fused,
            self.fused_jobs(idx),
            self.steps,
            self.cfg.fused,
            pad_id=self.pad_id,
            optimizer_rule=self.optimizer_rule(),
        )
        evals = [_eval_batches(self.data[self.jobs[k].seed][1], self.collator) for k in idx]
        before = trainer.evaluate(evals)
        t0 = time.perf_counter()
        desc = f"fused {self.jobs[0].method} x{len(idx)}{which}"
        trainer.train(progress=self.cfg.progress and self.run.is_main, desc=desc)
        seconds = time.perf_counter() - t0
        after = trainer.evaluate(evals)
        for pos, k in enumerate(idx):
            losses = [row[pos] for row in trainer.history]
            self.histories[self.names[k]] = losses
            self.rows[k] = _result_row(
                self.jobs[k],
                self.names[k],
                self.base_path,
                self.memory,
                before[pos],
                after[pos],
                seconds,
                losses,
                trainer.stopped.get(pos),
                self.run.world_size,
                self.out_dir,
                self.steps,
            )
        if peft_model is not None:
            fused.unfuse()  # every job's values into its peft adapter, peft's layers back in place
        if self.run.is_main:
            self._save_group(fused, peft_model, idx)
        self.base = self._release(fused, peft_model)

    def _release(self, fused, peft_model):
        """Undo a group's fusion and adapters; return the clean base model for the next group."""
        if self.whole_model:
            return self.base
        fused.unfuse()  # a no-op when the group was already unfused for saving
        return peft_model.unload()

    def _save_group(self, fused, peft_model, idx) -> None:
        for pos, k in enumerate(idx):
            job, row = self.jobs[k], self.rows[k]
            job_dir = os.path.join(self.out_dir, self.names[k])
            if row["status"] != "ok":  # a diverged job: its row says why; no weights are written
                os.makedirs(job_dir, exist_ok=True)
            elif self.whole_model:
                model = fused.export(pos, copy.deepcopy(self.base))
                model.save_pretrained(job_dir)
                self.tokenizer.save_pretrained(job_dir)
            else:
                # peft writes a non-default adapter to <dir>/<adapter name>/: the job's own directory
                peft_model.save_pretrained(self.out_dir, selected_adapters=[self.names[k]])
            write_model_card(job_dir, row, job.model or f"hf_dtrain/default-{job.base_preset}")
            with open(os.path.join(job_dir, "results.json"), "w") as f:
                json.dump(row, f, indent=2)


def _lr(job: FinetuneJob) -> float:
    return job_args(job).learning_rate


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


# ---- hf-dtrain sweep's command line ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hf-dtrain finetune``'s flags (the settings every job shares), the grid's axes as comma-separated lists
    (``--lr 1e-4,3e-4 --r 8,16 --seed 0,1``), ``--recipes`` (one job per YAML) and ``--fused.*`` (FusedConfig)."""
    FinetuneConfig = finetune_config_class()
    add_job_arguments(parser, FinetuneConfig)
    grid = parser.add_argument_group("the grid (comma-separated values; every combination is one job)")
    for short, (name, kind, _) in grid_axes().items():
        flags = [flag_of(name)] + ([flag_of(short)] if short != name else [])
        grid.add_argument(
            *flags,
            dest=f"grid.{name}",
            type=list_of(kind),
            default=argparse.SUPPRESS,
            metavar="V[,V...]",
            help=f"Values of {name}, one job each.",
        )
    grid.add_argument(
        "--recipes",
        dest="grid.recipes",
        type=list_of(str),
        default=argparse.SUPPRESS,
        metavar="A.yaml[,B.yaml...]",
        help="One job per finetune recipe (the grid's axes then expand each); flags given here apply to all.",
    )
    add_config_arguments(parser, FusedConfig, "fused", f"fused (FusedConfig, {FusedConfig.__module__})")


def config_from_args(ns: argparse.Namespace) -> SweepConfig:
    """The ``SweepConfig`` of ``hf-dtrain sweep``'s arguments. A recipe (``--recipe``, or each of ``--recipes``) holds
    finetune fields, and optionally ``grid:`` (axis -> list of values) and ``fused:`` (FusedConfig) mappings; flags
    given on the command line win, field by field (a grid axis flag replaces that axis)."""
    FinetuneConfig = finetune_config_class()
    axes_by_short = {short: name for short, (name, _, _) in grid_axes().items()}
    given = vars(ns)
    flag_axes = {k.split(".", 1)[1]: v for k, v in given.items() if k.startswith("grid.") and k != "grid.recipes"}
    flag_fused = {k.split(".", 1)[1]: v for k, v in given.items() if k.startswith("fused.")}
    shared = argparse.Namespace(
        **{k: v for k, v in given.items() if not k.startswith(("grid.", "fused.")) and k != "recipe"}
    )
    jobs, fused = [], {}
    for path in given.get("grid.recipes") or [given.get("recipe")]:
        data = load_recipe(path) if path else {}
        grid = data.pop("grid", None) or {}
        if not isinstance(grid, dict):
            raise SettingsError(f"recipe {path}: grid must be a mapping of axis -> list of values.")
        unknown = [k for k in grid if k not in axes_by_short and k not in axes_by_short.values()]
        if unknown:
            raise SettingsError(f"recipe {path}: grid axes {unknown} are unknown; use {sorted(axes_by_short)}.")
        axes = {axes_by_short.get(k, k): (v if isinstance(v, list) else [v]) for k, v in grid.items()}
        axes.update(flag_axes)
        fused = {**(data.pop("fused", None) or {}), **fused}
        where = f"recipe {path}" if path else "FinetuneConfig"
        base = FinetuneConfig.from_dict(merge(data, args_to_data(shared, FinetuneConfig), FinetuneConfig), where=where)
        jobs += expand_grid(base, **axes)
    base = jobs[0]
    return SweepConfig(
        jobs=jobs,
        fused={**fused, **flag_fused},
        output_dir=base.training.get("output_dir"),
        progress=base.progress,
        report=base.report,
    )


def main(ns: argparse.Namespace) -> int:
    """``hf-dtrain sweep``: the jobs that did not finish are named at the end (the others trained and were saved)."""
    cfg = config_from_args(ns)
    stopped = [r for r in run_sweep(cfg)["jobs"] if r["status"] != "ok"]
    if stopped:
        raise RunFailure(
            f"{len(stopped)} of {len(cfg.jobs)} jobs did not finish: "
            + "; ".join(f"{os.path.basename(r['output_dir'])} {r['status']}" for r in stopped)
            + f". The other jobs trained and were saved under {cfg.output_dir} (sweep.md has every row)."
        )
    return 0
