"""Q-BaRA: LoRA's parameter count, rank up to lambda * r, the derived merge constant, and
training on a bitsandbytes 4-bit base on CPU."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_dtrain import QBaRAConfig
from hf_dtrain.quantization import prepare_bnb_4bit_for_training
from hf_dtrain.testing import random_batch, tiny_llama, train_steps
from hf_dtrain.tuners.qbara import QBaRALayer


def _randomise(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _n, p in model.named_parameters():
        if p.requires_grad:
            p.data = torch.randn(p.shape, generator=gen) * 0.2
    return model


@pytest.mark.parametrize("pool", [2, 4])
def test_same_parameters_as_lora_and_rank_up_to_lambda_r(pool):
    targets = ["q_proj", "v_proj", "down_proj"]
    qb = _randomise(get_peft_model(tiny_llama(), QBaRAConfig(r=4, pool=pool, target_modules=targets)))
    lo = _randomise(get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=targets)))
    count = lambda m: sum(p.numel() for p in m.parameters() if p.requires_grad)  # noqa: E731
    assert count(qb) == count(lo)
    layer = next(m for m in qb.modules() if isinstance(m, QBaRALayer))
    lora_layer = lo.base_model.model.model.layers[0].self_attn.q_proj
    assert torch.linalg.matrix_rank(layer.get_delta_weight("default")) == min(pool * 4, 64 // pool)
    assert torch.linalg.matrix_rank(lora_layer.get_delta_weight("default")) == 4


def test_merge_constant_is_derived_from_the_forward():
    """Delta W read off the adapter's forward on the identity equals get_delta_weight (s / lambda * expand(B A))."""
    model = _randomise(get_peft_model(tiny_llama(), QBaRAConfig(r=4, lora_alpha=12, pool=2, target_modules=["q_proj"])))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    eye = torch.eye(64)
    with torch.no_grad():
        from_forward = (layer(eye) - layer.base_layer(eye)).T  # row i of the output is W applied to e_i
    torch.testing.assert_close(layer.get_delta_weight("default"), from_forward, atol=1e-6, rtol=1e-5)
    batch = random_batch(seed=1)
    model.eval()
    with torch.no_grad():
        ref = model(**batch).logits
        torch.testing.assert_close(model.merge_and_unload()(**batch).logits, ref, atol=1e-5, rtol=0)


def test_untrained_adapter_leaves_outputs_unchanged():
    base = tiny_llama()
    batch = random_batch(seed=2)
    with torch.no_grad():
        expected = copy.deepcopy(base)(**batch).logits
        assert torch.equal(get_peft_model(base, QBaRAConfig(r=4)).eval()(**batch).logits, expected)


def test_trains_on_a_bitsandbytes_4bit_base_and_refuses_a_rounding_merge(tmp_path):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes>=0.46.1 (the test extra) runs 4-bit on CPU")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_llama().save_pretrained(tmp_path)

    def load_4bit():
        model = AutoModelForCausalLM.from_pretrained(
            tmp_path,
            device_map="cpu",
            quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32),
        )
        prepare_bnb_4bit_for_training(model)  # the same CPU kernel path as the peft model (get_peft_model does it)
        return model

    base = load_4bit()
    assert type(base.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    model = get_peft_model(base, QBaRAConfig(r=4, target_modules=["q_proj", "v_proj"]))
    losses = train_steps(model, 6)
    assert losses[-1] < losses[0]
    probe = random_batch(seed=5)
    with torch.no_grad(), model.disable_adapter():
        trained_base = model(**probe).logits
    with torch.no_grad():
        assert torch.equal(trained_base, load_4bit()(**probe).logits)  # the 4-bit base did not move
    with pytest.raises(ValueError, match=r"this base is Linear4bit \(quantized\).*Load the base in fp16/bf16/fp32"):
        model.merge_and_unload()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(r=4, pool=3), r"pool=3 does not divide in_features=64 .*choose a pooling factor"),
        (dict(r=0), r"QBaRAConfig.r must be a positive integer"),
    ],
)
def test_bad_input_raises_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_peft_model(tiny_llama(), QBaRAConfig(target_modules=["q_proj"], **kwargs))
