"""``--estimate`` on the jobs: the job's own step traced on fake tensors before the process group, checked against the
same step measured on real tensors, the refusal of a run that will not fit (before any weight is read) and the flag
that runs it anyway, the real shapes of LLaMA 8B / 70B / 3.2 1B through every dense tuner, and the bad inputs."""

import json
import os
import subprocess
import sys

import pytest
import torch

from hf_dtrain.estimate.job import trace_job
from hf_dtrain.jobs.finetune.skeleton import skeleton
from hf_dtrain.jobs.sft.config import finetune_config_class
from hf_dtrain.models import llama_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = dict(per_device_train_batch_size=2, max_length=128, report=False, progress=False)


def _cfg(tmp_path, **settings):
    return finetune_config_class().from_dict({**SMALL, "output_dir": str(tmp_path / "out"), **settings})


def _cli(*argv, timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, "-m", "hf_dtrain.cli", *argv], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.parametrize("method, checkpointing", [("lora", True), ("lorafa", False), ("smt", True), ("full", True)])
def test_the_jobs_estimate_is_its_measured_step(tmp_path, method, checkpointing):
    """The estimate (fake tensors, fake world) within 5% of the same composition on real tensors: the job's model,
    method (SMT's blocks seeded), lean paths, checkpointing and the Trainer's optimizer."""
    cfg = _cfg(tmp_path, method=method, gradient_checkpointing=checkpointing)
    estimate = trace_job(cfg, skeleton(cfg), 1).memory
    measured = trace_job(cfg, skeleton(cfg), 1, fake=False).memory
    assert abs(estimate.peak / measured.peak - 1) <= 0.05, (estimate, measured)
    assert estimate.split["parameters"] == measured.split["parameters"]
    assert estimate.flops == measured.flops > 0


def test_estimate_answers_without_training(tmp_path):
    from hf_dtrain.jobs.finetune import run_finetune

    cfg = _cfg(tmp_path, method="lora", estimate={"device_memory": "24GiB"}, dataset=str(tmp_path / "none.jsonl"))
    results = run_finetune(cfg)["estimate"]
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == ["estimate.json", "estimate.png"]  # nothing trained, saved or downloaded
    assert json.loads((out / "estimate.json").read_text())["peak_bytes"] == results["peak_bytes"]
    assert results["fits"] is True and results["device_memory_bytes"] == 24 * 2**30
    assert sum(results["split_bytes"].values()) == results["peak_bytes"]
    # the base's parameters, counted apart from the trace: the tiny preset's (the embedded default's shape) + LoRA's
    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        base = LlamaForCausalLM(llama_config("tiny"))
    base_bytes = sum(p.numel() * 4 for p in base.parameters())
    assert base_bytes < results["split_bytes"]["parameters"] < 1.1 * base_bytes
    assert any("none.jsonl is not read (it does not exist" in note for note in results["notes"])


def test_a_step_that_will_not_fit_is_refused_before_any_weight_is_read(tmp_path):
    """A model directory holding only config.json: the run would fail loading weights, so a refusal naming the peak
    proves the check came first; the alternatives are traced, each with its peak."""
    model_dir = tmp_path / "config-only"
    llama_config("tiny").save_pretrained(model_dir)
    argv = ["finetune", "--model", str(model_dir), "--method", "lora", "--output-dir", str(tmp_path / "out")]
    argv += ["--per-device-train-batch-size", "4", "--max-length", "256", "--progress", "false"]
    proc = _cli(*argv, "--estimate.train", "true", "--device-memory", "20MB")
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert "the training step will not fit" in line and "against 20.0 MiB" in line, line
    assert "the largest part is activations" in line and "--per-device-train-batch-size 1:" in line, line
    assert "--run-anyway" in line
    assert not (tmp_path / "out" / "results.json").exists()
    # --run-anyway: past the check, to the weights it then reads (and does not find: the job's own refusal)
    proc = _cli(*argv, "--estimate.train", "true", "--device-memory", "20MB", "--run-anyway")
    assert "running anyway" in proc.stdout, proc.stdout[-2000:]
    assert proc.returncode == 1 and "weight" in proc.stderr.lower(), proc.stderr[-2000:]


