import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_dtrain import LoraFAConfig, create_lorafa_optimizer
from hf_dtrain.testing import SavedTensorCounter, random_batch, tiny_llama, train_steps
from hf_dtrain.tuners.lorafa import LoraFALayer


def _params_and_buffers(module):
    return list(module.parameters()) + list(module.buffers())


def _saved_activation_bytes(model, x):
    counter = SavedTensorCounter(exclude=_params_and_buffers(model))
    with counter():
        y = model(x)
    y.sum().backward()
    return counter.nbytes


@pytest.mark.parametrize("r", [4, 16])
def test_saved_bytes_per_adapted_layer_at_most_r_over_d_in_of_lora(r):
    d_in, d_out = 512, 384
    base = torch.nn.Sequential()
    base.add_module("proj", torch.nn.Linear(d_in, d_out))
    x = torch.randn(8, 64, d_in, requires_grad=True)  # inside a network the layer input requires grad
    lora = get_peft_model(copy.deepcopy(base), LoraConfig(r=r, target_modules=["proj"], lora_dropout=0.0))
    fa = get_peft_model(copy.deepcopy(base), LoraFAConfig(r=r, target_modules=["proj"]))
    lora_bytes = _saved_activation_bytes(lora, x)
    fa_bytes = _saved_activation_bytes(fa, x)
    tokens = 8 * 64
    assert lora_bytes >= tokens * d_in * 4  # LoRA keeps the full input x for A's gradient
    assert fa_bytes == tokens * r * 4  # LoRA-FA keeps only x @ A.T
    assert fa_bytes <= r / d_in * lora_bytes
    # dropout acts on the r-dim projection, so its mask is r values per token too
    fa_drop = get_peft_model(copy.deepcopy(base), LoraFAConfig(r=r, target_modules=["proj"], lora_dropout=0.1))
    assert _saved_activation_bytes(fa_drop, x) <= 2 * tokens * r * 4 + 64


def test_in_a_llama_every_adapted_layer_keeps_no_input_copy():
    model = get_peft_model(
        tiny_llama(),
        LoraFAConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    )
    lora = get_peft_model(
        tiny_llama(),
        LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    )
    batch = random_batch(batch=4, seq=32)
    counts = {}
    for name, m in (("fa", model), ("lora", lora)):
        c = SavedTensorCounter(exclude=_params_and_buffers(m))
        with c():
            loss = m(**batch).loss
        loss.backward()
        counts[name] = c.nbytes
    assert counts["fa"] < counts["lora"]


def test_training_leaves_A_and_base_unchanged_and_trains_B():
    model = get_peft_model(tiny_llama(), LoraFAConfig(r=4, target_modules=["q_proj", "v_proj"], init_seed=1))
    a0 = {n: b.clone() for n, b in model.named_buffers() if "lorafa_A" in n}
    frozen0 = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert a0 and all(not p.requires_grad for n, p in model.named_parameters() if "lorafa_A" in n)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    losses = train_steps(model, 10, optimizer=opt)
    assert losses[-1] < losses[0]
    for n, b in model.named_buffers():
        if "lorafa_A" in n:
            assert torch.equal(b, a0[n])
    for n, p in model.named_parameters():
        if n in frozen0:
            assert torch.equal(p, frozen0[n])
    assert all(p.abs().sum() > 0 for n, p in model.named_parameters() if "lorafa_B" in n)


def test_init_seed_makes_A_reproducible():
    a = get_peft_model(tiny_llama(), LoraFAConfig(r=4, target_modules=["q_proj"], init_seed=7))
    b = get_peft_model(tiny_llama(), LoraFAConfig(r=4, target_modules=["q_proj"], init_seed=7))
    bufs_a = {n: t for n, t in a.named_buffers() if "lorafa_A" in n}
    bufs_b = {n: t for n, t in b.named_buffers() if "lorafa_A" in n}
    assert all(torch.equal(bufs_a[n], bufs_b[n]) for n in bufs_a)
    layers = list(bufs_a.values())
    assert not torch.equal(layers[0], layers[1])  # per-layer draws differ


