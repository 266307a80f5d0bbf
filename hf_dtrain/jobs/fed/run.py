"""The federated job's run: the federation built from the job, trained round by round, and its report."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os

import torch
from peft import get_peft_model
from transformers import set_seed

from hf_dtrain import tasks
from hf_dtrain.checkpoints import describe
from hf_dtrain.federated import FederatedConfig, FederatedSimulation, dirichlet_split
from hf_dtrain.jobs.sft.config import DEFAULT_TASK_TRAIN_SIZE, FinetuneJob
from hf_dtrain.jobs.sft.data import load_base_and_data
from hf_dtrain.run.job import JobRun

from .config import FedSimulateConfig, config_from_args


def _labels(job: FinetuneJob, dataset) -> list | None:
    if job.dataset is None:
        pairs = tasks.addition_examples(
            job.train_size or DEFAULT_TASK_TRAIN_SIZE,
            seed=job.seed,
            split="train",
            digits=job.task_digits or tasks.TASK_DIGITS,
        )
        return [p[0][0] for p in pairs]  # the first operand's leading digit: clients see different numbers
    for column in ("label", "source"):
        if column in getattr(dataset, "column_names", []):
            return list(dataset[column])
    return None


def build_federation(cfg: FedSimulateConfig, run: JobRun | None = None):
    """``(peft model, tokenizer, client datasets, collator, eval function, base path)`` as the job builds them (with
    ``run``, rank 0 first: it builds the embedded default base; the others read the cache)."""
    job, fed = cfg.job, cfg.fed
    with run.main_first() if run is not None else contextlib.nullcontext():
        data = load_base_and_data(job, progress=job.progress and (run is None or run.is_main))
    model, tokenizer, base_path, train, evalset = data.model, data.tokenizer, data.base_path, data.train, data.eval
    labels = _labels(job, train)
    split = dirichlet_split(
        labels if labels is not None else [0] * len(train),
        fed.clients,
        fed.dirichlet_alpha if labels is not None else None,
        seed=fed.seed,
    )
    clients = [train.select(idx) for idx in split]
    collator = tasks.sft_collator(tokenizer)
    set_seed(job.seed)
    model = get_peft_model(model, job.build_peft_config(model))
    eval_batches = [
        collator([evalset[i] for i in range(s, min(s + 64, len(evalset)))]) for s in range(0, len(evalset), 64)
    ]

    @torch.no_grad()
    def evaluate(m) -> float:
        m.eval()
        total, rows = 0.0, 0
        for b in eval_batches:
            total += float(m(**b).loss) * len(b["input_ids"])
            rows += len(b["input_ids"])
        return total / rows

    return model, tokenizer, clients, collator, evaluate, base_path


def client_config(cfg: FedSimulateConfig) -> FederatedConfig:
    """The federation's settings with the job's learning rate as the clients' when only the job gives one."""
    fed = cfg.fed
    if fed.client_lr == FederatedConfig().client_lr and "learning_rate" in cfg.job.training:
        fed = dataclasses.replace(fed, client_lr=cfg.job.training["learning_rate"])
    return fed


def run_fed_simulate(cfg: FedSimulateConfig) -> dict:
    job = cfg.job
    run = JobRun(job)  # the process group under a launcher (its own loop: the engine sections are refused)
    rank = run.rank
    out_dir = job.training.get("output_dir") or os.path.join("outputs", f"fed-{job.method}")
    model, tokenizer, clients, collator, evaluate, _base_path = build_federation(cfg, run)
    fed = client_config(cfg)
    sim = FederatedSimulation(
        model, clients, collator, fed, state_dir=os.path.join(out_dir, "client_states"), eval_fn=evaluate
    )
    history = sim.run(progress=job.progress)
    result = dict(
        method=job.method,
        base_model=describe(job.model, job.gguf_file, job.base_preset),
        config=dict(job=dataclasses.asdict(job), fed=dataclasses.asdict(fed)),
        rounds=history,
        client_sizes=[len(c) for c in clients],
        uplink_bytes=sum(h["uplink_bytes"] for h in history),
        eval_loss_final=history[-1].get("eval_loss"),
        processes=sim.world,
    )
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        with open(os.path.join(out_dir, "fed.json"), "w") as f:
            json.dump(result, f, indent=2)
        _write_report(out_dir, history, job.report)
    return result


def _write_report(out_dir: str, history: list[dict], report: bool) -> None:
    head = "| round | trained | failed | uplink MB | train loss | eval loss |\n|---|---|---|---|---|---|\n"
    lines = [
        f"| {h['round']} | {h['trained']} | {','.join(map(str, h['failed'])) or '-'} | "
        f"{h['uplink_bytes'] / 1e6:.3f} | {h['train_loss']:.4f} | {h.get('eval_loss', float('nan')):.4f} |"
        for h in history
    ]
    table = head + "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "fed.md"), "w") as f:
        f.write(table)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    rounds = [h["round"] for h in history]
    a.plot(rounds, [h.get("eval_loss") for h in history], "o-")
    a.set_xlabel("round")
    a.set_ylabel("eval loss (global adapter)")
    b.bar(rounds, [h["uplink_bytes"] / 1e6 for h in history])
    b.set_xlabel("round")
    b.set_ylabel("uplink MB")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "fed.png"), dpi=120)
    plt.close(fig)
    if report:
        print(table, flush=True)


def main(ns: argparse.Namespace) -> int:
    run_fed_simulate(config_from_args(ns))
    return 0
