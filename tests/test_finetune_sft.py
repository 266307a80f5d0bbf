"""``hf-dtrain finetune`` as a user with a local LLaMA checkpoint runs it: TRL's three data formats from JSONL files,
the labels masked where the format says (positions computed here, independently of TRL), packing on and off, bf16
autocast on CPU, gradient checkpointing, ``--resume-from-checkpoint``, and ``--peft-config`` with saved peft and
hf_dtrain configs."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch

from hf_dtrain import processes
from hf_dtrain.cli import main
from hf_dtrain.jobs.sft.config import FinetuneConfig
from hf_dtrain.jobs.sft.data import load_base_and_data
from hf_dtrain.testing import chat_llama_checkpoint

ROWS = 48


def _pairs():
    return [(f"{a}+{b}=", str(a + b)) for a, b in ((i % 7 + 1, (i * 3) % 9 + 1) for i in range(ROWS))]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    model = chat_llama_checkpoint(root / "my-llama", root / "cache", steps=20)
    files = {}
    for kind, row in (
        ("text", lambda p, c: {"text": f"{p}{c}"}),
        ("prompt-completion", lambda p, c: {"prompt": p, "completion": c}),
        (
            "conversational",
            lambda p, c: {"messages": [{"role": "user", "content": p[:-1]}, {"role": "assistant", "content": c}]},
        ),
    ):
        path = root / f"{kind}.jsonl"
        path.write_text("".join(json.dumps(row(p, c)) + "\n" for p, c in _pairs()))
        files[kind] = str(path)
    return model, files, root


def _config(model, dataset, **settings):
    return FinetuneConfig.from_dict(
        dict(model=model, dataset=dataset, eval_size=8, progress=False, report=False, **settings)
    )


def _expected(tok, kind, row, assistant_only):
    """(input_ids, labels) the format says, from the tokenizer and the chat template alone."""
    if kind == "text":
        ids = tok(row["text"] + tok.eos_token)["input_ids"]
        return ids, list(ids)
    if kind == "prompt-completion":
        prompt = tok(row["prompt"])["input_ids"]
        ids = tok(row["prompt"] + row["completion"] + tok.eos_token)["input_ids"]
        assert ids[: len(prompt)] == prompt
        return ids, [-100] * len(prompt) + ids[len(prompt) :]
    ids = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"]
    if not assistant_only:
        return ids, list(ids)
    head = tok.apply_chat_template(row["messages"][:-1], tokenize=True, add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    assert ids[: len(head)] == head  # the template renders the prompt alone the same way
    return ids, [-100] * len(head) + ids[len(head) :]  # the answer and its eos, nothing of the prompt


@pytest.mark.parametrize("kind", ["text", "prompt-completion", "conversational"])
@pytest.mark.parametrize("packing", [False, True])
def test_labels_are_masked_where_the_format_says(setup, kind, packing):
    model, files, _ = setup
    assistant_only = kind == "conversational"
    cfg = _config(model, files[kind], assistant_only_loss=assistant_only, packing=packing, max_length=64)
    data = load_base_and_data(cfg, progress=False, load_model=False)
    assert data.data_format == {"text": "language modeling"}.get(kind, kind)
    raw = [json.loads(line) for line in open(files[kind])]
    want = Counter()
    for row in raw:
        ids, labels = _expected(data.tokenizer, kind, row, assistant_only)
        want[(tuple(ids), tuple(labels))] += 1
    got = Counter()
    for row in list(data.train) + list(data.eval):
        if packing:  # a packed row is whole examples laid end to end: cut it where they start
            assert sum(row["seq_lengths"]) == len(row["input_ids"]) <= 64
            start = 0
            for n in row["seq_lengths"]:
                got[(tuple(row["input_ids"][start : start + n]), tuple(row["labels"][start : start + n]))] += 1
                start += n
        else:
            got[(tuple(row["input_ids"]), tuple(row["labels"]))] += 1
    assert got == want
    if packing:
        assert len(data.train) < len(raw) - 8  # several examples share a row


def _run(out, *argv):
    main(
        [
            "finetune",
            *argv,
            "--output-dir",
            str(out),
            "--eval-size",
            "8",
            "--progress",
            "false",
            "--report",
            "false",
            "--logging-steps",
            "1",
            "--per-device-train-batch-size",
            "4",
            "--learning-rate",
            "3e-3",
        ]
    )
    with open(out / "results.json") as f:
        return json.load(f)


def test_chat_data_trains_with_bf16_autocast_gradient_checkpointing_and_packing(setup):
    model, files, root = setup
    r = _run(
        root / "chat",
        "--model",
        model,
        "--dataset",
        files["conversational"],
        "--method",
        "lora",
        "--assistant-only-loss",
        "--packing",
        "--max-length",
        "64",
        "--bf16",
        "--gradient-checkpointing",
        "--max-steps",
        "6",
    )
    assert r["data_format"] == "conversational" and r["mixed_precision"] == "bf16" and r["gradient_checkpointing"]
    assert r["accuracy_after"] is None  # exact match is for prompt-completion data
    assert len(r["losses"]) == 6 and r["eval_loss_after"] < r["eval_loss_before"]
    assert os.path.isfile(root / "chat" / "adapter_model.safetensors")


def test_bf16_autocast_changes_the_numbers_and_checkpointing_does_not(setup, monkeypatch):
    """bf16 really runs (the losses move by bf16 rounding, not more); gradient checkpointing recomputes the same
    forward (equal losses in fp32), and really recomputes it: each decoder layer's norms run again in the backward
    (counted on the norms: transformers checkpoints a layer's own ``forward``, which a wrapper would turn off)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    model, files, root = setup
    common = ("--model", model, "--dataset", files["prompt-completion"], "--method", "lora", "--max-steps", "3")
    norm, calls = LlamaRMSNorm.forward, []

    def counted(self, *args, **kwargs):
        calls.append(torch.is_grad_enabled())  # training forwards and their recomputation (evaluation: no grad)
        return norm(self, *args, **kwargs)

    monkeypatch.setattr(LlamaRMSNorm, "forward", counted)
    fp32 = _run(root / "fp32", *common)
    plain, calls[:] = sum(calls), []
    bf16 = _run(root / "bf16", *common, "--bf16")
    calls[:] = []
    ckpt = _run(root / "ckpt", *common, "--gradient-checkpointing")
    # per step: 2 norms a layer and the final one; checkpointed, each layer's 2 again (the final norm is not in a layer)
    assert sum(calls) == 2 * plain - 3 > plain > 0, (sum(calls), plain)
    assert fp32["mixed_precision"] == "no" and bf16["mixed_precision"] == "bf16" and ckpt["gradient_checkpointing"]
    # the step's settings as they ran: every LoRA layer lean, TRL's fused LM head (no full logits)
    speed = bf16["speed_settings"]
    lean, layers = speed["lean_layers"].split("/")
    assert speed["precision"] == "bf16" and lean == layers != "0" and speed["loss_head"] == "TRL fused LM head"
    assert ckpt["speed_settings"]["activation_checkpointing"] and not fp32["speed_settings"]["activation_checkpointing"]
    a, b, c = (torch.tensor([r["losses"][str(s)] for s in (1, 2, 3)]) for r in (fp32, bf16, ckpt))
    assert not torch.equal(a, b) and torch.allclose(a, b, rtol=0.05)
    torch.testing.assert_close(c, a, rtol=1e-6, atol=0)
    assert fp32["accuracy_before"] is not None  # prompt-completion: exact match reported


@pytest.mark.smoke
def test_resume_from_checkpoint_repeats_the_remaining_losses_exactly(setup):
    model, files, root = setup
    common = (
        "--model",
        model,
        "--dataset",
        files["text"],
        "--method",
        "lorafa",
        "--max-steps",
        "6",
        "--save-strategy",
        "steps",
        "--save-steps",
        "3",
    )
    whole = _run(root / "whole", *common)
    assert whole["data_format"] == "language modeling"
    # mark the checkpoint's logged step 1: a run that really resumes carries it over and trains only steps 4-6
    state_file = root / "whole" / "checkpoint-3" / "trainer_state.json"
    state = json.load(open(state_file))
    assert max(h["step"] for h in state["log_history"]) == 3
    next(h for h in state["log_history"] if h["step"] == 1 and "loss" in h)["loss"] = 123.0
    state_file.write_text(json.dumps(state))
    resumed = _run(root / "resumed", *common, "--resume-from-checkpoint", str(root / "whole" / "checkpoint-3"))
    assert resumed["losses"]["1"] == 123.0  # from the checkpoint, not recomputed
    assert {k: v for k, v in resumed["losses"].items() if int(k) > 1} == {
        k: v for k, v in whole["losses"].items() if int(k) > 1
    }  # steps 4-6 from the restored weights and optimizer


@pytest.mark.parametrize("which", ["lora", "smt"])
def test_peft_config_trains_a_saved_peft_or_hf_dtrain_config(setup, which):
    from peft import LoraConfig, PeftConfig

    from hf_dtrain import SMTConfig

    model, files, root = setup
    saved = root / f"{which}-config"
    config = (
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        if which == "lora"
        else SMTConfig(target_modules=["q_proj", "v_proj"], block_size=16, num_blocks=3, warmup_steps=2)
    )
    config.save_pretrained(saved)
    r = _run(
        root / f"{which}-run",
        "--model",
        model,
        "--dataset",
        files["prompt-completion"],
        "--peft-config",
        str(saved / "adapter_config.json" if which == "lora" else saved),
        "--max-steps",
        "4",
    )
    assert r["method"] == which and len(r["losses"]) == 4
    trained = PeftConfig.from_pretrained(str(root / f"{which}-run"))
    assert type(trained) is type(config) and sorted(trained.target_modules) == ["q_proj", "v_proj"]
    if which == "lora":
        assert trained.r == 4 and r["trainable_params"] == 2 * 4 * (64 + 64) * 2  # 2 layers x q, v
    else:
        assert trained.block_size == 16 and len(trained.block_indices) and r["trainable_params"] == 3 * 16 * 16


def test_a_conversational_dataset_without_a_chat_template_is_refused_naming_the_fix(setup, tmp_path):
    from hf_dtrain.testing import tiny_default_base

    _, files, root = setup
    plain = tiny_default_base(root / "cache", steps=20)
    with pytest.raises(ValueError, match=r"no chat template: set --chat-template-path"):
        load_base_and_data(_config(plain, files["conversational"]), progress=False, load_model=False)
    with pytest.raises(ValueError, match=r"--assistant-only-loss needs conversational data"):
        load_base_and_data(
            _config(plain, files["prompt-completion"], assistant_only_loss=True), progress=False, load_model=False
        )


@pytest.mark.slow
def test_the_fsdp2_chat_recipe_runs_on_two_cpu_processes_with_a_stand_in(setup):
    """recipes/finetune_llama8b_chat_fsdp2.yaml as written (SMT, bf16, FSDP2 with activation checkpointing,
    assistant-only loss, packing), with the tiny chat checkpoint and file in place of the 8B model and its dataset,
    on 2 gloo ranks: the model is sharded, the loss is finite and falls, one adapter is saved."""
    import sys

    from hf_dtrain.testing import free_port

    model, files, root = setup
    out = root / "recipe-fsdp2"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "recipes/accelerate/cpu_2proc.yaml",
        "--main_process_port",
        str(free_port()),
        "-m",
        "hf_dtrain.cli",
        "finetune",
        "--recipe",
        "recipes/finetune_llama8b_chat_fsdp2.yaml",
        "--model",
        model,
        "--dataset",
        files["conversational"],
        "--smt.block-size",
        "16",
        "--smt.warmup-steps",
        "2",
        "--max-length",
        "64",
        "--max-steps",
        "4",
        "--gradient-accumulation-steps",
        "1",
        "--per-device-train-batch-size",
        "2",
        "--learning-rate",
        "1e-2",
        "--logging-steps",
        "1",
        "--eval-size",
        "8",
        "--output-dir",
        str(out),
        "--progress",
        "false",
        "--report",
        "false",
    ]
    env = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    proc = processes.run(cmd, capture_output=True, text=True, env=env, cwd=repo, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.load(open(out / "results.json"))
    assert r["engine"] == "fsdp2" and r["world_size"] == 2 and r["mixed_precision"] == "bf16"
    assert r["data_format"] == "conversational" and r["config"]["fsdp"]["activation_checkpointing"]
    assert r["param_bytes_local"] < 0.6 * r["total_params"] * 2  # bf16 weights, about half on each rank
    losses = [r["losses"][k] for k in sorted(r["losses"], key=int)]
    assert len(losses) == 4 and all(map(torch.isfinite, torch.tensor(losses)))
    assert r["eval_loss_after"] < r["eval_loss_before"]
    assert os.path.isfile(out / "adapter_model.safetensors")


def test_the_qlora_qahira_recipe_trains_on_int4_and_merges_exactly(setup, merge_qahira_exactly):
    """recipes/finetune_qlora_qahira.yaml with the stand-in checkpoint and chat file: QA-HiRA on the 4-bit base in
    bf16, then recipes/merge_qahira_4bit.py merges into the 4-bit model with the logits unchanged."""
    model, files, root = setup
    out = root / "recipe-qahira"
    r = _run(
        out,
        "--recipe",
        "recipes/finetune_qlora_qahira.yaml",
        "--model",
        model,
        "--dataset",
        files["conversational"],
        "--quant-group-size",
        "16",
        "--max-length",
        "64",
        "--max-steps",
        "4",
        "--gradient-accumulation-steps",
        "1",
    )
    assert r["method"] == "qahira" and r["quantize"] == "int4" and r["mixed_precision"] == "bf16"
    assert r["eval_loss_after"] < r["eval_loss_before"]
    merge_qahira_exactly(out, eval_size=20)


def test_settings_an_engine_would_override_are_refused_before_any_step(setup):
    from hf_dtrain.jobs.finetune import run_finetune
    from hf_dtrain.settings import SettingsError

    model, files, _ = setup
    for data, message in (
        ({"method": "lorafa", "optim": "sgd"}, r"--optim sgd .*lorafa's own optimizer"),
        ({"method": "lora", "optim": "sgd", "optimizer": "eva"}, r"--optim sgd .*--optimizer eva"),
        ({"method": "lora", "fsdp": True, "save_strategy": "steps"}, r"save_strategy=steps with fsdp"),
    ):
        with pytest.raises(SettingsError, match=message):
            run_finetune(_config(model, files["text"], **data))
