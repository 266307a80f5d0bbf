import json
import os

import pytest
import torch

from hf_dtrain import models
from hf_dtrain.testing import tiny_default_base


@pytest.fixture(scope="module")
def small_tokenizer():
    docs = models.stdlib_text(max_bytes=150_000)
    return models.train_tokenizer(docs + ["12+345=357", "7+8=15"], vocab_size=400)


def test_stdlib_text_is_deterministic_and_capped():
    a, b = models.stdlib_text(100_000), models.stdlib_text(100_000)
    assert a == b
    total = sum(len(t.encode()) for t in a)
    assert 100_000 <= total < 100_000 + max(len(t.encode()) for t in a) + 1
    assert not any("site-packages" in str(p) for p in models.stdlib_source_files())


def test_tokenizer_round_trips_and_splits_digits(small_tokenizer):
    tok = small_tokenizer
    assert len(tok) == 400
    text = "def add(x, y):\n    return x + 12345  # ünïcode ✓\n"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    digits = tok.convert_ids_to_tokens(tok("12345", add_special_tokens=False)["input_ids"])
    assert digits == list("12345")
    assert tok.convert_ids_to_tokens(tok("12+345=", add_special_tokens=False)["input_ids"]) == list("12+345=")
    assert {tok.bos_token, tok.eos_token, tok.pad_token} == {"<s>", "</s>", "<pad>"}
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DTRAIN_CACHE", str(tmp_path))
    assert models.cache_root() == tmp_path
    assert models.default_model_dir("tiny").parent == tmp_path / "base"
    assert models.default_model_dir("tiny", steps=1) != models.default_model_dir("tiny", steps=2)
    assert models.cache_root(tmp_path / "x") == tmp_path / "x"


def test_default_model_is_built_once_cached_and_loadable(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    n0 = models.build_count
    path = tiny_default_base(tmp_path, steps=3)
    assert models.build_count == n0 + 1
    marker = os.path.join(path, "hf_dtrain_base.json")
    mtime = os.path.getmtime(marker)
    assert tiny_default_base(tmp_path, steps=3) == path
    assert models.build_count == n0 + 1 and os.path.getmtime(marker) == mtime
    assert os.path.dirname(path) == str(tmp_path / "base") and os.path.basename(path).startswith("test-")
    assert [p for p in os.listdir(tmp_path / "base") if p.startswith(".tmp")] == []
    assert os.path.exists(os.path.join(path, "model.safetensors"))
    info = json.load(open(marker))
    assert info["preset"] == "test" and info["steps"] == 3

    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size == len(tok) and tok.pad_token == "<pad>"
    ids = torch.tensor([tok("1+2=")["input_ids"]])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tok))

    _lm, tok2 = models.load_model_and_tokenizer(path)
    assert tok2("x")["input_ids"] == tok("x")["input_ids"]


def test_build_is_atomic(tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        tiny_default_base(tmp_path, steps=1)
    assert os.listdir(tmp_path / "base") == []  # neither a half final directory nor a temporary one
    monkeypatch.undo()
    path = tiny_default_base(tmp_path, steps=1)
    assert os.path.isfile(os.path.join(path, "hf_dtrain_base.json"))


def test_load_default_uses_build(monkeypatch, tmp_path):
    calls = []
    path = tiny_default_base(tmp_path, steps=1)

    def fake_build(preset="tiny", steps=None, progress=True, **kw):
        calls.append(preset)
        return path

    monkeypatch.setattr(models, "build_default_model", fake_build)
    _model, tok = models.load_model_and_tokenizer(None, preset="test")
    assert calls == ["test"] and tok.eos_token == "</s>"


def test_pretraining_and_the_fault_worker_load_neither_peft_nor_trl(tmp_path):
    """A plain model's job (pretrain on FSDP2's and TP's sharding code, the fault-test worker) imports neither peft
    nor TRL (seconds of imports in every process, every restart): ``is_tuner_layer`` answers without peft."""
    import subprocess
    import sys

    script = f"""
import sys
import hf_dtrain.cli as cli
import hf_dtrain.parallel.fsdp, hf_dtrain.parallel.state, hf_dtrain.parallel.tensor, hf_dtrain.testing.ft_worker
try:
    cli.main(["pretrain", "--max-steps", "1", "--seq-len", "16", "--per-device-train-batch-size", "2",
              "--data-bytes", "20000", "--eval-blocks", "1", "--progress", "false", "--save-model", "false",
              "--output-dir", {str(tmp_path / "run")!r}])
except SystemExit as e:
    assert not e.code, e.code
print("loaded:", sorted(m for m in ("peft", "trl") if m in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loaded: []" in done.stdout, done.stdout[-2000:]
