"""Communication methods on a DeepSpeed engine (ZeRO stage 0, CPU accelerator, gloo, 2 ranks): the engine's own
all-reduce is replaced, the dense method reproduces DeepSpeed's result, ACP-SGD keeps the replicas identical with the
formula's bytes, and what cannot work (ZeRO >= 1, DeAR, gradient clipping) is refused with a clear error."""

import os

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed is in the test extra; install hf-dtrain[test]")

from hf_dtrain.testing import random_batch, run_distributed, tiny_llama

STEPS = 4


def _engine(stage=0, accumulation=1, clipping=0.0):
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    torch.manual_seed(0)
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
        "gradient_clipping": clipping,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
    return engine


def _train(engine, rank, accumulation):
    for step in range(STEPS):
        for micro in range(accumulation):
            loss = engine(**random_batch(seed=1000 * step + 10 * micro + rank)).loss
            engine.backward(loss)
            engine.step()


def _ds_rank(rank, world, out_dir, method, accumulation):
    import torch.distributed as dist

    from hf_dtrain.comm import acp_sgd_step_bytes
    from hf_dtrain.comm.deepspeed import register_deepspeed

    engine = _engine(accumulation=accumulation)
    state = None
    if method != "deepspeed":
        state = register_deepspeed(engine, {"method": method, "rank": 2, "start_iter": 2}, bucket_cap_mb=0.05)
        assert engine.enable_backward_allreduce is False
    _train(engine, rank, accumulation)
    flat = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g) for g in gathered)  # replicas identical
    if state is not None:
        assert len(state.stats.steps) == STEPS  # one exchange per optimizer step, at the accumulation boundary
        dense = sum(p.numel() * 4 for p in engine.module.parameters())
        if method == "allreduce":
            assert state.stats.steps == [dense] * STEPS
        else:
            shapes = [(n, p.shape) for n, p in engine.module.named_parameters()]
            assert state.stats.steps[:2] == [dense, dense]
            assert state.stats.steps[2] == acp_sgd_step_bytes(state, shapes, even=True)
            assert state.stats.steps[3] == acp_sgd_step_bytes(state, shapes, even=False)
    if rank == 0:
        torch.save(
            {n: p.detach().clone() for n, p in engine.module.named_parameters()},
            f"{out_dir}/{method}_{accumulation}.pt",
        )


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 2])
def test_deepspeed_stage0_dense_method_reproduces_deepspeed(tmp_path, accumulation):
    for method in ("deepspeed", "allreduce"):
        run_distributed(_ds_rank, world_size=2, args=(str(tmp_path), method, accumulation), timeout=300)
    ours = torch.load(tmp_path / f"allreduce_{accumulation}.pt", weights_only=True)
    theirs = torch.load(tmp_path / f"deepspeed_{accumulation}.pt", weights_only=True)
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_deepspeed_stage0_acp_sgd_identical_replicas_and_bytes(tmp_path):
    run_distributed(_ds_rank, world_size=2, args=(str(tmp_path), "acp_sgd", 1), timeout=300)


def _refusals(rank, world):
    from hf_dtrain.comm.deepspeed import register_deepspeed

    with pytest.raises(ValueError, match=r"runs ZeRO stage 1, whose optimizer reduces gradients into its partitions"):
        register_deepspeed(_engine(stage=1), "acp_sgd")
    with pytest.raises(ValueError, match=r"'dear' needs DDP's bucket schedule"):
        register_deepspeed(_engine(), "dear")
    with pytest.raises(ValueError, match=r"gradient_clipping=1.0 runs before the optimizer step"):
        register_deepspeed(_engine(clipping=1.0), "acp_sgd")


@pytest.mark.slow
def test_deepspeed_refuses_what_cannot_work():
    run_distributed(_refusals, world_size=2, timeout=300)
