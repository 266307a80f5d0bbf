"""The planner: legal plans are exactly what the runtime accepts, the cost model's terms move the way the system
does, plans that do not fit name the buffer, `hf-dtrain plan` prints the best plan's flags and refuses what cannot
run, and `hf-dtrain pretrain --plan auto` measures the launched ranks and runs the plan it chose."""

import dataclasses
import json
import os
import sys

import pytest
import torch

from hf_dtrain import processes
from hf_dtrain.models import build_llama, llama_config
from hf_dtrain.parallel.planner import GiB, MachineProfile, Plan, legal_plans, predict, rank_plans, traced_memory


def test_legal_plans_are_what_the_runtime_accepts():
    from hf_dtrain.parallel import PipelineConfig
    from hf_dtrain.parallel.mesh import ParallelConfig, check_parallel

    config = llama_config("small")  # 8 heads, 8 layers
    plans = legal_plans(config, 8, 16)
    assert plans and len({p.key for p in plans}) == len(plans)
    for p in plans:
        assert p.pp * p.dp_replicate * p.dp_shard * p.tp == 8
        pipeline = (
            PipelineConfig(schedule=p.schedule, stages_per_rank=p.stages_per_rank, microbatches=p.microbatches)
            if p.pp > 1
            else PipelineConfig()
        )
        check_parallel(
            ParallelConfig(tp=p.tp, pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard), 8, config, pipeline
        )
        if p.pp > 1:
            pipeline.n_microbatches(p.pp, 16 // (p.dp_replicate * p.dp_shard))
    # tp 3 divides nothing here, tp 16 > heads: never offered; every divisor pattern of 8 is
    assert {p.tp for p in plans} == {1, 2, 4, 8}
    assert {(p.pp, p.stages_per_rank) for p in plans} >= {(1, 1), (2, 1), (2, 2), (4, 2), (8, 1)}


def test_the_cost_model_moves_the_way_the_system_does():
    config, profile = llama_config("llama2-7b"), MachineProfile.preset("h100")

    def plan(**kw):
        base = dict(pp=1, dp_replicate=1, dp_shard=8, tp=1, microbatches=1)
        return predict(Plan(**{**base, **kw}), config, profile, 32, 4096)

    # more micro-batches shrink the bubble; GPipe keeps every micro-batch's activations, 1F1B at most pp
    few, many = plan(pp=2, dp_shard=4, microbatches=2), plan(pp=2, dp_shard=4, microbatches=8)
    assert many.breakdown["bubble_fraction"] < few.breakdown["bubble_fraction"]
    gpipe = plan(pp=2, dp_shard=4, microbatches=8, schedule="GPipe")
    assert gpipe.memory["activations"] > many.memory["activations"]
    # sharding over more ranks: less optimizer state per rank; recomputation: fewer activations, more time
    assert plan(dp_shard=8).memory["optimizer_state"] < plan(dp_replicate=8, dp_shard=1).memory["optimizer_state"]
    ckpt = plan(activation="checkpoint")
    assert ckpt.memory["activations"] < plan().memory["activations"] and ckpt.step_time > plan().step_time
    # tensor parallelism across nodes pays the slow link
    import dataclasses

    inter = dataclasses.replace(profile, ranks_per_node=2)
    assert (
        predict(Plan(pp=1, dp_replicate=1, dp_shard=2, tp=4, microbatches=1), config, inter, 32, 4096).step_time
        > predict(Plan(pp=1, dp_replicate=1, dp_shard=2, tp=4, microbatches=1), config, profile, 32, 4096).step_time
    )


def test_a_plan_that_does_not_fit_names_the_buffer():
    plans = rank_plans(llama_config("llama2-70b"), 8, MachineProfile.preset("h100"), 8, 4096)
    assert not any(p.fits for p in plans)  # 70B x 16 bytes of training state / 8 GPUs > 80 GiB
    worst = plans[0]
    assert "GiB > 80.0 GiB" in worst.overflow and "is the largest buffer" in worst.overflow
    assert sum(worst.memory.values()) > 80 * GiB


def test_the_planner_command(capsys):
    from hf_dtrain.cli import main

    assert main(["plan", "--preset", "llama2-7b", "--world-size", "64", "--top", "5", "--trace", "0"]) == 0
    out = capsys.readouterr().out
    assert "legal plans for llama2-7b on 64 devices" in out and "hf-dtrain pretrain --tp" in out
    assert "num_processes: 64" in out and "(arithmetic)" in out and "(traced)" not in out
    tiny = ["plan", "--preset", "tiny", "--world-size", "2", "--top", "2", "--seq-len", "64"]
    assert main([*tiny, "--trace-seconds", "0"]) == 0
    out = capsys.readouterr().out
    assert out.count("(traced)") == 2 and "mixed_precision: bf16" in out and "was spent" not in out
    assert main([*tiny, "--trace-seconds", "1e-6"]) == 0  # spent after the first trace: the rest by the arithmetic
    out = capsys.readouterr().out
    assert out.count("(traced)") == 1 and "memory traced for 1 of the first 2 rows" in out
    with pytest.raises(SystemExit, match=r"no plan fits in 80.0 GiB per device"):
        main(["plan", "--preset", "llama2-70b", "--world-size", "8", "--trace", "0"])
    # 32 ranks with at most tp 4 x pp 4 (4 heads, 4 layers) leave >= 2 replicas, which 3 sequences do not split over
    with pytest.raises(SystemExit, match=r"no legal plan for 32 ranks and a global batch of 3"):
        main(["plan", "--preset", "tiny", "--world-size", "32", "--global-batch", "3"])
    with pytest.raises(SystemExit, match=r"--activation \['swap'\]"):
        main(["plan", "--preset", "tiny", "--world-size", "4", "--activation", "swap"])


def test_traced_memory_decides_what_fits():
    """The first rows' memory is traced (the real layout on fake tensors), and a plan the arithmetic lets through but
    the trace does not is moved below the plans that fit, the next row traced in its place."""
    import dataclasses

    config = llama_config("tiny")
    profile = dataclasses.replace(MachineProfile.preset("h100"), device_memory=64 * GiB)
    ranked = rank_plans(config, 2, profile, 4, 64, activations=("none",), trace=2)
    first, second = ranked[:2]
    assert first.traced and second.traced and not any(p.traced for p in ranked[2:])
    traced = sum(first.memory.values())
    assert traced == sum(traced_memory(first, config, 2, 4, 64).values())
    assert set(first.memory) >= {"parameters", "gradients", "optimizer state", "activations"}
    # a device that the arithmetic says holds the first plan and the trace says does not
    arithmetic = sum(predict(Plan(**_plan_fields(first)), config, profile, 4, 64).memory.values())
    assert arithmetic < traced  # the per-token constants miss the loss's temporaries at this size
    tight = dataclasses.replace(profile, device_memory=(arithmetic + traced) / 2)
    again = rank_plans(config, 2, tight, 4, 64, activations=("none",), trace=1)
    assert again[0].key != first.key and again[0].traced and again[0].fits
    moved = next(p for p in again if p.key == first.key)
    assert moved.traced and not moved.fits and "is the largest buffer" in moved.overflow


def test_a_pipeline_plan_is_traced_with_the_cut_its_cost_model_made():
    """``predict`` records the layer cut it balanced, and the trace lays the stages out with it: moving one of the
    tiny preset's layers onto the last stage moves that layer's parameters into the larger rank's memory."""
    config = llama_config("tiny")
    plan = predict(Plan(pp=2, dp_replicate=1, dp_shard=1, tp=1, microbatches=2), config, MachineProfile(), 2, 32)
    assert plan.layer_cut and plan.layer_cut[0][0] == 0 and plan.layer_cut[-1][1] == config.num_hidden_layers
    even = traced_memory(dataclasses.replace(plan, layer_cut=[[0, 2], [2, 4]]), config, 2, 2, 32)
    uneven = traced_memory(dataclasses.replace(plan, layer_cut=[[0, 1], [1, 4]]), config, 2, 2, 32)
    layer = sum(p.numel() for p in build_llama("tiny").model.layers[0].parameters()) * 4
    assert uneven["parameters"] - even["parameters"] == layer


def _plan_fields(plan):
    return {k: getattr(plan, k) for k in ("pp", "dp_replicate", "dp_shard", "tp", "microbatches", "activation")}


def test_a_70b_plan_traces_through_its_real_shapes():
    """Llama 2 70B's layer shapes (4 of its 80 layers, 8 KV heads, 32k vocabulary) laid out TP 8 x PP 4 x DP 2 over
    64 fake ranks: the larger of the two traced ranks (the first stage's, the last's) holds its stage's share of the
    parameters, a layer and the embedding or head in 16 shards, and FSDP2's gathered units at its peak."""
    config = llama_config("llama2-70b", num_hidden_layers=4)
    plan = Plan(pp=4, dp_replicate=1, dp_shard=2, tp=8, microbatches=4)
    memory = traced_memory(plan, config, 64, 8, 256, autocast=None)
    h, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    layer = 2 * h * h + 2 * h * kv + 3 * h * f
    # the larger rank: one layer and the embedding (or the head) in 16 shards (tp 8 x dp_shard 2), fp32, and at its
    # peak FSDP2's gathered units (the layer's and the embedding's tp shards)
    shard = 4 * (layer + h * v) / 16
    held = memory["parameters"]
    assert shard <= held <= shard + 4 * (layer + h * v) / 8 + 4 * 4 * h, (held, shard)
    assert memory["activations"] > 0 and memory["gradients"] >= shard


@pytest.mark.slow
def test_pretrain_plan_auto_runs_the_plan_it_chose(tmp_path):
    from hf_dtrain.testing import free_port

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "auto"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "-m",
        "hf_dtrain.cli",
        "pretrain",
        "--preset",
        "tiny",
        "--max-steps",
        "3",
        "--per-device-train-batch-size",
        "4",
        "--seq-len",
        "64",
        "--progress",
        "false",
        "--data-bytes",
        "300000",
        "--eval-blocks",
        "8",
        "--plan",
        "auto",
        "--output-dir",
        str(out),
        "--save-model",
        "false",
    ]
    proc = processes.run(
        cmd, capture_output=True, text=True, cwd=root, timeout=400, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "--plan auto chose" in proc.stdout
    results = json.loads((out / "results.json").read_text())
    chosen = proc.stdout.split("--plan auto chose ")[1].split()[0]
    pp, dpr, dps, tp = (int(chosen.split("-")[i][len(k) :]) for i, k in enumerate(("pp", "dpr", "dps", "tp")))
    assert results["engine"] == f"mesh pp {pp} x dp_replicate {dpr} x dp_shard {dps} x tp {tp}"
    assert len(results["history"]) == 3


def test_a_plan_is_traced_on_its_fewest_equal_ranks():
    """A rank's memory does not change with the number of replicas beyond two (HSDP's exchange across them): the
    planner traces a plan of 4 replicas x 2 shards on 2 x 2 fake ranks (a plan for 100,000 devices on a few), and
    that equals the trace on all 8."""
    from hf_dtrain.parallel.mesh import trace_layout

    config = llama_config("tiny")

    def build(device):
        from transformers import LlamaForCausalLM

        with torch.device(device):
            return LlamaForCausalLM(config)

    plan = predict(Plan(pp=1, dp_replicate=4, dp_shard=2, tp=1, microbatches=1), config, MachineProfile(), 16, 32)
    full = trace_layout(build, {"pp": 1, "dp_replicate": 4, "dp_shard": 2, "tp": 1}, batch_size=2, seq_len=32)
    assert traced_memory(plan, config, 8, 16, 32) == dict(full.split)