def test_create_lorafa_optimizer_applies_projected_gradient_and_keeps_A():
    model = get_peft_model(
        tiny_llama(), LoraFAConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_seed=0)
    )
    for n, p in model.named_parameters():
        if "lorafa_B" in n:
            p.data.normal_(0, 0.01)
    opt = create_lorafa_optimizer(model, lr=1e-3)
    names = opt.param_groups[0]["names"]
    assert len(names) == 8 and all(("lorafa_A" in a) and ("lorafa_B" in b) for a, b in zip(names[::2], names[1::2]))
    (model(**random_batch()).loss * 1000).backward()  # larger gradients: Adam's eps becomes negligible
    layer = next(m for m in model.modules() if isinstance(m, LoraFALayer))
    a, b = layer.lorafa_A["default"].clone(), layer.lorafa_B["default"]
    b0, g = b.detach().clone(), b.grad.clone()
    s = layer.scaling["default"]
    corrected = (1 / s**2) * g @ torch.linalg.pinv(a @ a.T + 1e-8 * torch.eye(4))
    opt.step()
    assert torch.equal(layer.lorafa_A["default"], a)
    # first Adam step with bias correction: delta = -lr * m/(sqrt(v)+eps) = -lr * sign(g_corrected) (|g| >> eps)
    step = b.detach() - b0
    big = corrected.abs() > 4e-3  # where Adam's eps (1e-6 next to sqrt(v) = 0.03 |g|) is below 1%
    assert big.sum() >= 8
    agree = (torch.sign(step[big]) == -torch.sign(corrected[big])).float().mean()
    assert agree > 0.97
    torch.testing.assert_close(step[big].abs(), torch.full_like(step[big], 1e-3), rtol=0.05, atol=0)


def test_create_lorafa_optimizer_without_adapter_is_a_clear_error():
    with pytest.raises(ValueError, match="found no trainable LoRA-FA adapter"):
        create_lorafa_optimizer(tiny_llama())


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(r=0), ValueError, r"LoraFAConfig.r must be a positive integer"),
        (dict(r=4, lora_dropout=1.5), ValueError, r"lora_dropout must be in \[0, 1\)"),
        (dict(r=100, target_modules=["q_proj"]), ValueError, r"r=100 exceeds min\(in_features, out_features\)=64"),
        (dict(r=4, target_modules=["embed_tokens"]), TypeError, r"nn.Linear layers only"),
        (dict(r=4, target_modules=["nope"]), ValueError, r"not found in the base model"),
        (dict(r=4, bias="some"), ValueError, r"bias must be 'none', 'all' or 'lorafa_only'"),
    ],
)
def test_bad_input_raises_clear_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        get_peft_model(tiny_llama(), LoraFAConfig(**kwargs))


@pytest.mark.parametrize("use_rslora", [False, True])
def test_output_is_base_plus_scaled_BAx_computed_by_hand(use_rslora):
    """y = W x + s B A x with s = alpha / r, or alpha / sqrt(r) with use_rslora, recomputed here from the adapter's
    own A and B (B set to nonzero values so the update shows)."""
    import math

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(16, 12))
    ref = copy.deepcopy(base)
    r, alpha = 4, 10
    model = get_peft_model(base, LoraFAConfig(r=r, lora_alpha=alpha, target_modules=["0"], use_rslora=use_rslora))
    layer = model.base_model.model[0]
    with torch.no_grad():
        layer.lorafa_B["default"].normal_()
    a, b = layer.lorafa_A["default"], layer.lorafa_B["default"]  # (r, in), (out, r)
    x = torch.randn(3, 16)
    scale = alpha / (math.sqrt(r) if use_rslora else r)
    expected = ref(x) + scale * (x @ a.T @ b.T)
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
