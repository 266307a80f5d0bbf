"""The peft API a user relies on, for each hf_dtrain tuner: get_peft_model, print_trainable_parameters,
save_pretrained / PeftModel.from_pretrained / AutoPeftModelForCausalLM in a fresh process, several adapters,
disable_adapter, merge_and_unload, unload."""

import copy
import json
import sys

import pytest
import torch
from peft import get_peft_model
from safetensors.torch import load_file, save_file

from hf_dtrain import LoraFAConfig, QAHiRAConfig, QBaRAConfig, SMTConfig, processes, set_smt_block_indices, smt_warmup
from hf_dtrain.testing import random_batch, tiny_llama
from hf_dtrain.tuners._registry import saved_peft_type

METHODS = ["lorafa", "smt", "qbara", "qahira", "qa-lora"]
TRAINABLE = ("smt_weight", "lorafa_B", "qbara_A", "qbara_B", "qahr_A", "qahr_B")


def make_config(method, seed=0):
    if method == "lorafa":
        return LoraFAConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_seed=seed)
    if method == "qbara":
        return QBaRAConfig(r=4, lora_alpha=8, pool=2, target_modules=["q_proj", "v_proj", "down_proj"])
    if method == "qahira":
        return QAHiRAConfig(group_size=16, lambda_out=4, target_modules=["q_proj", "v_proj", "down_proj"])
    if method == "qa-lora":
        return QAHiRAConfig(group_size=16, lambda_out=1, r=3, target_modules=["q_proj", "v_proj", "down_proj"])
    return SMTConfig(
        block_size=16, num_blocks=6, warmup_steps=2, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"]
    )


def adapted(base, method, adapter_name="default", seed=0):
    """A peft model whose adapter is non-trivial (trained-like random values), as after training."""
    model = get_peft_model(base, make_config(method, seed), adapter_name=adapter_name)
    prepare(model, method, adapter_name, seed)
    return model


def prepare(model, method, adapter_name, seed):
    if method == "smt":
        smt_warmup(model, [random_batch(seed=seed)], adapter_name=adapter_name, progress=False)
    gen = torch.Generator().manual_seed(100 + seed)
    for name, p in model.named_parameters():
        if f".{adapter_name}" in name and any(t in name for t in TRAINABLE):
            p.data = torch.randn(p.shape, generator=gen) * 0.05


def logits(model, batch):
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


@pytest.mark.parametrize("method", METHODS)
def test_print_trainable_parameters_counts_only_adapter(method, capsys):
    model = adapted(tiny_llama(), method)
    model.print_trainable_parameters()
    out = capsys.readouterr().out
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    expected = {
        "smt": 6 * 16 * 16,
        "lorafa": 2 * (4 * 64 + 4 * 64) + 2 * (64 * 4),  # q, v, down: B is 64 x 4
        "qbara": 2 * (4 * (64 + 64) * 2 + 4 * (128 + 64)),  # r (in + out) per layer, as LoRA at rank r
        "qahira": 2 * (16 * 4 + 16 * 4 + 16 * 8),  # (out / lambda_out) (in / group_size)
        "qa-lora": 2 * (2 * (3 * 4 + 64 * 3) + (3 * 8 + 64 * 3)),  # r (in / group_size) + out r
    }[method]
    assert trainable == expected
    assert f"trainable params: {expected:,d}" in out
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(any(t in n for t in TRAINABLE) for n in names)


@pytest.mark.parametrize("method", METHODS)
def test_save_and_load_in_fresh_process_gives_identical_logits(method, tiny_base_dir, tmp_path):
    base_dir, base = tiny_base_dir
    model = adapted(base, method)
    batch = random_batch(seed=3)
    ref = logits(model, batch)
    adapter_dir = tmp_path / "adapter"
    model.save_pretrained(adapter_dir)
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    peft_type = "QAHIRA" if method == "qa-lora" else method.upper()  # QA-LoRA is QA-HiRA with a rank
    assert cfg["peft_type"] == saved_peft_type(peft_type) and cfg["base_model_name_or_path"] == base_dir
    keys = load_file(adapter_dir / "adapter_model.safetensors").keys()
    assert keys and all(
        k.split(".")[-1]
        in {"lorafa_A", "lorafa_B", "smt_weight", "smt_indices", "qbara_A", "qbara_B", "qahr_A", "qahr_B"}
        for k in keys
    )
    assert any(k.endswith("qahr_B") for k in keys) == (method == "qa-lora")
    if method == "smt":
        assert any(k.endswith("smt_indices") for k in keys) and sum(len(v) for v in cfg["block_indices"].values()) == 6
    save_file(
        {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}, tmp_path / "batch.safetensors"
    )
    code = f"""
import torch, hf_dtrain
from peft import PeftModel, AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM
from safetensors.torch import load_file, save_file
b = load_file({str(tmp_path / "batch.safetensors")!r})
m1 = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base_dir!r}), {str(adapter_dir)!r}).eval()
m2 = AutoPeftModelForCausalLM.from_pretrained({str(adapter_dir)!r}).eval()
with torch.no_grad():
    save_file({{"peft": m1(**b).logits, "auto": m2(**b).logits}}, {str(tmp_path / "out.safetensors")!r})
"""
    proc = processes.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = load_file(tmp_path / "out.safetensors")
    assert torch.equal(out["peft"], ref)
    assert torch.equal(out["auto"], ref)


