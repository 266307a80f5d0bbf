"""peft's common tuner checks, run on all four hf_dtrain configs (modelled on the checks peft runs on its own methods
in its ``tests/testing_common.py``): model attributes, trainable parameters, save/load with one and with selected
adapters, the config round trip, merge / unmerge / safe merge, disable, unload, two adapters, delete (inactive and
active), the low-level ``inject_adapter_in_model`` API with its state-dict helpers, gradient checkpointing both ways,
and ``torch.compile``.

Every adapter starts with ``init_weights=False`` (a random non-zero start), so a check that an output changed or was
restored can fail."""

import warnings

import pytest
import torch
from peft import (
    PeftConfig,
    PeftModel,
    get_peft_model,
    get_peft_model_state_dict,
    inject_adapter_in_model,
    set_peft_model_state_dict,
)
from peft.tuners.tuners_utils import BaseTunerLayer

from hf_dtrain.testing import random_batch, tiny_llama
from tests.tuners.test_mixed_precision import CONFIGS

PREFIX = {"smt": "smt_", "lorafa": "lorafa_", "qbara": "qbara_", "qahira": "qahr_"}
NAMES = sorted(CONFIGS)


def _config(name):
    config = CONFIGS[name]()
    config.init_weights = False
    return config


def _base():
    return tiny_llama(seed=0, hidden_size=64)


def _peft(name, adapter_name="default", seed=0, base=None):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(base if base is not None else _base(), _config(name), adapter_name=adapter_name)


def _add(model, name, adapter_name, seed):
    torch.manual_seed(seed)
    model.add_adapter(adapter_name, _config(name))


BATCH = random_batch(batch=2, seq=8, seed=0)


def _logits(model):
    model.eval()
    with torch.no_grad():
        return model(input_ids=BATCH["input_ids"], attention_mask=BATCH["attention_mask"]).logits


@pytest.fixture(scope="module")
def base_logits():
    return _logits(_base())


def _assert_changed(a, b):
    assert (a - b).abs().max() > 1e-4


@pytest.mark.parametrize("name", NAMES)
def test_model_attributes_and_trainable_parameters(name):
    model = _peft(name)
    config = model.peft_config["default"]
    assert model.peft_type == config.peft_type and model.active_adapters == ["default"]
    assert model.base_model_torch_dtype == torch.float32
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(PREFIX[name] in n for n in trainable), trainable
    n_trainable, n_all = model.get_nb_trainable_parameters()
    assert n_trainable == sum(p.numel() for p in model.parameters() if p.requires_grad) and n_all > n_trainable


@pytest.mark.smoke
@pytest.mark.parametrize("name", NAMES)
def test_save_load_and_selected_adapters(name, tmp_path, base_logits):
    model = _peft(name)
    _add(model, name, "other", seed=1)
    out = _logits(model)
    _assert_changed(out, base_logits)
    model.save_pretrained(str(tmp_path / "all"))
    model.save_pretrained(str(tmp_path / "sel"), selected_adapters=["other"])
    assert (tmp_path / "all" / "other" / "adapter_model.safetensors").exists()
    assert not (tmp_path / "sel" / "adapter_model.safetensors").exists()  # only "other" was saved
    loaded = PeftModel.from_pretrained(_base(), str(tmp_path / "all"))
    torch.testing.assert_close(_logits(loaded), out, rtol=0, atol=0)
    loaded.load_adapter(str(tmp_path / "sel" / "other"), adapter_name="other")
    model.set_adapter("other")
    loaded.set_adapter("other")
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0, atol=0)
    # the config round trip: PeftConfig.from_pretrained gives the same class with the same fields
    again = PeftConfig.from_pretrained(str(tmp_path / "all"))
    assert type(again) is type(model.peft_config["default"])
    saved_by_peft = ("inference_mode", "auto_mapping")  # peft itself sets these when saving
    strip = lambda d: {k: v for k, v in d.items() if k not in saved_by_peft}  # noqa: E731
    assert strip(again.to_dict()) == strip(model.peft_config["default"].to_dict())


