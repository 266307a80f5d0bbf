"""Eva and 1-bit LAMB from the tools users use: the Trainer's optimizer_cls_and_kwargs, and DeepSpeed client optimizers
(ZeRO stage 0, CPU accelerator, 2 gloo ranks; 1-bit LAMB with the engine's all-reduce off)."""

import os

import pytest
import torch

from hf_dtrain.testing import random_batch, run_distributed, tiny_llama


def test_eva_from_trainer_optimizer_cls_and_kwargs(tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from hf_dtrain.optim import Eva

    rows = [{k: v[0].tolist() for k, v in random_batch(batch=1, seed=s % 4).items()} for s in range(64)]
    model = tiny_llama(seed=0)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=30,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1000,
        disable_tqdm=True,
        learning_rate=1e-3,
        max_grad_norm=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        optimizer_cls_and_kwargs=(Eva, {"model": model, "base_optimizer": "adamw", "lr": 1e-3}),
    )
    before = trainer.evaluate(Dataset.from_list(rows[:8]))["eval_loss"]
    trainer.train()
    inner = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert isinstance(inner, Eva) and inner.steps == 30 and inner.extra_memory_bytes() > 0  # Eva really stepped
    assert trainer.evaluate(Dataset.from_list(rows[:8]))["eval_loss"] < before


def _deepspeed_rank(rank, world, which):
    import torch.distributed as dist

    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    from hf_dtrain.optim import Eva, OneBitLamb

    torch.manual_seed(0)
    model = tiny_llama(seed=0)
    if which == "eva":
        opt = Eva(model.parameters(), model=model, base_optimizer="adamw", lr=1e-3)
    else:
        opt = OneBitLamb(model.parameters(), lr=1e-3, freeze_step=2)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0}, "steps_per_print": 10**6}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
    if which == "onebit_lamb":
        engine.enable_backward_allreduce = False  # the optimizer exchanges (1-bit) itself
    losses = []
    for step in range(6):
        loss = engine(**random_batch(seed=10 * step + rank)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g) for g in gathered)  # replicas identical
    if which == "eva":
        assert opt.steps == 6 and opt.extra_memory_bytes() > 0  # it stepped, with vectors from the engine's forwards
    else:
        assert len(opt.stats.steps) == 6 and opt.stats.steps[-1] < opt.stats.steps[0] / 16  # compressed after warm-up


def _zero1_eva_rank(rank, world, out):
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    from hf_dtrain.optim import Eva

    model = tiny_llama(seed=0)
    opt = Eva(model.parameters(), model=model, base_optimizer="adamw", lr=1e-3)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**6,
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
    engine.backward(engine(**random_batch(seed=rank)).loss)
    try:
        engine.step()
        message = "stepped"
    except ValueError as e:
        message = str(e)
    if rank == 0:
        with open(out, "w") as f:
            f.write(message)


@pytest.mark.slow
def test_eva_under_zero_stage_1_is_refused_at_the_first_step_not_silently_plain(tmp_path):
    """ZeRO >= 1 gives the client optimizer flat partitions and leaves the layers without gradients: Eva would
    precondition nothing and step as plain AdamW. It says so instead."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is in the test extra; install hf-dtrain[test]")
    run_distributed(_zero1_eva_rank, world_size=1, args=(str(tmp_path / "msg"),), timeout=300)
    assert "DeepSpeed ZeRO stage >= 1 hands its client optimizer flat fp32 partitions" in (tmp_path / "msg").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("which", ["eva", "onebit_lamb"])
def test_deepspeed_client_optimizer(which):
    pytest.importorskip("deepspeed", reason="DeepSpeed is in the test extra; install hf-dtrain[test]")
    run_distributed(_deepspeed_rank, world_size=2, args=(which,), timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["onebit_lamb", "eva"])
def test_accelerate_recipe_two_processes(tmp_path, optimizer, tiny_base):
    """recipes/optimizers_accelerate.py under accelerate launch (2 gloo processes): the replicas agree, the loss
    falls, and 1-bit LAMB's steps after its warm-up send under 1/16 of the warm-up's bytes; its saved state
    (accelerator.save_state) carries both ranks' error feedback."""
    import json

    from hf_dtrain.testing import accelerate_launch

    base = tiny_base(50)
    accelerate_launch(
        "recipes/optimizers_accelerate.py",
        "--model",
        base,
        "--optimizer",
        optimizer,
        "--steps",
        "40",
        "--freeze-fraction",
        "0.25",
        "--out",
        str(tmp_path / "out"),
        "--save-state",
        str(tmp_path / "state"),
    )
    reports = [json.load(open(tmp_path / "out" / f"optim_{r}.json")) for r in range(2)]
    summary = [
        {k: r[k] for k in ("world_size", "steps", "param_checksum", "loss_first10", "loss_last10")} for r in reports
    ]
    assert all(r["world_size"] == 2 and r["steps"] == 40 for r in reports), summary
    assert reports[0]["param_checksum"] == reports[1]["param_checksum"], summary
    assert reports[0]["loss_last10"] < reports[0]["loss_first10"], summary
    if optimizer == "onebit_lamb":
        sent = reports[0]["bytes_per_step"]
        assert len(sent) == 40 and max(sent[10:]) * 16 < sent[0], sent
        state = torch.load(tmp_path / "state" / "optimizer.bin", weights_only=True)
        per_rank = state["onebit"]["per_rank"]["worker_error"]
        assert per_rank.shape[0] == 2 and not torch.equal(per_rank[0], per_rank[1])
