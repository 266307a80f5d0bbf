"""Will it fit? The estimate (`--estimate`: the job's step traced on fake tensors) against the measured step, and at
LLaMA 8B and 70B beside the estimates a user has today.

    python benchmarks/estimate.py                 # both parts
    python benchmarks/estimate.py --only check    # estimated vs measured at the tiny preset (1-2 gloo ranks)
    python benchmarks/estimate.py --only large    # Llama 3 8B and Llama 2 70B (fake tensors only)
    python benchmarks/estimate.py --only job      # the estimate against the job's own run (--estimate.measure)
    python benchmarks/estimate.py --only check --from-json benchmarks/results/estimate.json   # re-render only

**check** (``results/estimate.*``): for each method x engine x gradient checkpointing, the job's step
traced on fake tensors over a fake world (the estimate) and the same step on real tensors in real gloo ranks (the
measurement: the peak of live tensor storage, torch's ``MemTracker``, on the rank that holds the most; DDP's buckets are
real there; the estimate traces rank 0 and, with a pipeline, the last stage's first rank too), through
the same composition (the job's skeleton and its engine sections); the ratio estimate / measured per cell.

**job** (``results/estimate_job.*``): the measured side is the job itself, ``hf-dtrain finetune`` through the Trainer
and TRL (and ``pretrain`` through its loop), run with ``--estimate.measure``: its last two steps' peak on rank 0,
measured by the profiler's memory events over the storages the model and optimizer hold (no code shared with the
estimator).
On the tiny preset (random weights, its trained tokenizer) and the real SmolLM2-135M-Instruct; one process and FSDP2 x 2
(torchrun, gloo); every method, the 4-bit bases in one process; gradient checkpointing off and on; every row longer
than --max-length (the estimate takes every sequence at --max-length tokens).

**large** (``results/estimates.*``): per-rank peak at bf16, 4096 tokens, micro-batch 1, for Llama 3 8B and Llama 2 70B
under several methods and layouts, with the trace's own time and host memory; beside accelerate's weight count
(``calculate_maximum_sizes``, and its "x4 for Adam" training rule), DeepSpeed's ZeRO-3 model-state estimate
(``estimate_zero3_model_states_mem_needs``) and the planner's per-token arithmetic (``hf_dtrain.parallel.planner``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _report import emit_result, markdown_table, run_worker, write

HERE = os.path.abspath(__file__)
SMALL = {"per_device_train_batch_size": 4, "max_length": 256, "report": False, "progress": False}
METHODS = ["full", "lora", "lorafa", "smt"]
ENGINES = {"one process": ({}, 1), "DDP x 2": ({}, 2), "FSDP2 x 2": ({"fsdp": {}}, 2)}
PRETRAIN = {
    "one process": ({}, 1),
    "FSDP2 x 2": ({"fsdp": {}}, 2),
    "TP x 2": ({"parallel": {"tp": 2}}, 2),
    "TP 2 x FSDP2 2": ({"parallel": {"tp": 2, "dp_shard": 2}}, 4),
    "PP x 2 (1F1B)": ({"parallel": {"pp": 2}}, 2),
    "PP x 2 (Interleaved1F1B, 2 stages a rank)": (
        {"parallel": {"pp": 2}, "pipeline": {"schedule": "Interleaved1F1B", "stages_per_rank": 2}},
        2,
    ),
    "PP 2 x FSDP2 2": ({"parallel": {"pp": 2, "dp_shard": 2}}, 4),
    "PP 2 x TP 2": ({"parallel": {"pp": 2, "tp": 2}}, 4),
}
# the 4-bit bases: (the row's name, the method, --quantize)
QUANTIZED = [
    ("QLoRA (LoRA on NF4)", "lora", "nf4"),
    ("Q-BaRA on INT4", "qbara", "int4"),
    ("QA-HiRA on HQQ", "qahira", "hqq4"),
]
# what the table has no cell for, and why (rendered into the notes)
NOT_TRACED = [
    (
        "--deepspeed (ZeRO-1 / 2 / 3)",
        "not traced (DeepSpeed's engine partitions and flattens the parameters outside what a fake tensor follows): "
        "its model states are DeepSpeed's own estimators' and the activations the traced step's; not measured here "
        "(the Trainer enables DeepSpeed only on CUDA)",
    ),
]


# your own loop's layout (hf_dtrain.parallel.trace_layout): peft LoRA / LoRA-FA on the mesh no job lays them out on
LAYOUTS = {
    "TP x 2": ({"tp": 2}, None),
    "TP 2 x FSDP2 2": ({"tp": 2, "dp_shard": 2}, None),
    "PP x 2 (1F1B)": ({"pp": 2}, {"microbatches": 2}),
    "PP 2 x TP 2": ({"pp": 2, "tp": 2}, {"microbatches": 2}),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _trace_layout(settings: dict, fake: bool) -> dict:
    """peft LoRA or LoRA-FA (r=16 on every projection, or none for ``full``) on a preset's LLaMA, laid out by
    ``hf_dtrain.parallel.trace_layout`` on ``settings['degrees']``: the estimate (fake) or this rank's measured step."""
    import warnings

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from hf_dtrain.models import llama_config
    from hf_dtrain.parallel import FSDPConfig, PipelineConfig, trace_layout
    from hf_dtrain.tuners import LoraFAConfig

    config = llama_config(settings["preset"], **settings.get("config", {}))
    dtype = getattr(torch, settings.get("dtype", "float32"))
    method = settings["method"]

    def build(device):
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(config).to(dtype)
        if method == "full":
            return model
        adapter = LoraConfig if method == "lora" else LoraFAConfig
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return get_peft_model(model, adapter(r=16, target_modules=TARGETS, lora_dropout=0.0))

    degrees = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1, **settings["degrees"]}
    pipeline = PipelineConfig(balance="uniform", **settings["pipeline"]) if settings.get("pipeline") else None
    ckpt = settings.get("gradient_checkpointing", False)
    t0 = time.perf_counter()
    memory = trace_layout(
        build,
        degrees,
        batch_size=settings["batch_size"],
        seq_len=settings["seq_len"],
        pipeline=pipeline,
        fsdp=FSDPConfig(activation_checkpointing=True) if ckpt else None,
        autocast=torch.bfloat16 if settings.get("dtype") == "bfloat16" else None,
        flops=fake,
        fake=fake,
    )
    import resource

    return {
        **memory.to_dict(),
        "trace_seconds": time.perf_counter() - t0,
        "trace_host_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _config(job: str, settings: dict):
    if job == "finetune":
        from hf_dtrain.jobs.sft.config import finetune_config_class

        return finetune_config_class().from_dict(settings)
    from hf_dtrain.jobs.pretrain.config import pretrain_config_class

    return pretrain_config_class().from_dict(settings)


def _skeleton(job: str):
    if job == "finetune":
        from hf_dtrain.jobs.finetune.skeleton import skeleton
    else:
        from hf_dtrain.jobs.pretrain.skeleton import skeleton
    return skeleton


def _trace(job: str, settings: dict, world: int, fake: bool) -> dict:
    if job == "layout":
        return _trace_layout(settings, fake)
    from hf_dtrain.estimate.job import trace_job

    cfg = _config(job, settings)
    return trace_job(cfg, _skeleton(job)(cfg), world, fake=fake).to_dict()


def _rank(rank: int, world: int, port: int, job: str, settings: dict, queue) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put(_trace(job, settings, world, fake=False))
    finally:
        dist.destroy_process_group()


def worker(spec: dict) -> dict:
    """One measurement (real tensors; ``world`` gloo ranks on this host) or one estimate, in a fresh process."""
    job, settings, world, fake = spec["job"], spec["settings"], spec["world"], spec["fake"]
    if fake or world == 1:
        return _trace(job, settings, world, fake)
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.spawn(_rank, args=(world, port, job, settings, queue), nprocs=world, join=True)
    ranks = [queue.get() for _ in range(world)]  # the largest rank's, as the estimate reports (a pipeline's differ)
    return max(ranks, key=lambda r: r["peak_bytes"])


def _run(job, settings, world, fake) -> dict:
    spec = json.dumps({"job": job, "settings": settings, "world": world, "fake": fake})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    return run_worker(HERE, ["--worker", spec], env=env, timeout=900, what=f"{job} {settings} x{world} fake={fake}")


def check() -> dict:
    rows = []
    cases = []
    for method in METHODS:
        for engine, (extra, world) in ENGINES.items():
            for ckpt in (False, True):
                settings = {**SMALL, "method": method, "gradient_checkpointing": ckpt, **extra}
                cases.append(("finetune", method, engine, ckpt, settings, world))
    for name, method, quantize in QUANTIZED:
        for engine, (extra, world) in ENGINES.items():
            for ckpt in (False, True):
                settings = {**SMALL, "method": method, "quantize": quantize, "gradient_checkpointing": ckpt, **extra}
                cases.append(("finetune", name, engine, ckpt, settings, world))
    for engine, (extra, world) in PRETRAIN.items():
        settings = {"per_device_train_batch_size": 4, "seq_len": 256, "progress": False, **extra}
        cases.append(("pretrain", "full (pretrain)", engine, False, settings, world))
    for method in ("lora", "lorafa"):
        for engine, (degrees, pipeline) in LAYOUTS.items():
            settings = {"preset": "tiny", "method": method, "degrees": degrees, "pipeline": pipeline}
            settings.update(batch_size=4, seq_len=256)
            world = 1
            for d in degrees.values():
                world *= d
            cases.append(("layout", f"{method} (peft, your loop)", engine, False, settings, world))
    for job, method, engine, ckpt, settings, world in cases:
        t0 = time.perf_counter()
        try:
            estimate = _run(job, settings, world, True)
            measured = _run(job, settings, world, False)
        except RuntimeError as e:  # said in the table, not hidden
            rows.append({"job": job, "method": method, "engine": engine, "error": str(e)[-400:]})
            print(job, method, engine, ckpt, "FAILED", str(e)[-400:], flush=True)
            continue
        row = {
            "job": job,
            "method": method,
            "engine": engine,
            "checkpointing": "on" if ckpt else "off",
            "estimated_mib": estimate["peak_bytes"] / 2**20,
            "measured_mib": measured["peak_bytes"] / 2**20,
            "ratio": estimate["peak_bytes"] / measured["peak_bytes"],
            "estimated": estimate,
            "measured": measured,
        }
        rows.append(row)
        print(
            f"{job} {method:>16} {engine:>16} ckpt {row['checkpointing']:>3}: estimated {row['estimated_mib']:8.1f} "
            f"MiB, measured {row['measured_mib']:8.1f} MiB, ratio {row['ratio']:.4f} "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    return {"rows": rows}


JOB_METHODS = ["full", "lora", "lorafa", "smt", "dora"]
JOB_ENGINES = {"one process": ({}, 1), "FSDP2 x 2": ({"fsdp": {}}, 2)}
JOB_BASES = ["tiny", "smollm2-135m-instruct"]
JOB_SHAPE = {"tiny": (4, 256), "smollm2-135m-instruct": (2, 256)}  # micro-batch, --max-length


def _job_base(name: str, scratch: str) -> dict:
    """The job's base settings: the tiny preset built once (its tokenizer trained, one pretraining step: only the
    shapes matter here), or the packaged SmolLM2-135M-Instruct (the jobs' default base)."""
    if name != "tiny":
        return {"base_preset": name}
    from hf_dtrain.models import build_default_model

    path = build_default_model("tiny", cache_dir=scratch, steps=1, progress=False, data_bytes=300_000)
    return {"model": path}


def _long_rows(scratch: str) -> str:
    """Plain-text rows of 4,000 characters of the standard library's source (longer than any --max-length here)."""
    from hf_dtrain.models import stdlib_text

    path = os.path.join(scratch, "long_rows.jsonl")
    if not os.path.exists(path):
        text = " ".join(stdlib_text(400_000))
        with open(path, "w") as f:
            for i in range(48):
                f.write(json.dumps({"text": text[i * 4000 : (i + 1) * 4000]}) + "\n")
    return path


def job_worker(spec: dict) -> dict | None:
    """One job run with --estimate.measure (under torchrun when ``world`` > 1): rank 0 returns its estimate."""
    if spec["job"] == "pretrain":
        from hf_dtrain.jobs.pretrain import run_pretrain

        results = run_pretrain(_config("pretrain", spec["settings"]))
    else:
        from hf_dtrain.jobs.finetune import run_finetune

        results = run_finetune(_config("finetune", spec["settings"]))
    return results["estimate"] if int(os.environ.get("RANK", "0")) == 0 else None


def _job_run(spec: dict, world: int) -> dict:
    from hf_dtrain import processes
    from hf_dtrain.testing import free_port

    launch = [sys.executable]
    if world > 1:
        launch += ["-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port", str(free_port())]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // world))}
    proc = processes.run(
        [*launch, HERE, "--job-worker", json.dumps(spec)], capture_output=True, text=True, env=env, timeout=1800
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-1500:])
    from _report import parse_result

    return parse_result(proc.stdout)


# SmolLM2's cells (about 150 s each on 2 cores): every method in one process both ways, FSDP2 x 2 for full fine-tuning
# and LoRA with checkpointing, the 4-bit bases without it; the tiny preset takes the whole grid
SMOLLM2_FSDP2 = {("full", True), ("lora", True)}
SMOLLM2_QUANTIZED_CHECKPOINTING = (False,)
JOB_CELLS = "estimate_job_cells.jsonl"  # one line per measured cell, so an interrupted run resumes


def _job_cases(scratch: str, bases: list[str]) -> list[tuple]:
    """(base, job, method, engine, checkpointing, settings, world) for every cell, the most telling first."""
    data = _long_rows(scratch)
    cases = []
    for base in bases:
        batch, length = JOB_SHAPE[base]
        common = {
            **_job_base(base, scratch),
            "dataset": data,
            "max_steps": 3,
            "per_device_train_batch_size": batch,
            "max_length": length,
            "train_size": 16,
            "eval_size": 4,
            "evaluate_before": False,
            "progress": False,
            "report": False,
            "estimate": {"measure": True},
        }
        for engine, (extra, world) in JOB_ENGINES.items():
            for method in JOB_METHODS:
                for ckpt in (False, True):
                    if base != "tiny" and world > 1 and (method, ckpt) not in SMOLLM2_FSDP2:
                        continue
                    settings = {**common, **extra, "method": method, "gradient_checkpointing": ckpt}
                    if method == "smt":
                        settings["smt"] = {"warmup_steps": 1}  # its scoring step, then the two measured
                    cases.append((base, "finetune", method, engine, ckpt, settings, world))
        for name, method, quantize in QUANTIZED:
            for ckpt in (False, True) if base == "tiny" else SMOLLM2_QUANTIZED_CHECKPOINTING:
                settings = {**common, "method": method, "quantize": quantize, "gradient_checkpointing": ckpt}
                cases.append((base, "finetune", name, "one process", ckpt, settings, 1))
        if base == "tiny":
            for engine, (extra, world) in JOB_ENGINES.items():
                settings = {"preset": "tiny", "max_steps": 3, "per_device_train_batch_size": 4, "seq_len": 256}
                settings.update(progress=False, estimate={"measure": True}, **extra)
                cases.append(("tiny", "pretrain", "full (pretrain)", engine, False, settings, world))
    return cases


def _cell_key(base, job, method, engine, ckpt) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", f"{base} {job} {method} {engine} ckpt-{'on' if ckpt else 'off'}").strip("-")


def job_check(scratch: str, bases: list[str]) -> dict:
    """Every cell of :func:`_job_cases` not yet in ``results/estimate_job_cells.jsonl``, each appended as it ends;
    the rows of every cell measured so far (any base)."""
    from _report import RESULTS

    cells_path = RESULTS / JOB_CELLS
    done = {}
    if cells_path.is_file():
        for line in cells_path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                done[row["cell"]] = row
    for base, job, method, engine, ckpt, settings, world in _job_cases(scratch, bases):
        key = _cell_key(base, job, method, engine, ckpt)
        if key in done and "error" not in done[key]:
            continue
        settings = {**settings, "output_dir": os.path.join(scratch, "runs", key)}
        t0 = time.perf_counter()
        row = {"cell": key, "base": base, "job": job, "method": method, "engine": engine}
        row["checkpointing"] = "on" if ckpt else "off"
        try:
            got = _job_run({"job": job, "settings": settings}, world)
        except RuntimeError as e:  # said in the table, not hidden
            row["error"] = " ".join(str(e).split())[-300:]
            print(base, job, method, engine, ckpt, "FAILED", row["error"], flush=True)
        else:
            row.update(_job_row(got, time.perf_counter() - t0))
            print(
                f"{base} {job} {method:>16} {engine:>12} ckpt {row['checkpointing']:>3}: estimated "
                f"{row['estimated_mib']:8.1f} MiB, measured {row['measured_mib']:8.1f} MiB, ratio "
                f"{row['ratio']:.4f} ({row['seconds']:.0f} s)",
                flush=True,
            )
        done[key] = row
        cells_path.parent.mkdir(parents=True, exist_ok=True)
        with open(cells_path, "a") as f:
            f.write(json.dumps(row) + "\n")
    order = {_cell_key(*c[:5]): i for i, c in enumerate(_job_cases(scratch, JOB_BASES))}
    return {"rows": sorted(done.values(), key=lambda r: order.get(r["cell"], len(order)))}


def _job_row(got: dict, seconds: float) -> dict:
    return dict(
        estimated_mib=got["peak_bytes"] / 2**20,
        measured_mib=got["measured_peak_bytes"] / 2**20,
        ratio=got["estimate_over_measured"],
        measured_steps=got["measured_steps"],
        split_mib={k: v / 2**20 for k, v in got["split_bytes"].items() if v},
        seconds=seconds,
    )


def _degrees(job: str, settings: dict, world: int) -> tuple[dict, int]:
    """The mesh degrees and micro-batches a case runs on (the planner's plan of it)."""
    if job == "layout":
        return settings["degrees"], (settings.get("pipeline") or {}).get("microbatches", 1)
    if job == "pretrain" and settings.get("parallel"):
        degrees = settings["parallel"]
        return degrees, settings["per_device_train_batch_size"] if degrees.get("pp", 1) > 1 else 1
    if world == 1:
        return {}, 1
    return ({"dp_shard": world} if "fsdp" in settings else {"dp_replicate": world}), 1


def _planner_arithmetic(model: str, job: str, settings: dict, world: int, ckpt: bool) -> float:
    """What ``hf-dtrain plan`` predicted before it traced: its per-token arithmetic (fp32 weights, gradients and AdamW
    state over the model's parameters, bytes per token per layer from a profile: the h100 preset's bf16 constants
    here), which knows nothing of the method, the 4-bit base or the Trainer's optimizer."""
    from hf_dtrain.models import llama_config
    from hf_dtrain.parallel.planner import MachineProfile, Plan, predict

    degrees, microbatches = _degrees(job, settings, world)
    full = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1, **degrees}
    plan = Plan(**full, microbatches=microbatches, activation="checkpoint" if ckpt else "none")
    per_replica = settings.get("per_device_train_batch_size") or settings.get("batch_size") or 1
    seq = settings.get("max_length") or settings.get("seq_len")
    predict(
        plan,
        llama_config(model),
        MachineProfile.preset("h100"),
        per_replica * full["dp_replicate"] * full["dp_shard"],
        seq,
    )
    return sum(plan.memory.values())


