"""``python -m hf_dtrain.testing.gpu_check``: its CPU dry run goes end to end (every step runs on CPU where it can,
the CUDA-only measurement is skipped with its reason), a failing step is reported while the others still run, and
without a GPU or ``--cpu-dry-run`` it says what to do."""

import json
import os
import sys

import pytest
import torch

from hf_dtrain import processes
from hf_dtrain.testing import gpu_check

pytestmark = pytest.mark.slow


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU dry run and the no-GPU message")
def test_cpu_dry_run_end_to_end(tmp_path):
    """The dry run with bf16 treated as unsupported (``HF_DTRAIN_CPU_BF16=0``, as on a CPU that only emulates it, where
    its bf16 matmul peak alone took more than 9 minutes): the throughput step measures in fp32 and says so."""
    proc = processes.run(
        [sys.executable, "-m", "hf_dtrain.testing.gpu_check", "--cpu-dry-run", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ, HF_DTRAIN_CPU_BF16="0"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (folder,) = list(tmp_path.iterdir())
    assert {p.name for p in folder.iterdir()} == {"gpu_check.json", "gpu_check.md", "gpu_check.png"}
    report = json.loads((folder / "gpu_check.json").read_text())
    status = {r["step"]: r for r in report["steps"]}
    assert list(status) == [s.name for s in gpu_check.STEPS]
    assert status["peak_memory"]["status"] == "skipped"
    assert "CUDA" in status["peak_memory"]["detail"]["reason"]
    assert "[skipped] peak_memory" in proc.stdout and "needs a CUDA device" in proc.stdout
    for name in (
        "cuda_tests",
        "tuners_autocast",
        "bnb_4bit",
        "qahira_merge",
        "comm_hooks",
        "delta_memory",
        "snapshot_stall",
        "fused_sweep",
        "throughput",
        "multi_gpu",
    ):
        assert status[name]["status"] == "passed", status[name]
    assert status["cuda_tests"]["detail"]["counts"].get("skipped", 0) >= 1  # the CUDA tests exist and skip here
    assert set(status["tuners_autocast"]["detail"]) == {"lora", "smt", "lorafa", "qbara", "qahira"}
    assert status["comm_hooks"]["detail"]["hooks"] == gpu_check.HOOKS
    merge = status["qahira_merge"]["detail"]
    assert merge["max_logit_diff_after_merge"] < 1e-4 < merge["adapter_logit_change"]
    delta = status["delta_memory"]["detail"]
    # a plan per budget: the tighter budget keeps no more layers, and something is offloaded or recomputed
    assert delta["delta_0.25"]["plan"]["keep"] <= delta["delta_0.5"]["plan"]["keep"]
    assert delta["delta_0.25"]["plan"]["offload"] + delta["delta_0.25"]["plan"]["recompute"] > 0
    assert delta["delta_0.25"]["tier"] == "FileTier" and delta["none"]["step_vs_none"] == 1.0
    stall = status["snapshot_stall"]["detail"]
    assert stall["hf_dtrain_snapshot"]["state_bytes"] > 0 and stall["stall_ours_vs_dcp"] > 0
    assert status["fused_sweep"]["detail"]["max_rel_loss_diff_fused_vs_alone"] < 1e-4  # fused = alone, on the device
    detail = status["throughput"]["detail"]
    assert "fp32" in detail["shapes"]["1b"]["peak_source"], detail["shapes"]["1b"]["peak_source"]
    rows = detail["shapes"]["1b"]["rows"]  # the benchmark's mechanics on the test shape
    assert set(rows) == {"lora eager", "lora_fast eager", "lorafa eager"} and rows["lora eager"]["vs_lora"] == 1.0
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["peak_bytes"] > 0 for r in rows.values())
    # each eager row's step traced by the estimator and held against the row's own step (here the tensors' peak by
    # the profiler's memory events; on a GPU, max_memory_allocated): within 5%
    for name, row in (*rows.items(), *detail["shapes"]["8b"]["rows"].items()):
        assert row["estimated_peak_bytes"] > 0 and abs(row["estimate_over_measured"] - 1) <= 0.05, (name, row)
    # each row says which path its layers took: peft's own LoRA plain, through hf_dtrain.fast and LoRA-FA lean
    assert rows["lora eager"]["paths"]["layers"] == 0
    for row in ("lora_fast eager", "lorafa eager"):
        assert rows[row]["paths"]["lean"] == rows[row]["paths"]["layers"] > 0
    # the step profile ran on the device's shape too: LoRA's ops are the unit, the lean LoRA keeps less
    assert detail["profile"]["lora"]["ops_vs_lora"] == 1.0 and detail["profile"]["lora_fast"]["saved_vs_lora"] < 1
    # the second run (the 8B shape's, checkpointed) appended its row after the first run's to one file
    assert detail["shapes"]["8b"]["checkpointing"] and set(detail["shapes"]["8b"]["rows"]) == {"lora eager"}
    # the second run took the first one's matmul peak instead of timing it again
    one_b_peak = detail["shapes"]["1b"]["peak_source"]
    assert detail["shapes"]["8b"]["peak_source"] == f"{one_b_peak} (taken from throughput_dry_run_1b.json)"
    assert detail["runs_file_shapes"] == [
        ["test", False, "lora"],
        ["test", False, "lora_fast"],
        ["test", False, "lorafa"],
        ["test", True, "lora"],
    ]
    multi = status["multi_gpu"]["detail"]  # the 2-rank NCCL steps, run over gloo here
    assert multi["backend"] == "gloo" and multi["comm_hooks"] == gpu_check.HOOKS
    assert multi["fsdp2"]["max_loss_rel_diff"] < 1e-4 and multi["snapshot"]["step"] == 2
    assert multi["onebit_lamb"]["losses"][-1] < multi["onebit_lamb"]["losses"][0]
    assert "NCCL needs 2 GPUs" in multi["note"]
    assert report["environment"]["dry_run"] is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_without_a_gpu_it_says_what_to_do(capsys):
    assert gpu_check.main([]) == 2
    assert "--cpu-dry-run" in capsys.readouterr().err


def test_a_failing_step_is_reported_and_the_others_still_run(tmp_path):
    def broken(ctx):
        raise RuntimeError("kernel launch failed")

    def fine(ctx):
        return {"note": "ok"}

    steps = [gpu_check.Step("a", "breaks", broken), gpu_check.Step("b", "works", fine)]
    ctx = gpu_check.Context(device=torch.device("cpu"), dry_run=True, quick=True)
    results = gpu_check.run(steps, ctx, progress=False)
    assert [r["status"] for r in results] == ["failed", "passed"]
    assert "kernel launch failed" in results[0]["detail"]["error"]
    folder = gpu_check.write_report(results, ctx, tmp_path)
    assert "| a | breaks | failed |" in (folder / "gpu_check.md").read_text()


def _throughput_bench():
    """``benchmarks/throughput.py`` imported as a module (it is a script, not in the package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "throughput_bench", Path(__file__).resolve().parents[1] / "benchmarks" / "throughput.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_throughput_counts_attention_flops_with_grouped_kv_heads():
    """The throughput table's FLOPs on a Llama with fewer key/value heads than query heads (Llama 3.2's shape): every
    linear layer's 6 x tokens x weights plus attention's two matmuls per head, forward and backward. torch 2.11's
    counter refuses SDPA with grouped heads and 2.13's CPU path counts nothing for it; the count must see them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    bench = _throughput_bench()
    torch.manual_seed(0)
    heads, kv, width, layers, b, s = 8, 2, 128, 2, 2, 64
    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=width,
            intermediate_size=256,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            vocab_size=512,
        )
    )
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 512, (b, s))

    def step(fn):
        fn(input_ids=ids, labels=ids).loss.backward()

    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    attention = layers * 3 * 2 * (2 * b * heads * s * s * (width // heads))  # QK^T and AV; backward twice forward
    assert bench.count_flops(model, step) == 6 * b * s * linear + attention
    assert model.config._attn_implementation == "sdpa"  # restored


def test_peak_from_takes_an_earlier_runs_peak_on_the_same_device_only(tmp_path, capsys):
    """``benchmarks/throughput.py --peak-from``: an earlier run's peak on the same device is taken with its source
    named; a file without a peak, or from another device, is refused naming the flag (before any model is built)."""
    import argparse

    bench = _throughput_bench()
    earlier = tmp_path / "run.json"
    earlier.write_text(json.dumps({"device": "cpu", "peak_flops": 1e11, "peak_source": "measured: 6 matmuls"}))
    assert bench._peak_from(argparse.ArgumentParser(), str(earlier), "cpu") == {
        "peak_flops": 1e11,
        "peak_source": "measured: 6 matmuls (taken from run.json)",
    }
    for device, text, expect in (
        ("NVIDIA H200", earlier.read_text(), "measured on 'cpu', this run is on 'NVIDIA H200'"),
        ("cpu", json.dumps({"device": "cpu", "rows": []}), "not a results JSON of this benchmark with peak_flops"),
    ):
        earlier.write_text(text)
        with pytest.raises(SystemExit):
            bench._peak_from(argparse.ArgumentParser(), str(earlier), device)
        assert f"--peak-from {earlier}: {expect}" in capsys.readouterr().err
