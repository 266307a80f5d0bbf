"""The Trainer's own checkpoints carry Eva's and 1-bit LAMB's state: a run saved mid-way and resumed with
``trainer.train(resume_from_checkpoint=...)`` logs the same losses, step for step, as the uninterrupted run. 1-bit LAMB
runs on 2 gloo ranks under the Trainer with DDP's ``noop_hook`` (``CommHookCallback.attach(trainer, "noop")``)."""

import json
import os

import pytest
import torch

from hf_dtrain.testing import random_batch, run_distributed, tiny_llama

STEPS, SAVE_AT = 10, 5


def _rows(rank: int = 0):
    return [{k: v[0].tolist() for k, v in random_batch(batch=1, seed=1000 * rank + s).items()} for s in range(80)]


def _trainer(out_dir, optimizer_cls_and_kwargs, rank=0, callbacks_for=None):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    model = tiny_llama(seed=0)
    args = TrainingArguments(
        output_dir=str(out_dir),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        save_strategy="steps",
        save_steps=SAVE_AT,
        logging_steps=1,
        disable_tqdm=True,
        max_grad_norm=0,
        seed=0,
    )
    cls, kwargs = optimizer_cls_and_kwargs
    kwargs = dict(kwargs, model=model) if "model" in kwargs else kwargs
    trainer = Trainer(
        model=model, args=args, train_dataset=Dataset.from_list(_rows(rank)), optimizer_cls_and_kwargs=(cls, kwargs)
    )
    if callbacks_for is not None:
        callbacks_for(trainer)
    return trainer


def _losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def _straight_and_resumed(out_dir, optimizer_cls_and_kwargs, rank=0, callbacks_for=None):
    straight = _trainer(out_dir / "straight", optimizer_cls_and_kwargs, rank, callbacks_for)
    straight.train()
    resumed = _trainer(out_dir / "resumed", optimizer_cls_and_kwargs, rank, callbacks_for)
    resumed.train(resume_from_checkpoint=str(out_dir / "straight" / f"checkpoint-{SAVE_AT}"))
    return _losses(straight), _losses(resumed), straight, resumed


def test_eva_resumes_exactly_from_trainer_checkpoints(tmp_path):
    from hf_dtrain.optim import Eva

    a, b, _straight, resumed = _straight_and_resumed(
        tmp_path, (Eva, {"model": None, "base_optimizer": "adamw", "lr": 1e-3})
    )
    after = range(SAVE_AT + 1, STEPS + 1)  # the resumed log starts with the checkpoint's history (steps 1-5)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert [a[s] for s in after] == [b[s] for s in after], (a, b)  # the same losses after the resume, exactly
    inner = resumed.optimizer.optimizer if hasattr(resumed.optimizer, "optimizer") else resumed.optimizer
    assert inner.steps == STEPS  # Eva's step count (and vectors) came back from the checkpoint
    # the Trainer's optimizer.pt carries Eva's vectors, and loads without unpickling code
    sd = torch.load(tmp_path / "straight" / f"checkpoint-{SAVE_AT}" / "optimizer.pt", weights_only=True)
    assert sd["eva"]["steps"] == SAVE_AT and sd["eva"]["vectors"]


def _onebit_rank(rank, world, out_dir, port):
    import pathlib

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        ACCELERATE_USE_CPU="true",
    )
    from hf_dtrain.comm.trainer import CommHookCallback
    from hf_dtrain.optim import OneBitLamb

    hooks = []
    a, b, straight, _ = _straight_and_resumed(
        pathlib.Path(out_dir),
        (OneBitLamb, {"lr": 2e-3, "freeze_step": 3}),
        rank,
        callbacks_for=lambda t: hooks.append(CommHookCallback.attach(t, "noop")),
    )
    assert straight.args.world_size == world
    clipped = _trainer(
        pathlib.Path(out_dir) / "clipped",
        (OneBitLamb, {"lr": 2e-3, "freeze_step": 3}),
        rank,
        callbacks_for=lambda t: CommHookCallback.attach(t, "noop"),
    )
    clipped.args.max_grad_norm = 1.0
    with pytest.raises(ValueError, match=r"max_grad_norm=1.0\) would clip each rank's local gradient"):
        clipped.train()
    inner = straight.optimizer.optimizer if hasattr(straight.optimizer, "optimizer") else straight.optimizer
    if rank == 0:
        json.dump(
            {
                "straight": a,
                "resumed": b,
                "bytes": inner.stats.steps,
                "hooked": [h.summary() is not None for h in hooks],
            },
            open(f"{out_dir}/onebit.json", "w"),
        )


@pytest.mark.slow
def test_onebit_lamb_resumes_exactly_from_trainer_checkpoints_on_two_ranks(tmp_path):
    from hf_dtrain.testing import free_port

    run_distributed(_onebit_rank, world_size=2, args=(str(tmp_path), free_port()), timeout=600, pg_timeout_s=300)
    r = json.load(open(tmp_path / "onebit.json"))
    a, b = ({int(k): v for k, v in r[key].items()} for key in ("straight", "resumed"))
    after = range(SAVE_AT + 1, STEPS + 1)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    # past the freeze (step 3): compressed steps resume exactly
    assert [a[s] for s in after] == [b[s] for s in after], (a, b)
    assert r["hooked"] == [True, True]  # DDP's noop hook was registered by both trainers
    # after the freeze the optimizer sends 1-bit messages: far fewer bytes than the fp32 warm-up steps
    assert max(r["bytes"][3:]) * 16 <= r["bytes"][0]