def test_run_anyway_trains(tmp_path):
    from hf_dtrain.jobs.finetune import run_finetune
    from hf_dtrain.testing.models import tiny_default_base

    base = tiny_default_base(tmp_path / "cache", steps=1)
    settings = dict(model=base, method="lora", max_steps=2, train_size=64, eval_size=2, task_digits=1)
    settings.update(estimate={"train": True, "device_memory": "1MB", "anyway": True, "alternatives": False})
    results = run_finetune(_cfg(tmp_path, **settings))
    assert results["train_steps"] == 2 if "train_steps" in results else results["global_step"] == 2
    assert (tmp_path / "out" / "estimate.json").exists() and (tmp_path / "out" / "results.json").exists()


@pytest.mark.parametrize(
    "shape, method, world",
    [
        ("llama3-8b", "full", 8),
        ("llama3-8b", "lora", 8),
        ("llama3-8b", "lorafa", 8),
        ("llama3-8b", "smt", 8),
        ("llama2-70b", "lora", 64),
        ("llama3.2-1b", "lora", 1),
    ],
)
def test_real_shapes_trace_through_the_real_layers(tmp_path, shape, method, world):
    """Each preset's real layer shapes (grouped KV heads, 128k or 32k vocabulary, tied or untied embeddings) at two
    decoder layers, bf16, 1024 tokens, FSDP2 over a fake world where ``world`` > 1: the step's FLOPs are at least the
    forward's dense products at those shapes, and the parameters held are the shard (or the whole model)."""
    config = llama_config(shape, num_hidden_layers=2)
    config.save_pretrained(tmp_path / shape)
    settings = dict(model=str(tmp_path / shape), method=method, torch_dtype="bfloat16", bf16=True, max_length=1024)
    settings.update(per_device_train_batch_size=1, gradient_checkpointing=True)
    if world > 1:
        settings["fsdp"] = {}
    cfg = _cfg(tmp_path, **settings)
    memory = trace_job(cfg, skeleton(cfg), world).memory
    h, f, v, kv = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_key_value_heads
    head_dim = h // config.num_attention_heads
    per_layer = h * h * 2 + 2 * h * kv * head_dim + 3 * h * f  # q, o, k, v, gate, up, down
    dense = 2 * 1024 * (2 * per_layer + h * v)  # the forward's products at these shapes, once
    assert memory.flops >= 2 * dense, (memory.flops, dense)
    model_bytes = 2 * (2 * per_layer + (1 if config.tie_word_embeddings else 2) * h * v)
    held = memory.split["parameters"]
    if world == 1:
        assert model_bytes <= held <= 1.05 * model_bytes
    else:  # the shard, plus at most the layers gathered for the step (one decoder layer and the embeddings)
        assert held < model_bytes / 2


@pytest.mark.parametrize(
    "argv, said",
    [
        (["finetune", "--estimate", "--device-memory", "80XB"], "estimate.device_memory='80XB' is not a size"),
        (
            ["finetune", "--estimate", "--model", "not-a-preset-or-model"],
            "model='not-a-preset-or-model': no model config",
        ),
        (
            ["finetune", "--estimate", "--method", "qbara", "--quantize", "nf4"],
            "quantize=nf4: a 4-bit base cannot be traced",
        ),
        (["pretrain", "--estimate", "--world-size", "3", "--tp", "2"], "--tp"),
        (["finetune", "--estimate", "--world-size", "0"], "world_size"),
    ],
)
def test_bad_input_is_one_line_naming_it(tmp_path, argv, said):
    proc = _cli(*argv, "--output-dir", str(tmp_path / "out"))
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and said in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()
