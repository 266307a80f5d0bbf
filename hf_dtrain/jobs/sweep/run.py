"""The sweep's run: the jobs trained fused in groups that fit, each saved as its own peft adapter."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import time

import torch
from accelerate.data_loader import prepare_data_loader
from peft import get_peft_model
from torch.utils.data import DataLoader, RandomSampler
from transformers import set_seed

from hf_dtrain import tasks
from hf_dtrain.checkpoints import describe
from hf_dtrain.errors import RunFailure
from hf_dtrain.fused import FusedJob, FusedTrainer, measure_job_bytes, plan_groups, stack_batches
from hf_dtrain.fused.fuse import fuse_adapters, fuse_models
from hf_dtrain.jobs.sft.config import FinetuneJob
from hf_dtrain.jobs.sft.data import load_base_and_data, load_base_model
from hf_dtrain.jobs.sft.model_card import write_model_card
from hf_dtrain.run.job import JobRun
from hf_dtrain.tuners.finetune_method import WHOLE_MODEL, MethodData

from .config import SweepConfig, config_from_args, job_args, job_name, max_steps_of


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
            write_model_card(job_dir, row, describe(job.model, job.gguf_file, job.base_preset))
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
        base_model=describe(job.model, job.gguf_file, job.base_preset),
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
