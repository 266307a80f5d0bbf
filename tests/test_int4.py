"""The group-wise asymmetric INT4 base format (hf_dtrain.quantization.int4) and its exact zero-point fold."""

import copy

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from hf_dtrain.quantization.int4 import (
    Int4Linear,
    dequantize_int4,
    pack_int4,
    quantize_int4,
    quantize_model_int4,
    unpack_int4,
)
from hf_dtrain.testing import random_batch, tiny_llama


def test_pack_unpack_round_trip_and_layout():
    codes = torch.randint(0, 16, (5, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_int4(codes)
    assert packed.shape == (5, 6) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), codes)
    assert int(pack_int4(torch.tensor([3, 10]))[0]) == 3 | (10 << 4)  # low nibble first


def test_quantization_error_is_at_most_half_a_step_and_extremes_are_exact():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 128, generator=g) * torch.logspace(-2, 1, 16)[:, None]
    w[3, :32] = 0.25  # a constant group
    q, s, z = quantize_int4(w, 32)
    deq = dequantize_int4(q, s, z)
    err = (deq - w).abs().view(16, 4, 32)
    assert (err <= s[..., None] / 2 + 1e-6 * w.abs().max()).all()
    grouped_w, grouped_d = w.view(16, 4, 32), deq.view(16, 4, 32)
    torch.testing.assert_close(grouped_d.amin(-1), grouped_w.amin(-1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grouped_d.amax(-1), grouped_w.amax(-1), atol=1e-6, rtol=1e-6)
    assert torch.equal(deq[3, :32], w[3, :32])


def test_int4_linear_forward_is_linear_with_the_dequantized_weight():
    lin = torch.nn.Linear(64, 48)
    q = Int4Linear.from_linear(lin, group_size=16)
    x = torch.randn(3, 7, 64)
    torch.testing.assert_close(q(x), F.linear(x, q.weight, lin.bias), atol=1e-6, rtol=1e-6)
    # and within the rounding bound of the dense layer: |error| <= |x| . (s / 2) per output
    half_step = torch.repeat_interleave(q.scales / 2, 16, dim=1)  # (out, in)
    assert ((q(x) - lin(x)).abs() <= x.abs() @ half_step.T + 1e-5).all()


@pytest.mark.parametrize("group_size, lambda_out", [(16, 4), (32, 8), (8, 1)])
def test_group_constant_adapter_folds_into_zero_points_exactly(group_size, lambda_out):
    """A QA-HiRA-shaped adapter (input average-pooled by the group size, one matrix, output repeated) merged into the
    quantized layer gives the unmerged adapter model's outputs (atol 1e-5, fp32); no weight code changes."""
    torch.manual_seed(0)
    layer = Int4Linear.from_linear(torch.nn.Linear(128, 64), group_size=group_size)
    codes_before, zeros_before = layer.qweight.clone(), layer.zeros.clone()
    m = torch.randn(64 // lambda_out, 128 // group_size) * 0.3
    scale = 2.0
    x = torch.randn(4, 9, 128)

    def adapter(inp):
        pooled = F.avg_pool1d(inp.reshape(-1, 1, 128), group_size).reshape(*inp.shape[:-1], -1)
        return scale * torch.repeat_interleave(pooled @ m.T, lambda_out, dim=-1)

    unmerged = layer(x) + adapter(x)
    update = scale * torch.repeat_interleave(m, lambda_out, dim=0) / group_size  # (out, in / g)
    layer.fold_group_constant_update(update)
    torch.testing.assert_close(layer(x), unmerged, atol=1e-5, rtol=0)
    assert torch.equal(layer.qweight, codes_before)
    # the dense merge of the same update matches too
    dense = layer.weight  # already merged
    torch.testing.assert_close(F.linear(x, dense, layer.bias), unmerged, atol=1e-5, rtol=0)
    layer.fold_group_constant_update(update, sign=-1.0)
    torch.testing.assert_close(layer.zeros, zeros_before, atol=1e-5, rtol=0)


def test_quantized_llama_state_dict_round_trips_through_safetensors(tmp_path):
    dense = tiny_llama()
    batch = random_batch(seed=3)
    model = quantize_model_int4(copy.deepcopy(dense), group_size=32)
    n_int4 = sum(isinstance(m, Int4Linear) for m in model.modules())
    assert n_int4 == 2 * 7 and isinstance(model.lm_head, torch.nn.Linear)
    with torch.no_grad():
        ref, out = dense(**batch).logits, model(**batch).logits
    assert (ref - out).abs().max() < 0.5 and not torch.equal(ref, out)
    save_file(model.state_dict(), tmp_path / "int4.safetensors")
    fresh = quantize_model_int4(tiny_llama(seed=1), group_size=32)  # a different model, then overwritten
    fresh.load_state_dict(load_file(tmp_path / "int4.safetensors"))
    with torch.no_grad():
        assert torch.equal(fresh(**batch).logits, out)


def test_bad_group_size_and_update_shape_are_clear_errors():
    with pytest.raises(ValueError, match=r"group_size=48 does not divide in_features=64; choose a group size"):
        Int4Linear.from_linear(torch.nn.Linear(64, 8), group_size=48)
    with pytest.raises(ValueError, match=r"group_size must be an even integer"):
        quantize_int4(torch.randn(4, 63), 7)
    layer = Int4Linear.from_linear(torch.nn.Linear(64, 8), group_size=16)
    with pytest.raises(ValueError, match=r"has shape \(8, 4\) \(out, in / group_size\), got \(8, 64\)"):
        layer.fold_group_constant_update(torch.zeros(8, 64))
    with pytest.raises(ValueError, match=r"found no nn.Linear"):
        quantize_model_int4(tiny_llama(), target_modules=["nope"])
