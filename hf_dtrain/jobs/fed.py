"""``hf-dtrain fed simulate``: a federated fine-tuning run simulated on the launched processes (FedML Parrot-style).

``run_fed_simulate(FedSimulateConfig(job=FinetuneConfig(method=...), fed=FederatedConfig(clients=100)))``: the
base model and the task as ``hf-dtrain finetune`` builds them, the training set split over the clients (Dirichlet over
the task's labels: for the default addition task, the first digit of the first operand; for a dataset, its ``label``
or ``source`` column when it has one), the peft adapter as the payload, and one row per round: the clients sampled
and trained, those that failed, uplink bytes, train loss and eval loss of the global adapter. Writes the final
adapter (a standard peft directory), ``fed.json``, ``fed.md`` and ``fed.png`` (eval loss and uplink bytes per round).
Under ``torchrun`` / ``accelerate launch`` the processes share the clients; the client states live under
``<output_dir>/client_states`` (owner-only).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
from dataclasses import dataclass

import torch
from peft import get_peft_model
from transformers import set_seed

from hf_dtrain import tasks
from hf_dtrain.federated import FederatedConfig, FederatedSimulation, dirichlet_split
from hf_dtrain.jobs.sft.config import DEFAULT_TASK_TRAIN_SIZE, FinetuneJob, finetune_config_class
from hf_dtrain.jobs.sft.data import load_base_and_data
from hf_dtrain.run.flags import add_config_arguments, add_job_arguments, args_to_data, load_recipe
from hf_dtrain.run.job import JobRun
from hf_dtrain.settings import SettingsError, build, merge, setting
from hf_dtrain.tuners.finetune_method import FINETUNE_METHODS


def fed_methods() -> list[str]:
    """The methods whose adapter can be the payload: every registered one that trains a peft adapter."""
    return [name for name, m in FINETUNE_METHODS.items() if m.peft_type is not None]


@dataclass
class FedSimulateConfig:
    """A federated simulation: the model / method / data settings of a finetune job, and the federation."""

    job: FinetuneJob = setting(
        help="Base model, method, rank and data, as hf-dtrain finetune takes them (its engine sections are refused).",
        factory=lambda: finetune_config_class()(),
    )
    fed: FederatedConfig = setting(help="The federation.", factory=FederatedConfig)

    def __post_init__(self):
        if self.job.method not in fed_methods():
            raise SettingsError(
                f"method={self.job.method!r}: the federated payload is a peft adapter; use one of "
                f"{', '.join(fed_methods())}."
            )
        for name in self.job.engine_settings_given():
            raise SettingsError(
                f"{name} is set, but hf-dtrain fed simulate runs its own loop (clients trained one after another, "
                f"Parrot's aggregation); leave {name} at its default."
            )
        unsupported = sorted(set(self.job.training) - FED_TRAINER_SETTINGS)
        if unsupported:
            raise SettingsError(
                f"{', '.join('--' + k.replace('_', '-') for k in unsupported)} given, but hf-dtrain fed "
                "simulate runs its own client loop (--fed.* sets it) and takes only these Trainer "
                f"settings: {', '.join(sorted(FED_TRAINER_SETTINGS))}."
            )


# the Trainer settings the federation honours: the data's preparation, the seed, the clients' learning rate (when
# --fed.client-lr is not given), where it writes; the others are refused rather than ignored
FED_TRAINER_SETTINGS = {
    "learning_rate",
    "seed",
    "output_dir",
    "max_length",
    "truncation_mode",
    "dataset_text_field",
    "completion_only_loss",
    "assistant_only_loss",
    "chat_template_path",
    "report_to",
    "disable_tqdm",
    "logging_steps",
    "use_cpu",
}


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
        base_model=job.model or f"hf_dtrain default ({job.base_preset})",
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


# ---- hf-dtrain fed simulate's command line ---------------------------------------------------------------------------

FED_SHORT = {
    "clients": "clients",
    "per-round": "per_round",
    "rounds": "rounds",
    "local-steps": "local_steps",
    "algorithm": "algorithm",
    "uplink": "uplink",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hf-dtrain fed simulate``: finetune's model / method / data flags, ``--fed.*`` (FederatedConfig) and the
    short forms ``--clients --per-round --rounds --local-steps --algorithm --uplink``."""
    add_job_arguments(parser, finetune_config_class())
    title = f"fed (FederatedConfig, {FederatedConfig.__module__})"
    add_config_arguments(parser, FederatedConfig, "fed", title, short=FED_SHORT)


def config_from_args(ns: argparse.Namespace) -> FedSimulateConfig:
    FinetuneConfig = finetune_config_class()
    given = vars(ns)
    fed = {k.split(".", 1)[1]: v for k, v in given.items() if k.startswith("fed.")}
    data = load_recipe(ns.recipe) if getattr(ns, "recipe", None) else {}
    fed = {**(data.pop("fed", None) or {}), **fed}
    shared = argparse.Namespace(
        **{k: v for k, v in given.items() if not k.startswith("fed.") and k not in ("recipe", "action")}
    )
    job = FinetuneConfig.from_dict(
        merge(data, args_to_data(shared, FinetuneConfig), FinetuneConfig),
        where=f"recipe {ns.recipe}" if getattr(ns, "recipe", None) else "FinetuneConfig",
    )
    return FedSimulateConfig(job=job, fed=build(FederatedConfig, fed, where="fed"))


def main(ns: argparse.Namespace) -> int:
    run_fed_simulate(config_from_args(ns))
    return 0
