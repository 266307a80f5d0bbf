"""hf_dtrain.fused without the sweep job: fused full models from different inits, the per-job optimizer, padding,
the memory plan."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_dtrain.fused import FusedAdamW, FusedConfig, FusedJob, FusedTrainer, fuse_adapters, fuse_models, plan_groups
from hf_dtrain.testing import random_batch, tiny_llama


def _batches(seed: int):
    step = 0
    while True:
        yield random_batch(batch=2, seq=12, seed=1000 * seed + step)
        step += 1


def _alone(model, lr, wd, seed, steps, warmup):
    """One job as the Trainer trains it: AdamW (decay on all but biases and norms), clip 1.0, linear warm-up."""
    from transformers import get_scheduler

    decay = [p for n, p in model.named_parameters() if "norm" not in n and "bias" not in n]
    rest = [p for n, p in model.named_parameters() if "norm" in n or "bias" in n]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=wd), dict(params=rest, weight_decay=0.0)], lr=lr)
    sched = get_scheduler("linear", opt, num_warmup_steps=warmup, num_training_steps=steps)
    losses, data = [], _batches(seed)
    for _ in range(steps):
        loss = model(**next(data)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("tied", [False, True])
def test_fused_full_models_from_their_own_inits_equal_each_model_trained_alone(tied):
    steps, lrs, wds = 12, [3e-3, 1e-2, 1e-3], [0.0, 0.1, 0.01]
    models = [tiny_llama(seed=k, tie_word_embeddings=tied) for k in range(3)]
    alone = [copy.deepcopy(m) for m in models]
    fused = fuse_models(models)
    jobs = [FusedJob(f"j{k}", lrs[k], _batches(k), weight_decay=wds[k], warmup_steps=2) for k in range(3)]
    trainer = FusedTrainer(fused, jobs, steps, FusedConfig())
    history = trainer.train(progress=False)
    for k in range(3):
        ref = _alone(alone[k], lrs[k], wds[k], k, steps, 2)
        got = [row[k] for row in history]
        assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) < 1e-5
        exported = fused.export(k, tiny_llama(seed=99, tie_word_embeddings=tied))
        for (name, p), q in zip(exported.named_parameters(), alone[k].parameters()):
            assert float((p - q).detach().norm() / q.detach().norm()) < 1e-5, name
    if tied:
        assert fused.model.lm_head.weight is fused.model.get_input_embeddings().weight


def test_padded_ranks_get_no_gradient_and_stay_zero():
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]), adapter_name="a")
    peft_model.add_adapter("b", LoraConfig(r=6, target_modules=["q_proj", "v_proj"]))
    fused = fuse_adapters(peft_model, ["a", "b"])
    jobs = [FusedJob(n, 1e-2, _batches(k)) for k, n in enumerate(["a", "b"])]
    FusedTrainer(fused, jobs, 5).train(progress=False)
    for _, layer in fused.layers.values():
        assert layer.lora_A.shape[1] == 6
        assert torch.count_nonzero(layer.lora_A[0, 2:]) == 0 and torch.count_nonzero(layer.lora_B[0, :, 2:]) == 0
        assert torch.count_nonzero(layer.lora_B[0]) > 0  # the real rank did train
    peft_model = fused.unfuse()
    assert peft_model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["a"].weight.shape == (2, 64)


def test_fused_adamw_per_job_equals_torch_adamw_on_each_slice_bit_for_bit():
    torch.manual_seed(0)
    p = torch.randn(3, 5, 4, requires_grad=True)
    refs = [torch.nn.Parameter(p.detach()[k].clone()) for k in range(3)]
    lrs, wds = [1e-2, 3e-3, 0.0], [0.1, 0.0, 0.5]
    opt = FusedAdamW([p], 3, weight_decay=wds)
    ref_opts = [torch.optim.AdamW([r], lr=lr, weight_decay=wd) for r, lr, wd in zip(refs, lrs, wds)]
    for _step in range(4):
        g = torch.randn(3, 5, 4)
        p.grad = g.clone()
        opt.step(lrs)
        for k in range(3):
            refs[k].grad = g[k].clone()
            ref_opts[k].step()
    for k in range(3):  # bit for bit: the same operations, rounded the same way, per slice
        assert torch.equal(p.detach()[k], refs[k].detach())
    # a stopped job is left exactly as it was
    before = p.detach().clone()
    p.grad = torch.randn(3, 5, 4)
    opt.step(lrs, active=[True, False, True])
    assert torch.equal(p.detach()[1], before[1]) and not torch.equal(p.detach()[0], before[0])


def test_memory_plan_splits_into_groups_that_fit_or_says_how_many_fit():
    gib = 2**30
    cfg = FusedConfig(memory_budget="10GiB")
    assert plan_groups(8, gib, 2 * gib, cfg) == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert plan_groups(10, gib, 2 * gib, cfg) == [list(range(8)), [8, 9]]
    with pytest.raises(ValueError, match="so 8 fit at once"):
        plan_groups(10, gib, 2 * gib, FusedConfig(memory_budget="10GiB", on_overflow="error"))
    with pytest.raises(ValueError, match="not even one job fits"):
        plan_groups(2, 20 * gib, 2 * gib, cfg)
    with pytest.raises(ValueError, match="memory_budget"):
        FusedConfig(memory_budget="lots")
    with pytest.raises(ValueError, match="on_overflow"):
        FusedConfig(on_overflow="ignore")


def test_jobs_of_a_method_that_cannot_fuse_are_refused():
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(
        tiny_llama(), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True), adapter_name="a"
    )
    with pytest.raises(ValueError, match="DoRA"):
        fuse_adapters(peft_model, ["a"])
    with pytest.raises(ValueError, match="architecture"):
        fuse_models([tiny_llama(), tiny_llama(num_hidden_layers=1)])


def test_fused_lora_on_a_bf16_base_equals_peft_alone():
    """bf16 base weights, fp32 adapters (peft's autocast_adapter_dtype): the fused step adds the adapter in fp32 and
    casts back, as peft's layer does."""
    from peft import LoraConfig, get_peft_model
    from transformers import get_scheduler

    base = tiny_llama(dtype=torch.bfloat16)
    reference = copy.deepcopy(base)
    lrs, ranks = [1e-2, 3e-3], [4, 8]
    torch.manual_seed(0)
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), adapter_name="a")
    torch.manual_seed(1)
    peft_model.add_adapter("b", LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    fused = fuse_adapters(peft_model, ["a", "b"])
    history = FusedTrainer(
        fused,
        [FusedJob("a", lrs[0], _batches(0)), FusedJob("b", lrs[1], _batches(1))],
        10,
        FusedConfig(max_grad_norm=0),
    ).train(progress=False)
    for k in range(2):
        torch.manual_seed(k)
        alone = get_peft_model(copy.deepcopy(reference), LoraConfig(r=ranks[k], target_modules=["q_proj", "v_proj"]))
        opt = torch.optim.AdamW([p for p in alone.parameters() if p.requires_grad], lr=lrs[k], weight_decay=0.0)
        sched = get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=10)
        data, losses = _batches(k), []
        for _ in range(10):
            loss = alone(**next(data)).loss
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert max(abs(row[k] - ref) / ref for row, ref in zip(history, losses)) < 1e-5
