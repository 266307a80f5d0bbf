"""Decentralized optimizers from the tools users use: the Trainer (optimizer_cls_and_kwargs + DDP's noop hook through
CommHookCallback) and recipes/decentralized_accelerate.py under accelerate launch (2 gloo processes)."""

import json
import os

import pytest
import torch

from hf_dtrain.testing import random_batch, run_distributed, tiny_llama


def _trainer_rank(rank, world, out_dir, port):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        ACCELERATE_USE_CPU="true",
    )
    from hf_dtrain.callbacks import CommHookCallback
    from hf_dtrain.decentralized import DPSGD

    rows = [{k: v[0].tolist() for k, v in random_batch(batch=1, seed=1000 * rank + s % 8).items()} for s in range(64)]
    model = tiny_llama(seed=0)
    args = TrainingArguments(
        output_dir=out_dir,
        max_steps=12,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        max_grad_norm=0,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        optimizer_cls_and_kwargs=(DPSGD, {"topology": "ring", "lr": 0.05, "momentum": 0.9}),
    )
    hook = CommHookCallback.attach(trainer, "noop")
    trainer.train()
    inner = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert isinstance(inner, DPSGD) and inner.gossip_steps == 12 and hook.state is not None
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    torch.distributed.all_gather(everyone, flat)
    # a ring of 2 is the complete graph: gossip averages exactly, so the replicas stay equal although DDP sent nothing
    assert torch.allclose(everyone[0], everyone[1], atol=1e-6)
    if rank == 0:
        json.dump({"losses": losses, "bytes": inner.stats.steps}, open(f"{out_dir}/trainer.json", "w"))


@pytest.mark.slow
def test_dpsgd_under_the_trainer_on_two_ranks(tmp_path):
    from hf_dtrain.testing import free_port

    run_distributed(_trainer_rank, world_size=2, args=(str(tmp_path), free_port()), timeout=600, pg_timeout_s=300)
    r = json.load(open(tmp_path / "trainer.json"))
    assert sum(r["losses"][-3:]) < sum(r["losses"][:3])
    n_bytes = sum(p.numel() for p in tiny_llama().parameters()) * 4
    assert r["bytes"] == [n_bytes] * 12  # the all-reduce fast path of the complete graph: one payload per step


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra", [["--method", "decentlam"], ["--method", "dpsgd", "--nonblocking", "--straggler", "1:2"]]
)
def test_accelerate_recipe_two_processes(tmp_path, extra, tiny_base):
    from hf_dtrain.testing import accelerate_launch

    base = tiny_base(50)
    accelerate_launch(
        "recipes/decentralized_accelerate.py",
        "--model",
        base,
        "--steps",
        "30",
        "--out",
        str(tmp_path / "out"),
        *extra,
    )
    reports = [json.load(open(tmp_path / "out" / f"decentralized_{r}.json")) for r in range(2)]
    assert all(r["world_size"] == 2 and r["steps"] == 30 for r in reports), reports
    assert reports[0]["loss_last10"] < reports[0]["loss_first10"], reports
    assert reports[0]["consensus_distance"] == reports[1]["consensus_distance"] < 1e-4  # ring of 2: exact averaging