@pytest.mark.smoke
@pytest.mark.parametrize("name", NAMES)
def test_merge_unmerge_and_safe_merge(name):
    model = _peft(name)
    out = _logits(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    model.merge_adapter()
    torch.testing.assert_close(_logits(model), out, rtol=1e-5, atol=1e-5)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters() if n in before)
    model.unmerge_adapter()
    for n, p in model.named_parameters():
        if n in before:
            torch.testing.assert_close(p, before[n], rtol=0, atol=1e-6)
    torch.testing.assert_close(_logits(model), out, rtol=1e-5, atol=1e-5)
    merged = model.merge_and_unload(safe_merge=True)
    assert not any(isinstance(m, BaseTunerLayer) for m in merged.modules())
    torch.testing.assert_close(_logits(merged), out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_disable_and_unload(name, base_logits):
    model = _peft(name)
    out = _logits(model)
    with model.disable_adapter():
        torch.testing.assert_close(_logits(model), base_logits, rtol=0, atol=0)
    torch.testing.assert_close(_logits(model), out, rtol=0, atol=0)
    unloaded = model.unload()
    assert not any(isinstance(m, BaseTunerLayer) for m in unloaded.modules())
    torch.testing.assert_close(_logits(unloaded), base_logits, rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_two_adapters_and_delete(name):
    model = _peft(name)
    first = _logits(model)
    _add(model, name, "other", seed=1)
    torch.testing.assert_close(_logits(model), first, rtol=0, atol=0)  # adding does not activate
    model.set_adapter("other")
    second = _logits(model)
    _assert_changed(second, first)
    # delete the inactive adapter: its weights go, the active one is untouched
    model.delete_adapter("default")
    assert "default" not in model.peft_config
    assert not any(".default." in n or n.endswith(".default") for n, _ in model.named_parameters())
    torch.testing.assert_close(_logits(model), second, rtol=0, atol=0)
    # delete the active adapter: peft falls back to the remaining one, whose outputs come back unchanged
    _add(model, name, "third", seed=2)
    model.set_adapter("third")
    model.delete_adapter("third")
    assert "third" not in model.peft_config and model.active_adapters == ["other"]
    torch.testing.assert_close(_logits(model), second, rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_inject_adapter_in_model_and_state_dict_helpers(name, base_logits):
    torch.manual_seed(0)
    model = inject_adapter_in_model(_config(name), _base())
    assert any(isinstance(m, BaseTunerLayer) for m in model.modules())
    out = _logits(model)
    _assert_changed(out, base_logits)
    state = get_peft_model_state_dict(model)
    assert state and all(PREFIX[name] in k for k in state)
    torch.manual_seed(5)
    fresh = inject_adapter_in_model(_config(name), _base())
    _assert_changed(_logits(fresh), out)
    result = set_peft_model_state_dict(fresh, state)
    assert not [k for k in result.unexpected_keys if PREFIX[name] in k]
    torch.testing.assert_close(_logits(fresh), out, rtol=0, atol=0)


def _grads(model):
    return {
        n.removeprefix("_orig_mod."): p.grad.clone()
        for n, p in model.named_parameters()
        if p.requires_grad and p.numel()
    }  # (an SMT target with no block selected holds an empty parameter)


def _train_grads(model):
    model.train()
    model.zero_grad(set_to_none=True)
    model(**BATCH).loss.backward()
    return _grads(model)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_gradient_checkpointing(name, reentrant):
    want = _train_grads(_peft(name))
    base = _base()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:  # peft's and the Trainer's habit: the frozen embeddings' output must require grad
        base.enable_input_require_grads()
    model = _peft(name, base=base)
    assert model.base_model.model.is_gradient_checkpointing
    got = _train_grads(model)
    assert set(got) == set(want)
    for n in want:
        assert want[n].abs().sum() > 0, n
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_torch_compile(name):
    """``torch.compile`` traces the adapter layers (dynamo + AOTAutograd, the ``aot_eager`` backend: the same graph
    capture as inductor without generating C++); outputs and gradients equal eager mode."""
    torch._dynamo.reset()
    eager = _peft(name)
    want_out = _logits(eager)
    want = _train_grads(eager)
    model = _peft(name)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=False)
    torch.testing.assert_close(_logits(compiled), want_out, rtol=1e-5, atol=1e-5)
    got = _train_grads(compiled)
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6)