def _accelerate_bytes(model) -> int:
    from accelerate.utils import calculate_maximum_sizes

    return int(calculate_maximum_sizes(model)[0])


def large() -> dict:
    """Per-rank estimates at 8B and 70B (fake tensors), beside the weight-count and model-state estimates."""
    base = {
        "torch_dtype": "bfloat16",
        "bf16": True,
        "max_length": 4096,
        "per_device_train_batch_size": 1,
        "lora_r": 16,
        "report": False,
        "progress": False,
    }
    cases = []  # (model, method, checkpointing, engine, job, settings, world)
    for method in ("full", "lora", "lorafa", "smt"):
        for engine, extra, world in (("one GPU", {}, 1), ("FSDP2 x 8", {"fsdp": {}}, 8)):
            cases.append(("llama3-8b", method, True, engine, "finetune", {**extra, "method": method}, world))
    cases.append(("llama3-8b", "lora", False, "one GPU", "finetune", {"method": "lora"}, 1))
    for name, method, quantize in QUANTIZED:
        for engine, extra, world in (("one GPU", {}, 1), ("FSDP2 x 8", {"fsdp": {}}, 8)):
            settings = {**extra, "method": method, "quantize": quantize}
            cases.append(("llama3-8b", name, True, engine, "finetune", settings, world))
    cases.append(
        (
            "llama2-70b",
            "QLoRA (LoRA on NF4)",
            True,
            "FSDP2 x 8",
            "finetune",
            {"fsdp": {}, "method": "lora", "quantize": "nf4"},
            8,
        )
    )
    for method, engine, world in (
        ("lora", "FSDP2 x 8", 8),
        ("lora", "FSDP2 x 64", 64),
        ("full", "FSDP2 x 64", 64),
        ("lorafa", "FSDP2 x 64", 64),
        ("smt", "FSDP2 x 64", 64),
    ):
        cases.append(("llama2-70b", method, True, engine, "finetune", {"fsdp": {}, "method": method}, world))
    pretrain = {"seq_len": 4096, "per_device_train_batch_size": 1, "progress": False}
    cases.append(
        (
            "llama3-8b",
            "full (pretrain, fp32)",
            False,
            "TP x 8",
            "pretrain",
            {**pretrain, "preset": "llama3-8b", "parallel": {"tp": 8}},
            8,
        )
    )
    cases.append(
        (
            "llama3-8b",
            "full (pretrain, fp32)",
            False,
            "TP 8 x FSDP2 8",
            "pretrain",
            {**pretrain, "preset": "llama3-8b", "parallel": {"tp": 8, "dp_shard": 8}},
            64,
        )
    )
    cases.append(
        (
            "llama2-70b",
            "full (pretrain, fp32)",
            False,
            "TP 8 x PP 4 x FSDP2 2 (1F1B, 8 micro-batches)",
            "pretrain",
            {
                **pretrain,
                "per_device_train_batch_size": 8,
                "preset": "llama2-70b",
                "parallel": {"tp": 8, "pp": 4, "dp_shard": 2},
            },
            64,
        )
    )
    # without checkpointing, beside the rows above
    for method in ("full", "lorafa", "smt"):
        cases.append(("llama3-8b", method, False, "one GPU", "finetune", {"method": method}, 1))
    cases.append(("llama3-8b", "lora", False, "FSDP2 x 8", "finetune", {"fsdp": {}, "method": "lora"}, 8))
    cases.append(
        ("llama3-8b", "QLoRA (LoRA on NF4)", False, "one GPU", "finetune", {"method": "lora", "quantize": "nf4"}, 1)
    )
    cases.append(("llama2-70b", "lora", False, "FSDP2 x 64", "finetune", {"fsdp": {}, "method": "lora"}, 64))
    # peft LoRA / LoRA-FA laid out by your own loop (hf_dtrain.parallel.trace_layout): no job lays adapters out on TP
    layout = {"dtype": "bfloat16", "seq_len": 4096, "batch_size": 1}
    for method in ("lora", "lorafa"):
        for ckpt in (True, False):
            settings = {**layout, "preset": "llama3-8b", "method": method, "degrees": {"tp": 8}}
            cases.append(("llama3-8b", f"{method} (your loop)", ckpt, "TP x 8", "layout", settings, 8))
    for ckpt in (True, False):
        settings = {**layout, "preset": "llama3-8b", "method": "lora", "degrees": {"tp": 8, "dp_shard": 8}}
        cases.append(("llama3-8b", "lora (your loop)", ckpt, "TP 8 x FSDP2 8", "layout", settings, 64))
    settings = {
        **layout,
        "preset": "llama2-70b",
        "method": "lora",
        "batch_size": 8,
        "degrees": {"tp": 8, "pp": 4, "dp_shard": 2},
        "pipeline": {"microbatches": 8},
    }
    cases.append(
        (
            "llama2-70b",
            "lora (your loop)",
            True,
            "TP 8 x PP 4 x FSDP2 2 (1F1B, 8 micro-batches)",
            "layout",
            settings,
            64,
        )
    )
    rows = []
    for model, method, ckpt, engine, job, settings, world in cases:
        if job == "layout":
            settings = {**settings, "gradient_checkpointing": ckpt}
        if job == "finetune":
            settings = {**base, "model": model, "gradient_checkpointing": ckpt, **settings}
        try:
            est = _run(job, settings, world, True)
        except RuntimeError as e:
            rows.append(
                {"model": model, "method": method, "engine": engine, "checkpointing": ckpt, "error": str(e)[-300:]}
            )
            print(model, method, engine, ckpt, "FAILED", str(e)[-300:], flush=True)
            continue
        row = {
            "model": model,
            "method": method,
            "engine": engine,
            "checkpointing": "on" if ckpt else "off",
            "peak_gib": est["peak_bytes"] / 2**30,
            **{f"{k.replace(' ', '_')}_gib": v / 2**30 for k, v in est["split_bytes"].items()},
            "tflop": est["flops"] / 1e12,
            "trace_s": est["trace_seconds"],
            "host_gib": est["trace_host_bytes"] / 2**30,
            "planner_arithmetic_gib": _planner_arithmetic(model, job, settings, world, ckpt) / 2**30,
        }
        rows.append(row)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    return {"rows": rows, "beside": _beside()}


