"""4-bit bases (bitsandbytes NF4, HQQ, Int4Linear): loading, CPU training safety, QA-LoRA, and the exact merges."""

import copy

import pytest
import torch
from peft import get_peft_model

from hf_dtrain import LoraFAConfig, QAHiRAConfig, QBaRAConfig
from hf_dtrain.quantization import (
    load_quantized_model,
    prepare_bnb_4bit_for_training,
    quantize_model_hqq,
    quantized_kind,
)
from hf_dtrain.quantization.int4 import quantize_model_int4
from hf_dtrain.testing import random_batch, tiny_llama, train_steps
from hf_dtrain.tuners.qahira import QAHiRALayer

TARGETS = ["q_proj", "v_proj", "down_proj"]


def logits(model, batch):
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def randomise(model, std=0.3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _n, p in model.named_parameters():
        if p.requires_grad:
            p.data = torch.randn(p.shape, generator=gen) * std
    return model.eval()


@pytest.fixture
def saved_tiny(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    return tmp_path


def test_load_quantized_model_gives_each_format(saved_tiny):
    pytest.importorskip("hqq", reason="hqq (the test extra) provides the maintained zero-point 4-bit format")
    pytest.importorskip("bitsandbytes", reason="bitsandbytes>=0.46.1 (the test extra) runs 4-bit on CPU")
    dense = load_quantized_model(saved_tiny, None)
    batch = random_batch(seed=0)
    ref = logits(dense, batch)
    for kind in ("nf4", "hqq4", "int4"):
        model = load_quantized_model(saved_tiny, kind, group_size=16)
        assert quantized_kind(model.model.layers[1].mlp.down_proj) == kind
        assert quantized_kind(model.lm_head) is None  # the output head stays dense
        err = (logits(model, batch) - ref).abs().max()
        assert 0 < err < 0.5, (kind, err)  # quantized: close to the dense model, not equal
    with pytest.raises(ValueError, match=r"quantize='fp3' is unknown; use one of nf4, hqq4, int4"):
        load_quantized_model(saved_tiny, "fp3")


@pytest.mark.parametrize("kind", ["hqq4", "int4"])
def test_qahira_merges_exactly_into_zero_points(kind):
    if kind == "hqq4":
        pytest.importorskip("hqq", reason="hqq (the test extra) provides the maintained zero-point 4-bit format")
        base = quantize_model_hqq(tiny_llama(), group_size=16)
        codes_of = lambda m: m.base_layer.W_q.clone()  # noqa: E731
    else:
        base = quantize_model_int4(tiny_llama(), group_size=16)
        codes_of = lambda m: m.base_layer.qweight.clone()  # noqa: E731
    batch = random_batch(seed=2)
    base_ref = logits(base.eval(), batch)
    model = randomise(get_peft_model(base, QAHiRAConfig(group_size=16, lambda_out=4, target_modules=TARGETS)))
    ref = logits(model, batch)
    layers = [m for m in model.modules() if isinstance(m, QAHiRALayer)]
    codes = [codes_of(m) for m in layers]
    model.merge_adapter()
    torch.testing.assert_close(logits(model, batch), ref, atol=1e-5, rtol=0)
    model.unmerge_adapter()
    with model.disable_adapter():
        unadapted = logits(model, batch)
    torch.testing.assert_close(unadapted, base_ref, atol=1e-5, rtol=0)  # unmerge restored the zero-points
    merged = model.merge_and_unload()
    assert quantized_kind(merged.model.layers[0].self_attn.q_proj) == kind  # still a 4-bit model
    assert all(torch.equal(codes_of(m), c) for m, c in zip(layers, codes))  # no weight code moved
    torch.testing.assert_close(logits(merged, batch), ref, atol=1e-5, rtol=0)


def test_qahira_group_size_must_match_the_hqq_group_size():
    pytest.importorskip("hqq", reason="hqq (the test extra) provides the maintained zero-point 4-bit format")
    base = quantize_model_hqq(tiny_llama(), group_size=16)
    with pytest.raises(
        ValueError, match=r"group_size=32 differs from the quantization group size 16 .*set group_size=16"
    ):
        get_peft_model(base, QAHiRAConfig(group_size=32, lambda_out=4, target_modules=TARGETS))


def test_qa_lora_factorisation_counts_rank_and_exact_merge():
    base = quantize_model_int4(tiny_llama(), group_size=16)
    model = get_peft_model(base, QAHiRAConfig(group_size=16, lambda_out=1, r=3, target_modules=TARGETS))
    # per layer r * (in / g) + out * r: q, v (64 x 64): 3*4 + 64*3; down (64 x 128): 3*8 + 64*3; two layers
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 2 * (2 * (12 + 192) + (24 + 192))
    untrained = get_peft_model(
        quantize_model_int4(tiny_llama(), group_size=16),
        QAHiRAConfig(group_size=16, lambda_out=1, r=3, target_modules=TARGETS),
    )
    batch = random_batch(seed=4)
    torch.testing.assert_close(
        logits(untrained.eval(), batch),
        logits(quantize_model_int4(tiny_llama(), group_size=16).eval(), batch),
        atol=0,
        rtol=0,
    )
    model = randomise(model)
    layer = next(m for m in model.modules() if isinstance(m, QAHiRALayer))
    assert torch.linalg.matrix_rank(layer.get_delta_weight("default")) == 3
    ref = logits(model, batch)
    torch.testing.assert_close(logits(model.merge_and_unload(), batch), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "config_cls, kwargs", [(QAHiRAConfig, dict(group_size=16, lambda_out=4)), (QBaRAConfig, dict(r=2))]
)
def test_require_quantized_base(config_cls, kwargs):
    with pytest.raises(
        ValueError,
        match=rf"{config_cls.__name__}.require_quantized_base=True but "
        r"'model.layers.0.self_attn.q_proj' is a dense Linear.*load_quantized_model",
    ):
        get_peft_model(tiny_llama(), config_cls(require_quantized_base=True, target_modules=TARGETS, **kwargs))
    model = get_peft_model(
        quantize_model_int4(tiny_llama(), group_size=16),
        config_cls(require_quantized_base=True, target_modules=TARGETS, **kwargs),
    )
    assert sum(isinstance(m, model.base_model.tuner_layer_cls) for m in model.modules()) == 6


def _load_bnb(path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    return AutoModelForCausalLM.from_pretrained(
        path,
        device_map="cpu",
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32),
    )


def _grads(model, batch):
    model.train()
    model.zero_grad()
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["input_ids"])
    out.loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    "config",
    [
        QAHiRAConfig(group_size=16, lambda_out=4, target_modules=TARGETS),
        QBaRAConfig(r=2, target_modules=TARGETS),
        LoraFAConfig(r=2, target_modules=TARGETS, init_seed=0),
    ],
    ids=["qahira", "qbara", "lorafa"],
)
def test_evaluation_before_training_on_bnb_4bit_keeps_gradients(saved_tiny, config):
    """bitsandbytes (0.50, CPU with AVX512-BF16) repacks 4-bit weights during eval-mode no_grad forwards and then drops
    gradients through them (the attention adapters got None); get_peft_model with an hf_dtrain method turns that
    repack off for every 4-bit layer, so the gradients after an evaluation equal those without one."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes>=0.46.1 (the test extra) runs 4-bit on CPU")
    batch = random_batch(seed=6)
    torch.manual_seed(0)
    reference = _grads(get_peft_model(_load_bnb(saved_tiny), copy.deepcopy(config)), batch)
    torch.manual_seed(0)
    model = get_peft_model(_load_bnb(saved_tiny), copy.deepcopy(config))
    logits(model.eval(), batch)  # what Trainer.evaluate() before training does
    grads = _grads(model, batch)
    assert grads.keys() == reference.keys() and len(grads) >= 6  # every adapter matrix of the 6 targets
    for name, g in grads.items():
        assert g is not None, name
        torch.testing.assert_close(g, reference[name], atol=1e-6, rtol=1e-5)
    losses = train_steps(model, 6)
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match=r"this base is Linear4bit \(quantized\)"):
        model.merge_and_unload()


def test_already_repacked_bnb_model_is_refused(saved_tiny):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes>=0.46.1 (the test extra) runs 4-bit on CPU")
    base = _load_bnb(saved_tiny)
    layer = base.model.layers[0].self_attn.q_proj
    if not layer.support_avx512bf16_for_cpu:
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes never repacks, nothing to refuse")
    logits(base.eval(), random_batch(seed=7))
    with pytest.raises(ValueError, match=r"already repacked for CPU inference.*Load the 4-bit model again"):
        prepare_bnb_4bit_for_training(base)
    with pytest.raises(ValueError, match=r"already repacked"):
        get_peft_model(base, QBaRAConfig(r=2, target_modules=TARGETS))
