"""The composed jobs on 2 gloo ranks (each its own emulated node): ``hf-dtrain pretrain`` and ``hf-dtrain finetune``
with ACP-SGD + DELTA + in-memory fault tolerance. Each run checks that the loss falls and that every part did its
work (bytes counted by the hook and compressed, saved activations under the budget, a snapshot per step); then rank
1 is SIGKILLed after step 6, the job relaunched, and the steps after the restore equal the uninterrupted run's."""

import json
import sys

import pytest

from hf_dtrain.testing import elastic_launch, stop_snapshot_processes

pytestmark = pytest.mark.slow

PARTS = [
    "--comm-hook",
    "acp_sgd",
    "--comm-hook.start-iter",
    "4",
    "--comm-hook.rank",
    "2",
    "--delta.budget",
    "0.5",
    "--fault-tolerance.parity",
    "1",
    "--progress",
    "false",
    "--logging-steps",
    "1",
]


def _run(tmp_path, name, job_argv, fault=None):
    out, ft = tmp_path / name, tmp_path / f"{name}_ft"
    out.mkdir()
    cli = ["hf_dtrain.cli", *job_argv, *PARTS, "--fault-tolerance.directory", str(ft), "--output-dir", str(out)]
    argv = [sys.executable, "-m", *cli]
    try:
        if fault:  # the same job under the testing fault injector: rank:step killed after that step's snapshot
            codes = elastic_launch(
                [sys.executable, "-m", "hf_dtrain.testing.fault", fault, *cli],
                2,
                timeout=600,
                log_dir=str(out),
                preloaded=True,
            )
            assert codes[1] == -9 and codes[0] != 0, codes  # rank 1 killed itself, the agent stopped rank 0
        codes = elastic_launch(argv, 2, timeout=600, log_dir=str(out), preloaded=True)
        assert codes == [0, 0], open(out / "rank0.out").read()[-4000:]
    finally:
        stop_snapshot_processes(ft)
    return out


def test_composed_pretraining_resumes_exactly_after_a_killed_rank(tmp_path):
    job = [
        "pretrain",
        "--preset",
        "tiny",
        "--max-steps",
        "12",
        "--per-device-train-batch-size",
        "4",
        "--seq-len",
        "64",
        "--data-bytes",
        "300000",
        "--save-model",
        "false",
        "--learning-rate",
        "2e-3",
        "--warmup-steps",
        "2",
    ]
    ref = _run(tmp_path, "ref", job)
    results = [json.load(open(ref / f"results_rank{r}.json")) for r in range(2)]
    losses = [h["loss"] for h in results[0]["history"]]
    assert sum(losses[-4:]) < sum(losses[:4])  # the loss falls
    wire = results[0]["wire"]
    assert wire["steps"] == 12 and wire["bytes_last_step"] < wire["bytes_per_step_mean"]  # compressed after step 4
    delta = results[0]["delta"]
    budget = max(delta["budget_bytes"].values())
    assert delta["saved_bytes"] and all(b <= budget for b in delta["saved_bytes"])
    assert {a for plan in delta["plans"].values() for a in plan.values()} != {"keep"}  # the budget bit
    assert results[0]["fault_tolerance"]["snapshots"] == 12 and results[0]["fault_tolerance"]["restored"] is None

    run = _run(tmp_path, "run", job, fault="1:6")
    resumed = [json.load(open(run / f"results_rank{r}.json")) for r in range(2)]
    restored = resumed[0]["fault_tolerance"]["restored"]
    # the newest step both ranks hold: 6, or 5 when the agent stopped rank 0 before its step-6 copy was committed
    assert restored["source"] == "memory" and restored["step"] in (5, 6), restored
    for r in range(2):
        assert resumed[r]["fault_tolerance"]["restored"] == restored
        after = {h["step"]: h["loss"] for h in resumed[r]["history"]}
        want = {h["step"]: h["loss"] for h in results[r]["history"] if h["step"] > restored["step"]}
        assert after == want  # every step after the restore bit for bit, ACP-SGD's error feedback included


def test_composed_finetuning_resumes_exactly_after_a_killed_rank(tmp_path, tiny_base):
    base = tiny_base(50)
    job = [
        "finetune",
        "--method",
        "lorafa",
        "--lora-r",
        "16",
        "--model",
        base,
        "--max-steps",
        "12",
        "--per-device-train-batch-size",
        "8",
        "--eval-size",
        "16",
        "--train-size",
        "512",
        "--report",
        "false",
    ]
    ref = _run(tmp_path, "ref", job)
    results = json.load(open(ref / "results.json"))
    losses = results["losses"]
    steps = sorted(int(s) for s in losses)
    assert steps == list(range(1, 13))
    assert sum(losses[str(s)] for s in steps[-4:]) < sum(losses[str(s)] for s in steps[:4])
    assert (
        results["comm"]["steps"] >= 12 and results["comm"]["bytes_last_step"] < results["comm"]["bytes_per_step_mean"]
    )
    assert results["delta"]["saved_bytes"] and all(
        b <= max(results["delta"]["budget_bytes"].values()) for b in results["delta"]["saved_bytes"]
    )
    assert results["fault_tolerance"]["snapshots"] == 12

    run = _run(tmp_path, "run", job, fault="1:6")
    resumed = json.load(open(run / "results.json"))
    restored = resumed["fault_tolerance"]["restored"]
    assert restored["source"] == "memory" and restored["step"] in (5, 6), restored
    after = {s: v for s, v in resumed["losses"].items() if int(s) > restored["step"]}
    assert after == {s: v for s, v in losses.items() if int(s) > restored["step"]}  # the Trainer's resume, exact


def test_decentralized_pretraining_with_the_heterogeneity_aware_sampler(tmp_path):
    """DecentLaM gossip under DDP's noop hook, with rank 1 three times as fast as rank 0: rank 1 gets three times
    the batch, both take the same steps, the gossip bytes are counted, and the loss falls."""
    out = tmp_path / "out"
    out.mkdir()
    argv = [
        sys.executable,
        "-m",
        "hf_dtrain.cli",
        "pretrain",
        "--preset",
        "tiny",
        "--max-steps",
        "12",
        "--per-device-train-batch-size",
        "4",
        "--seq-len",
        "64",
        "--data-bytes",
        "300000",
        "--save-model",
        "false",
        "--optimizer",
        "decentlam",
        "--learning-rate",
        "0.05",
        "--hetero-speeds",
        "1",
        "3",
        "--progress",
        "false",
        "--output-dir",
        str(out),
    ]
    assert elastic_launch(argv, 2, timeout=600, log_dir=str(out), preloaded=True) == [0, 0], open(
        out / "rank0.out"
    ).read()[-3000:]
    results = [json.load(open(out / f"results_rank{r}.json")) for r in range(2)]
    assert [r["batch_size"] for r in results] == [2, 6]  # a global batch of 8 split 1:3
    assert all(len(r["history"]) == 12 for r in results)
    assert results[0]["wire"]["steps"] == 12 and results[0]["wire"]["bytes_per_step_mean"] > 0
    losses = [h["loss"] for h in results[1]["history"]]
    assert sum(losses[-3:]) < sum(losses[:3])
