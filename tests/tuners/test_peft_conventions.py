"""peft's conventions on all four tuners: ``init_weights`` (True: the identity; False: a random non-zero start whose
merge is exact and which survives save/load, what peft's own test helpers rely on), and the adapter's README saying
that ``import hf_dtrain`` registers the method, with the release that wrote it."""

import json
import os
import warnings

import pytest
import torch
from peft import PeftModel, PeftType, get_peft_model

from hf_dtrain.testing import random_batch, tiny_llama
from hf_dtrain.tuners._registry import saved_peft_type
from tests.tuners.test_mixed_precision import CONFIGS


def _peft(name, **overrides):
    config = CONFIGS[name]()
    for k, v in overrides.items():
        setattr(config, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(tiny_llama(seed=0, hidden_size=64), config).eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_init_weights(name, tmp_path):
    batch = random_batch(batch=2, seq=8, seed=0)
    base = tiny_llama(seed=0, hidden_size=64).eval()(**batch).logits
    assert torch.equal(_peft(name)(**batch).logits, base)  # init_weights=True: the identity
    torch.manual_seed(0)
    model = _peft(name, init_weights=False)
    out = model(**batch).logits
    assert (out - base).abs().max() > 1e-3  # a real start, not the identity
    model.save_pretrained(str(tmp_path))
    assert json.load(open(tmp_path / "adapter_config.json"))["init_weights"] is False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = PeftModel.from_pretrained(tiny_llama(seed=0, hidden_size=64), str(tmp_path)).eval()
    torch.testing.assert_close(loaded(**batch).logits, out, rtol=0, atol=0)  # the random start was saved
    torch.testing.assert_close(model.merge_and_unload()(**batch).logits, out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_adapter_readme_says_import_hf_dtrain(name, tmp_path):
    from importlib.metadata import version

    model = _peft(name)
    model.save_pretrained(str(tmp_path))
    model.save_pretrained(str(tmp_path))  # saved again: the note is not repeated
    text = open(os.path.join(tmp_path, "README.md")).read()
    saved = json.load(open(tmp_path / "adapter_config.json"))["peft_type"]
    method = saved.partition(":")[0]
    assert text.count("import hf_dtrain  # registers") == 1
    assert f"**{method}** adapter" in text and f"hf-dtrain=={version('hf-dtrain')}" in text
    assert f"KeyError: '{saved}'" in text and "import hf_dtrain" in saved and method.isupper()


def test_an_adapter_saved_with_either_peft_type_loads(tmp_path):
    """The saved peft_type names hf_dtrain and the import (what peft's KeyError shows without it:
    tests/tuners/test_registry.py); with hf_dtrain imported, that file and one holding the bare name (written by
    earlier releases) both load through peft's PeftModel.from_pretrained, the config's peft_type the enum member."""
    model = _peft("smt", init_weights=False)
    model.save_pretrained(str(tmp_path))
    config = json.load(open(tmp_path / "adapter_config.json"))
    assert config["peft_type"] == saved_peft_type("SMT")
    batch = random_batch(batch=2, seq=8, seed=0)
    out = model(**batch).logits
    for peft_type in (config["peft_type"], "SMT"):
        json.dump({**config, "peft_type": peft_type}, open(tmp_path / "adapter_config.json", "w"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = PeftModel.from_pretrained(tiny_llama(seed=0, hidden_size=64), str(tmp_path)).eval()
        assert loaded.peft_config["default"].peft_type is PeftType.SMT
        torch.testing.assert_close(loaded(**batch).logits, out, rtol=0, atol=0)


def test_training_smt_with_no_blocks_selected_warns(recwarn):
    """A client that only passes ``peft_config=SMTConfig(num_blocks=...)`` (TRL without the selection callback)
    would train nothing: a warning says what to add, and the backward fails (no block is trainable) instead of
    running steps that change nothing."""
    import hf_dtrain.tuners.smt.layer as smt_layer
    from hf_dtrain.tuners import SMTConfig

    smt_layer._WARNED.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(
            tiny_llama(seed=0, hidden_size=64), SMTConfig(block_size=16, num_blocks=4, target_modules=["q_proj"])
        )
    loss = model(**random_batch(batch=2, seq=8, seed=0)).loss
    with pytest.raises(RuntimeError, match="does not require grad"):
        loss.backward()
    assert any("no blocks selected" in str(w.message) and "SMTSelectionCallback()" in str(w.message) for w in recwarn)
    recwarn.clear()
    smt_layer._WARNED.clear()
    model = _peft("smt")  # explicit blocks: no warning
    model.train()
    model(**random_batch(batch=2, seq=8, seed=0)).loss.backward()
    assert not any("no blocks selected" in str(w.message) for w in recwarn)
