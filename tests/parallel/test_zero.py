"""DeepSpeed ZeRO-2 and ZeRO-3 (CPU accelerator, gloo, 2 ranks) with full fine-tuning and each hf_dtrain tuner:
every step's loss and the saved adapter equal one process training on both ranks' batches, activation
checkpointing on; DeepSpeed's own checkpoint resumes the run bit for bit; the saved adapter reloads and merges."""

import json
import os

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed is in the test extra; install hf-dtrain[test]")

from hf_dtrain.parallel import full_state_dict, is_zero3, save_pretrained
from hf_dtrain.testing import mean_over_ranks, random_batch

from .common import (
    CONFIGS,
    LR,
    METHODS,
    STEPS,
    assert_reloads_and_merges,
    assert_trains_like_reference,
    batch,
    build_model,
    hetero_batches,
    hetero_reference,
    run_ranks,
    trainable,
)

STAGES = [2, 3]


def _engine(model, stage, optimizer=None):
    import deepspeed

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(model, "peft_config"):
        model.enable_input_require_grads()
    opt = optimizer if optimizer is not None else torch.optim.AdamW(trainable(model), lr=LR)
    # DeepSpeed 0.19 clips gradients at norm 1.0 unless told otherwise; the reference does not clip
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        # threshold 0: every parameter is partitioned (the tiny model's would all stay whole by default)
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
    return engine


def _steps(engine, rank, world, steps):
    losses = []
    for step in steps:
        loss = engine(**batch(step, rank)).loss
        engine.backward(loss)
        engine.step()
        losses.append(mean_over_ranks(loss.item()))
    return losses


def _zero_rank(rank, world, out):
    os.environ["DS_ACCELERATOR"] = "cpu"
    results = {}
    half = STEPS // 2
    for stage in STAGES:
        for method in METHODS:
            model = build_model(method, [random_batch(seed=rank)])
            selection = model.peft_config["default"].block_indices if method == "smt" else None
            engine = _engine(model, stage)
            # ZeRO-3 holds no whole parameter between steps: the local tensors are empty placeholders
            partitioned = is_zero3(engine.module) and all(p.numel() == 0 for p in engine.module.parameters())
            losses = _steps(engine, rank, world, range(half))
            engine.save_checkpoint(f"{out}/ckpt_{stage}_{method}", tag="half")  # DeepSpeed's own checkpoint
            losses += _steps(engine, rank, world, range(half, STEPS))
            # resume: a fresh engine loads the checkpoint and repeats the second half
            fresh = _engine(build_model(method, [], selection=selection), stage)
            fresh.load_checkpoint(f"{out}/ckpt_{stage}_{method}", tag="half")
            resumed = _steps(fresh, rank, world, range(half, STEPS))
            if method == "full":
                state = full_state_dict(engine)
                if rank == 0:
                    torch.save(state, f"{out}/full_{stage}.pt")
            else:
                save_pretrained(engine, f"{out}/{stage}_{method}")
            results[f"{stage}_{method}"] = {
                "losses": losses,
                "selection": selection,
                "resumed": resumed,
                "partitioned": partitioned,
            }
    # the heterogeneity-aware partitioner under ZeRO-3: batches of 2 and 6, each rank's loss scaled by the sampler
    engine = _engine(build_model("full", []), 3)
    results["hetero"] = []
    for data, scale in hetero_batches(rank):
        loss = engine(**data).loss
        engine.backward(loss * scale)
        engine.step()
        results["hetero"].append(mean_over_ranks(loss.item() * scale))
    from hf_dtrain.fault import SnapshotEngine

    try:
        SnapshotEngine(engine.module, directory=f"{out}/ft_{rank}")
    except ValueError as e:
        snapshot_refusal = str(e)
    # optimizers that exchange whole replicas: ZeRO hands them flat partitions, refused at their first step
    from hf_dtrain.decentralized import DPSGD
    from hf_dtrain.optim import OneBitLamb

    results["refusals"] = {"snapshots": snapshot_refusal}
    for stage, name, make in [
        (1, "onebit_lamb", lambda ps: OneBitLamb(ps)),
        (3, "dpsgd", lambda ps: DPSGD(ps, lr=0.1)),
    ]:
        model = build_model("full", [])
        engine = _engine(model, stage, optimizer=make(list(model.parameters())))
        try:
            engine.backward(engine(**batch(0, rank)).loss)
            engine.step()
        except ValueError as e:
            results["refusals"][f"{stage}_{name}"] = str(e)
    if rank == 0:
        with open(f"{out}/results.json", "w") as f:
            json.dump(results, f)


@pytest.fixture(scope="module")
def zero_run(tmp_path_factory):
    return run_ranks(_zero_rank, tmp_path_factory, "zero", timeout=500)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("stage", STAGES)
def test_zero_trains_like_one_process(zero_run, references, stage, method):
    out, results = zero_run
    ref_dir, refs = references
    got = results[f"{stage}_{method}"]
    assert got["partitioned"] == (stage == 3)  # ZeRO-3 really partitioned the parameters
    saved = out / (f"full_{stage}.pt" if method == "full" else f"{stage}_{method}")
    assert_trains_like_reference(method, got, refs[method], saved, ref_dir / method)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("stage", STAGES)
def test_resume_from_a_deepspeed_checkpoint_repeats_the_steps_exactly(zero_run, stage, method):
    _, results = zero_run
    got = results[f"{stage}_{method}"]
    assert [x.hex() for x in got["resumed"]] == [x.hex() for x in got["losses"][STEPS // 2 :]]


@pytest.mark.slow
@pytest.mark.parametrize("method", list(CONFIGS))
def test_adapter_from_a_zero3_run_reloads_and_merges(zero_run, method):
    out, _ = zero_run
    assert_reloads_and_merges(out / f"3_{method}")


@pytest.mark.slow
def test_heterogeneity_aware_partitioner_under_zero3_weighs_every_sample_alike(zero_run):
    """Ranks with batches of 2 and 6 (speeds 1:3), each loss scaled by the sampler: every step equals one process
    on the union of the two batches."""
    want, sizes = hetero_reference()
    assert sizes == [2, 6]
    torch.testing.assert_close(torch.tensor(zero_run[1]["hetero"]), torch.tensor(want), rtol=2e-5, atol=0)


@pytest.mark.slow
def test_optimizers_that_exchange_whole_replicas_are_refused_under_zero(zero_run):
    refusals = zero_run[1]["refusals"]
    assert set(refusals) == {"1_onebit_lamb", "3_dpsgd", "snapshots"}
    # a ZeRO-3 module alone is refused: its partitions live in DeepSpeed's optimizer (pass the engine)
    assert "held by DeepSpeed ZeRO-3 (a partitioned parameter)" in refusals.pop("snapshots")
    for message in refusals.values():
        assert "DeepSpeed ZeRO stage >= 1 hands its client optimizer flat fp32 partitions" in message
        assert "Train it with DDP" in message