def _beside() -> dict:
    """What a user has today for the same two models: accelerate's weight count (bf16) and its x4 training rule,
    DeepSpeed ZeRO-3's model-state estimate on 8 and 64 GPUs."""
    import torch
    from transformers import LlamaForCausalLM

    from hf_dtrain.models import llama_config

    out = {}
    for name in ("llama3-8b", "llama2-70b"):
        with torch.device("meta"):
            model = LlamaForCausalLM(llama_config(name)).to(torch.bfloat16)
        weights = _accelerate_bytes(model)
        params = sum(p.numel() for p in model.parameters())
        largest = max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)
        entry = {"accelerate_weights_gib": weights / 2**30, "accelerate_adam_x4_gib": 4 * weights / 2**30}
        try:
            os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
            from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

            for gpus in (8, 64):
                _, per_gpu, *_ = estimate_zero3_model_states_mem_needs(
                    params, largest, num_gpus_per_node=8, num_nodes=gpus // 8, cpu_offload=False
                )
                # full fine-tuning's model states (bf16 weights and gradients, fp32 master and Adam): 18 B/parameter
                entry[f"deepspeed_zero3_full_x{gpus}_gib"] = per_gpu / 2**30
        except Exception as e:  # DeepSpeed not installed: said, not hidden
            entry["deepspeed"] = f"not available: {type(e).__name__}: {e}"
        out[name] = entry
    return out