@pytest.mark.parametrize("method", METHODS)
def test_merge_and_unload_matches_adapter_forward(method):
    model = adapted(tiny_llama(), method)
    batch = random_batch(seed=1)
    ref = logits(model, batch)
    merged = model.merge_and_unload()
    assert not any(isinstance(m, torch.nn.Module) and hasattr(m, "base_layer") for m in merged.modules())
    torch.testing.assert_close(logits(merged, batch), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("method", METHODS)
def test_merge_adapter_then_unmerge_restores_base_weights(method):
    base = tiny_llama()
    ref_state = copy.deepcopy(base.state_dict())
    model = adapted(base, method)
    batch = random_batch(seed=1)
    ref = logits(model, batch)
    model.merge_adapter()
    torch.testing.assert_close(logits(model, batch), ref, atol=1e-5, rtol=0)
    model.unmerge_adapter()
    for name, module in model.named_modules():
        if hasattr(module, "base_layer") and hasattr(module.base_layer, "weight"):
            key = name.removeprefix("base_model.model.") + ".weight"
            torch.testing.assert_close(module.base_layer.weight, ref_state[key], atol=1e-6, rtol=0)


@pytest.mark.parametrize("method", METHODS)
def test_disable_adapter_and_unload_give_base_outputs(method):
    base_ref = tiny_llama()
    batch = random_batch(seed=2)
    expected = logits(base_ref, batch)
    model = adapted(tiny_llama(), method)
    adapted_out = logits(model, batch)
    assert (adapted_out - expected).abs().max() > 1e-3  # the adapter does change the model
    with model.disable_adapter():
        assert torch.equal(logits(model, batch), expected)
    assert torch.equal(logits(model, batch), adapted_out)
    unloaded = model.unload()
    assert type(unloaded.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert torch.equal(logits(unloaded, batch), expected)


@pytest.mark.parametrize("method", METHODS)
def test_several_named_adapters(method):
    batch = random_batch(seed=4)
    only_a = logits(adapted(tiny_llama(), method, "first", seed=0), batch)
    only_b = logits(adapted(tiny_llama(), method, "second", seed=1), batch)

    model = adapted(tiny_llama(), method, "first", seed=0)
    model.add_adapter("second", make_config(method, seed=1))
    model.set_adapter("second")
    prepare(model, method, "second", seed=1)
    assert torch.equal(logits(model, batch), only_b)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith(".second") for n in trainable)
    model.set_adapter("first")
    assert torch.equal(logits(model, batch), only_a)
    assert all(n.endswith(".first") for n, p in model.named_parameters() if p.requires_grad)
    model.delete_adapter("second")
    assert list(model.peft_config) == ["first"]
    assert torch.equal(logits(model, batch), only_a)


def test_smt_explicit_indices_skip_warmup_and_round_trip(tmp_path):
    indices = {"model.layers.1.self_attn.v_proj": [[0, 1], [3, 2]], "model.layers.0.self_attn.q_proj": [[2, 2]]}
    cfg = SMTConfig(block_size=16, block_indices=indices)
    model = get_peft_model(tiny_llama(), cfg)
    layer = model.base_model.model.model.layers[1].self_attn.v_proj
    assert layer.smt_indices["default"].tolist() == [[0, 1], [3, 2]]
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 3 * 256
    # set_smt_block_indices replaces the selection (and the optimizer's parameters in place)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    set_smt_block_indices(model, {"model.layers.0.self_attn.k_proj": [[1, 1]]}, optimizer=opt)
    in_optimizer = {id(p) for p in opt.param_groups[0]["params"]}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert in_optimizer == {id(p) for p in trainable}
    assert sum(p.numel() for p in trainable) == 256
    assert model.peft_config["default"].block_indices == {"model.layers.0.self_attn.k_proj": [[1, 1]]}
