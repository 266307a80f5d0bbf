"""hf_dtrain tuners under DeepSpeed (CPU accelerator, gloo, 2 ranks): ZeRO stages 0 and 1 with a client optimizer
train exactly what a single process averaging both ranks' losses trains."""

import os

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed is in the test extra; install hf-dtrain[test]")

from peft import get_peft_model

from hf_dtrain import LoraFAConfig, SMTConfig, smt_warmup
from hf_dtrain.testing import random_batch, run_distributed, tiny_llama

STEPS = 4


def _model(method, warmup_batches):
    model = tiny_llama()
    if method == "lorafa":
        return get_peft_model(model, LoraFAConfig(r=4, target_modules=["q_proj", "v_proj"], init_seed=0))
    model = get_peft_model(
        model,
        SMTConfig(block_size=16, num_blocks=4, warmup_steps=len(warmup_batches), target_modules=["q_proj", "v_proj"]),
    )
    smt_warmup(model, warmup_batches, progress=False)  # scores all-reduced across ranks when distributed
    return model


def _batch(step, rank):
    return random_batch(seed=100 + 10 * step + rank)


def _deepspeed_rank(rank, world_size, out_dir, method, stage):
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    model = _model(method, [random_batch(seed=rank)])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
    for step in range(STEPS):
        loss = engine(**_batch(step, rank)).loss
        engine.backward(loss)
        engine.step()
    state = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    state.update({n: b.detach().clone() for n, b in engine.module.named_buffers() if "lorafa_A" in n})
    torch.save(state, f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lorafa", "smt"])
@pytest.mark.parametrize("stage", [0, 1])
def test_zero_stage_with_client_optimizer_matches_single_process_reference(tmp_path, method, stage):
    run_distributed(_deepspeed_rank, world_size=2, args=(str(tmp_path), method, stage), timeout=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert ranks[0].keys() == ranks[1].keys()
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])  # data-parallel replicas agree exactly

    # reference: one process, the same warm-up data, the mean of both ranks' losses per step
    ref = _model(method, [random_batch(seed=0), random_batch(seed=1)])
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for step in range(STEPS):
        loss = (ref(**_batch(step, 0)).loss + ref(**_batch(step, 1)).loss) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
    trained = [n for n, p in ref.named_parameters() if p.requires_grad]
    assert trained
    for n, p in ref.named_parameters():
        torch.testing.assert_close(ranks[0][n], p.detach(), atol=1e-5, rtol=1e-4)
        if n not in trained:
            assert torch.equal(ranks[0][n], before[n])  # the frozen base is untouched
    for n, b in ref.named_buffers():
        if "lorafa_A" in n:
            assert torch.equal(ranks[0][n], b)  # LoRA-FA's A never moves