def _plot_check(rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['method']}\n{r['engine']}\n{r['checkpointing']}" for r in rows]
    rows = [r for r in rows if "ratio" in r]
    ax.bar(range(len(rows)), [r["ratio"] for r in rows], color="tab:blue")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhspan(0.95, 1.05, color="tab:green", alpha=0.15, label="within 5%")
    ax.set_xticks(range(len(rows)), labels, fontsize=5, rotation=90)
    ax.set_ylabel("estimated / measured peak")
    ax.set_ylim(0.8, 1.2)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _plot_large(rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "peak_gib" in r]
    fig, ax = plt.subplots(figsize=(10, 4))
    parts = ["parameters", "gradients", "optimizer_state", "activations", "temporaries", "buffers"]
    bottom = [0.0] * len(rows)
    for part in parts:
        values = [r.get(f"{part}_gib", 0.0) for r in rows]
        ax.bar(range(len(rows)), values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(80, color="black", ls="--", lw=0.8, label="80 GiB")
    ax.set_xticks(
        range(len(rows)),
        [f"{r['model']}\n{r['method']} {r['engine']}\nckpt {r['checkpointing']}" for r in rows],
        fontsize=5,
        rotation=90,
    )
    ax.set_ylabel("GiB per rank at the step's peak")
    ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["check", "large", "job"])
    parser.add_argument(
        "--bases", default=",".join(JOB_BASES), help="job part: the bases (tiny, smollm2-135m-instruct)"
    )
    parser.add_argument("--scratch", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "hf_dtrain_estimate_job"))
    parser.add_argument("--from-json", help="re-render this part's results JSON (with --only) instead of measuring")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--job-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        emit_result(worker(json.loads(args.worker)))
        return
    if args.job_worker:
        got = job_worker(json.loads(args.job_worker))
        if got is not None:
            emit_result(got)
        return
    saved, env = None, None
    if args.from_json:
        if args.only is None:
            parser.error("--from-json re-renders one part: give --only check or --only large")
        saved = json.load(open(args.from_json))
        env = saved.pop("environment")
        saved.pop("benchmark", None)
        saved.pop("not_traced", None)
    if args.only in (None, "check"):
        result = saved or check()
        columns = [
            ("job", "job", ""),
            ("method", "method", ""),
            ("engine", "engine", ""),
            ("checkpointing", "checkpointing", ""),
            ("estimated_mib", "estimated MiB", ".1f"),
            ("measured_mib", "measured MiB", ".1f"),
            ("ratio", "estimated / measured", ".4f"),
        ]
        worst = max(abs(r["ratio"] - 1) for r in result["rows"] if "ratio" in r)
        notes = (
            f"Worst cell: {worst:.2%} off the measured peak. Micro-batch 4 x 256 tokens on the tiny preset, fp32, "
            "the largest rank's peak of live tensor storage (MemTracker) over two steps (a pipeline's: one step "
            "untraced first, in which its stages infer their shapes).\n\nNot traced:\n"
            + "\n".join(f"- {case}: {why}" for case, why in NOT_TRACED)
        )
        write("estimate", result, markdown_table(result["rows"], columns), _plot_check(result["rows"]), notes, env)
    if args.only in (None, "job"):
        os.makedirs(args.scratch, exist_ok=True)
        result = saved or job_check(args.scratch, args.bases.split(","))
        columns = [
            ("base", "base", ""),
            ("job", "job", ""),
            ("method", "method", ""),
            ("engine", "engine", ""),
            ("checkpointing", "checkpointing", ""),
            ("estimated_mib", "estimated MiB", ".1f"),
            ("measured_mib", "the job's measured MiB", ".1f"),
            ("ratio", "estimated / measured", ".4f"),
            ("error", "error", ""),
        ]
        measured = [r for r in result["rows"] if "ratio" in r]
        worst = max(measured, key=lambda r: abs(r["ratio"] - 1)) if measured else None
        outside = [r for r in measured if abs(r["ratio"] - 1) > 0.05]
        result["summary"] = {
            "cells": len(result["rows"]),
            "measured": len(measured),
            "within_5_percent": len(measured) - len(outside),
            "worst_ratio": worst["ratio"] if worst else None,
            "failed": len(result["rows"]) - len(measured),
        }
        notes = (
            f"{len(measured)} of {len(result['rows'])} cells measured; {len(measured) - len(outside)} within 5% of "
            f"the job's own peak"
            + (
                f"; the worst {worst['ratio']:.4f} ({worst['base']} {worst['method']} {worst['engine']})"
                if worst
                else ""
            )
            + ". The measured side: the job's last two optimizer steps on rank 0 (--estimate.measure; CPU: the "
            "profiler's memory events over the storages the model and optimizer hold). Every row is longer than "
            "--max-length; the tiny preset at micro-batch 4 x 256, SmolLM2-135M-Instruct at 2 x 256; the job's own "
            "precision (bf16 autocast where the CPU computes bf16 natively)."
        )
        write("estimate_job", result, markdown_table(result["rows"], columns), _plot_check(measured), notes, env)
    if args.only in (None, "large"):
        result = saved or large()
        columns = [
            ("model", "model", ""),
            ("method", "method", ""),
            ("engine", "engine", ""),
            ("checkpointing", "checkpointing", ""),
            ("peak_gib", "peak GiB", ".2f"),
            ("parameters_gib", "parameters", ".2f"),
            ("optimizer_state_gib", "optimizer", ".2f"),
            ("activations_gib", "activations", ".2f"),
            ("temporaries_gib", "temporaries", ".2f"),
            ("planner_arithmetic_gib", "planner's arithmetic GiB", ".2f"),
            ("trace_s", "trace s", ".0f"),
            ("host_gib", "host GiB", ".2f"),
        ]
        beside = "\n".join(
            f"- {k}: " + ", ".join(f"{a} {b:.1f}" if isinstance(b, float) else f"{a} {b}" for a, b in v.items())
            for k, v in result["beside"].items()
        )
        notes = (
            "bf16 weights, bf16 autocast, one sequence of 4096 tokens per rank, LoRA-family rank 16 on every "
            "projection, AdamW (the Trainer's). 'your loop': peft's model laid out by hf_dtrain.parallel.trace_layout "
            "(no job lays adapters out on TP or PP). The planner's arithmetic: what `hf-dtrain plan` predicted "
            "before it traced (fp32 weights, gradients and AdamW state, per-token activation constants: the h100 "
            "profile's), blind to the method and the 4-bit base.\n\nWhat a user has today for the same models (GiB):\n"
            + beside
        )
        write("estimates", result, markdown_table(result["rows"], columns), _plot_large(result["rows"]), notes, env)


if __name__ == "__main__":
    main()
