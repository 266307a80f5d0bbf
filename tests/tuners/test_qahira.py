"""QA-HiRA on a group-wise INT4 base and on a dense base."""

import copy
import sys

import pytest
import torch
from peft import get_peft_model
from safetensors.torch import load_file, save_file

from hf_dtrain import QAHiRAConfig, processes
from hf_dtrain.quantization.int4 import Int4Linear, quantize_model_int4
from hf_dtrain.testing import random_batch, tiny_llama, train_steps
from hf_dtrain.tuners.qahira import QAHiRALayer

TARGETS = ["q_proj", "v_proj", "down_proj"]


def int4_base(seed=0):
    return quantize_model_int4(tiny_llama(seed=seed), group_size=16)


def adapted(base, lambda_out=4, seed=0):
    model = get_peft_model(base, QAHiRAConfig(group_size=16, lambda_out=lambda_out, target_modules=TARGETS))
    gen = torch.Generator().manual_seed(seed)
    for n, p in model.named_parameters():
        if "qahr_A" in n:
            p.data = torch.randn(p.shape, generator=gen) * 0.3
    return model.eval()


def logits(model, batch):
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def test_parameter_count_and_rank_follow_the_formulas():
    model = adapted(int4_base())
    # per layer (out / lambda_out) x (in / group_size): q, v 64x64 -> 16 x 4; down 64x128 -> 16 x 8; two layers
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 2 * (16 * 4 + 16 * 4 + 16 * 8)
    layer = next(m for m in model.modules() if isinstance(m, QAHiRALayer))
    delta = layer.get_delta_weight("default")
    assert delta.shape == (64, 64)
    assert torch.linalg.matrix_rank(delta) == torch.linalg.matrix_rank(layer.qahr_A["default"]) == 4


def test_untrained_adapter_leaves_outputs_unchanged():
    base = int4_base()
    batch = random_batch(seed=1)
    expected = logits(copy.deepcopy(base), batch)
    model = get_peft_model(base, QAHiRAConfig(group_size=16, lambda_out=4, target_modules=TARGETS))
    assert all(torch.count_nonzero(p) == 0 for n, p in model.named_parameters() if "qahr_A" in n)
    assert torch.equal(logits(model.eval(), batch), expected)


def test_merge_into_int4_base_equals_unmerged_adapter_model_and_unmerge_restores():
    model = adapted(int4_base())
    batch = random_batch(seed=2)
    ref = logits(model, batch)
    layers = [m for m in model.modules() if isinstance(m, QAHiRALayer)]
    codes = [m.base_layer.qweight.clone() for m in layers]
    zeros = [m.base_layer.zeros.clone() for m in layers]
    model.merge_adapter()
    torch.testing.assert_close(logits(model, batch), ref, atol=1e-5, rtol=0)
    model.unmerge_adapter()
    for m, c, z in zip(layers, codes, zeros):
        assert torch.equal(m.base_layer.qweight, c)
        torch.testing.assert_close(m.base_layer.zeros, z, atol=1e-5, rtol=0)
    merged = model.merge_and_unload()
    assert isinstance(merged.model.layers[0].self_attn.q_proj, Int4Linear)  # still an INT4 model
    assert all(torch.equal(m.base_layer.qweight, c) for m, c in zip(layers, codes))
    torch.testing.assert_close(logits(merged, batch), ref, atol=1e-5, rtol=0)


def test_dense_merge_matches():
    model = adapted(tiny_llama())
    batch = random_batch(seed=3)
    ref = logits(model, batch)
    torch.testing.assert_close(logits(model.merge_and_unload(), batch), ref, atol=1e-5, rtol=0)


def test_training_on_int4_base_moves_only_the_adapter():
    model = get_peft_model(int4_base(), QAHiRAConfig(group_size=16, lambda_out=4, target_modules=TARGETS, scaling=4.0))
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    losses = train_steps(model, 8, lr=5e-2)
    assert losses[-1] < losses[0]
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())


def test_save_and_load_in_fresh_process_gives_identical_logits(tmp_path):
    model = adapted(int4_base())
    batch = random_batch(seed=4)
    ref = logits(model, batch)
    model.save_pretrained(tmp_path / "adapter")
    save_file(
        {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}, tmp_path / "batch.safetensors"
    )
    code = f"""
import torch, hf_dtrain
from peft import PeftModel
from safetensors.torch import load_file, save_file
from hf_dtrain.testing import tiny_llama
from hf_dtrain.quantization.int4 import quantize_model_int4
b = load_file({str(tmp_path / "batch.safetensors")!r})
m = PeftModel.from_pretrained(quantize_model_int4(tiny_llama(), group_size=16), {str(tmp_path / "adapter")!r}).eval()
with torch.no_grad():
    save_file({{"logits": m(**b).logits}}, {str(tmp_path / "out.safetensors")!r})
"""
    proc = processes.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.equal(load_file(tmp_path / "out.safetensors")["logits"], ref)


@pytest.mark.parametrize(
    "base_fn, kwargs, match",
    [
        (tiny_llama, dict(group_size=24, lambda_out=4), r"group_size=24 does not divide in_features=64 .*divisor"),
        (tiny_llama, dict(group_size=16, lambda_out=5), r"lambda_out=5 does not divide out_features=64"),
        (
            int4_base,
            dict(group_size=32, lambda_out=4),
            r"group_size=32 differs from the quantization group size 16 .*set group_size=16",
        ),
        (tiny_llama, dict(group_size=0), r"group_size must be a positive integer"),
    ],
)
def test_bad_input_raises_clear_errors(base_fn, kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_peft_model(base_fn(), QAHiRAConfig(target_modules=TARGETS, **kwargs))
