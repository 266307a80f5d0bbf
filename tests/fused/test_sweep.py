"""hf-dtrain sweep: every fused job equals the same job run alone (hf-dtrain finetune: peft + the Trainer)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from hf_dtrain import processes
from hf_dtrain.jobs.finetune import FinetuneConfig, run_finetune
from hf_dtrain.jobs.sweep import SweepConfig, expand_grid, run_sweep

STEPS = 20
TOL = 1e-5


@pytest.fixture(scope="module")
def base_path(tiny_base):
    return tiny_base(200)


def _job(base_path, method, **kw):
    settings = dict(
        method=method,
        model=base_path,
        task_digits=1,
        train_size=400,
        eval_size=32,
        max_steps=STEPS,
        warmup_steps=3,
        per_device_train_batch_size=8,
        logging_steps=1,
        progress=False,
        report=False,
    )
    if method == "smt":
        settings.update(smt={"block_size": 16, "warmup_steps": 3})
    settings.update(kw)
    return FinetuneConfig.from_dict(settings)


def _two_jobs(base_path, method, **kw):
    """Two jobs that differ in rank, learning rate and seed (so in init, data and data order)."""
    return [
        _job(base_path, method, lora_r=4, learning_rate=3e-3, seed=0, **kw),
        _job(base_path, method, lora_r=8, learning_rate=1e-2, seed=1, weight_decay=0.1, **kw),
    ]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def _weights(path):
    name = (
        "adapter_model.safetensors"
        if os.path.exists(os.path.join(path, "adapter_model.safetensors"))
        else "model.safetensors"
    )
    return load_file(os.path.join(path, name))


def _assert_same(fused_dir, fused_losses, alone_dir, alone_losses):
    a, b = _weights(fused_dir), _weights(alone_dir)
    assert sorted(a) == sorted(b)
    worst = max(_rel(a[k], b[k]) for k in b if b[k].is_floating_point() and b[k].norm() > 0)
    assert worst < TOL, f"final weights differ by {worst:.2e} relative"
    for step, value in alone_losses.items():
        assert abs(fused_losses[step] - value) <= TOL * abs(value), (step, fused_losses[step], value)
    assert len(fused_losses) == len(alone_losses) == STEPS


@pytest.mark.parametrize("method", ["lora", "lora-nf4", "lorafa", "lorafa-optimizer", "qbara", "full"])
def test_each_fused_job_equals_the_job_run_alone(base_path, tmp_path, method, monkeypatch):
    kw = {}
    if method == "lora-nf4":  # the frozen base a bitsandbytes 4-bit model, run once for both jobs
        kw, method = dict(quantize="nf4", quant_group_size=16), "lora"
    if method.startswith("lorafa"):
        kw["lorafa"] = {"optimizer": method == "lorafa-optimizer"}
        if kw["lorafa"]["optimizer"]:
            # peft's LoraFAOptimizer corrects g_B under bf16 autocast wherever accelerate reports bf16 (this CPU
            # does): a 1-ulp fp32 difference can flip a bf16 rounding, so the comparison runs both in fp32
            import peft.optimizers.lorafa as peft_lorafa

            monkeypatch.setattr(peft_lorafa, "is_bf16_available", lambda: False)
        method = "lorafa"
    jobs = _two_jobs(base_path, method, **kw)
    res = run_sweep(SweepConfig(jobs=jobs, output_dir=str(tmp_path / "sweep"), progress=False, report=False))
    for i, job in enumerate(jobs):
        row = res["jobs"][i]
        assert row["status"] == "ok"
        alone = run_finetune(
            dataclasses.replace(job, training={**job.training, "output_dir": str(tmp_path / f"alone{i}")})
        )
        _assert_same(
            row["output_dir"], {int(k): v for k, v in row["losses"].items()}, alone["output_dir"], alone["losses"]
        )


def _trainer_reference(base_path, job: FinetuneConfig, peft_config, out):
    """The job alone with peft and the Trainer (the arguments hf-dtrain finetune uses)."""
    from peft import get_peft_model
    from transformers import Trainer, TrainingArguments, set_seed

    from hf_dtrain import tasks
    from hf_dtrain.models import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(base_path)
    train = tasks.make_task_dataset(tok, job.train_size, seed=job.seed, split="train", digits=job.task_digits)
    set_seed(job.seed)
    model = get_peft_model(model, peft_config)
    a = job.training_args()
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=a.max_steps,
        learning_rate=a.learning_rate,
        per_device_train_batch_size=a.per_device_train_batch_size,
        warmup_steps=a.warmup_steps,
        weight_decay=a.weight_decay,
        lr_scheduler_type="linear",
        seed=a.seed,
        data_seed=a.seed,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        remove_unused_columns=False,
        max_grad_norm=1.0,
    )
    trainer = Trainer(model=model, args=args, data_collator=tasks.task_collator(tok), train_dataset=train)
    trainer.train()
    model.save_pretrained(str(out))
    return str(out), {int(h["step"]): float(h["loss"]) for h in trainer.state.log_history if "loss" in h}


def test_fused_smt_jobs_equal_the_trainer_on_their_own_blocks(base_path, tmp_path):
    """Each SMT job selects its blocks on its own data (the warm-up, as hf-dtrain finetune does under DDP); then
    its fused training equals peft + the Trainer on those blocks."""
    from hf_dtrain.tuners.smt import SMTConfig

    jobs = _two_jobs(base_path, "smt")
    res = run_sweep(SweepConfig(jobs=jobs, output_dir=str(tmp_path / "sweep"), progress=False, report=False))
    selections = []
    for i, job in enumerate(jobs):
        row = res["jobs"][i]
        with open(os.path.join(row["output_dir"], "adapter_config.json")) as f:
            blocks = json.load(f)["block_indices"]
        selections.append(blocks)
        ref = SMTConfig(target_modules=["q_proj", "k_proj", "v_proj"], block_size=16, block_indices=blocks)
        alone_dir, alone_losses = _trainer_reference(base_path, job, ref, tmp_path / f"alone{i}")
        _assert_same(row["output_dir"], {int(k): v for k, v in row["losses"].items()}, alone_dir, alone_losses)
    assert selections[0] != selections[1]  # each job its own blocks


def test_groups_split_by_the_memory_guard_train_the_same_jobs(base_path, tmp_path):
    jobs = expand_grid(_job(base_path, "lora", max_steps=6), lora_r=[4, 8], seed=[0, 1])[:3]
    one = run_sweep(SweepConfig(jobs=jobs, output_dir=str(tmp_path / "one"), progress=False, report=False))
    split = run_sweep(
        SweepConfig(
            jobs=jobs,
            fused=dict(max_jobs_per_group=2),
            output_dir=str(tmp_path / "split"),
            progress=False,
            report=False,
        )
    )
    assert one["groups"] == [[0, 1, 2]] and split["groups"] == [[0, 1], [2]]
    for a, b in zip(one["jobs"], split["jobs"]):
        wa, wb = _weights(a["output_dir"]), _weights(b["output_dir"])
        assert max(_rel(wa[k], wb[k]) for k in wa if wb[k].norm() > 0) < TOL  # other padding: rounding only
    with pytest.raises(ValueError, match="not even one job fits"):
        run_sweep(
            SweepConfig(
                jobs=jobs,
                fused=dict(memory_budget="64KB"),
                output_dir=str(tmp_path / "x"),
                progress=False,
                report=False,
            )
        )


def test_a_diverging_job_is_stopped_and_reported_and_the_others_are_untouched(base_path, tmp_path):
    good = _job(base_path, "lora", max_steps=8, warmup_steps=0, learning_rate=3e-3)
    bad = _job(base_path, "lora", max_steps=8, warmup_steps=0, learning_rate=1e30, seed=1)
    both = run_sweep(SweepConfig(jobs=[good, bad], output_dir=str(tmp_path / "both"), progress=False, report=False))
    alone = run_sweep(SweepConfig(jobs=[good], output_dir=str(tmp_path / "alone"), progress=False, report=False))
    ok, diverged = both["jobs"]
    assert ok["status"] == "ok"
    assert diverged["status"].startswith("stopped at step") and "non-finite" in diverged["status"]
    assert not os.path.exists(os.path.join(diverged["output_dir"], "adapter_model.safetensors"))
    wa, wb = _weights(ok["output_dir"]), _weights(alone["jobs"][0]["output_dir"])
    assert max(_rel(wa[k], wb[k]) for k in wb if wb[k].norm() > 0) < 1e-6
    with open(tmp_path / "both" / "sweep.md") as f:
        assert "stopped at step" in f.read()


def test_cli_sweep_writes_a_peft_adapter_card_and_row_per_job_and_the_sweep_table(base_path, tmp_path):
    from peft import PeftModel

    from hf_dtrain.cli import main
    from hf_dtrain.models import load_model_and_tokenizer

    out = tmp_path / "cli"
    main(
        [
            "sweep",
            "--method",
            "lorafa",
            "--model",
            base_path,
            "--lr",
            "1e-3,3e-3",
            "--r",
            "4,8",
            "--seed",
            "0",
            "--max-steps",
            "5",
            "--train-size",
            "200",
            "--eval-size",
            "16",
            "--task-digits",
            "1",
            "--per-device-train-batch-size",
            "8",
            "--output-dir",
            str(out),
            "--progress",
            "false",
            "--report",
            "false",
        ]
    )
    with open(out / "sweep.json") as f:
        sweep = json.load(f)
    names = [r["job"] for r in sweep["jobs"]]
    assert names == ["lr0p001-r4", "lr0p001-r8", "lr0p003-r4", "lr0p003-r8"]
    for f in ("sweep.md", "sweep.png", "README.md"):
        assert (out / f).stat().st_size > 0
    for name in names:
        for f in ("adapter_config.json", "adapter_model.safetensors", "README.md", "results.json"):
            assert (out / name / f).exists(), (name, f)
    base, _ = load_model_and_tokenizer(base_path)
    model = PeftModel.from_pretrained(base, str(out / names[3]))
    assert model.peft_config["default"].r == 8
    assert len(sweep["losses"][names[0]]) == 5


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(method="dora"), "cannot be fused: DoRA"),
        (dict(method="qahira"), "cannot be fused: QA-HiRA"),
        (dict(max_steps=7), "a different max_steps"),
        (dict(base_preset="small", model=None), "different base models"),
        (dict(comm_hook="acp_sgd"), "comm_hook is set"),
        (dict(gradient_accumulation_steps=2), "gradient_accumulation_steps=2"),
    ],
)
def test_incompatible_jobs_are_refused_naming_the_job_and_the_reason(base_path, change, message):
    other = {"method": "lora", "seed": 3, **change}
    jobs = [_job(base_path, "lora"), _job(base_path, other.pop("method"), **other)]
    with pytest.raises(ValueError, match=message) as err:
        SweepConfig(jobs=jobs)
    assert "job 1" in str(err.value) or "job 0" in str(err.value)


def test_grid_flags_are_checked_before_any_work(base_path):
    from hf_dtrain.cli import main

    with pytest.raises(ValueError, match="cannot vary between fused jobs"):
        expand_grid(_job(base_path, "lora"), max_steps=[1, 2])
    with pytest.raises(SystemExit, match="cannot be fused"):
        main(["sweep", "--method", "qahira", "--model", base_path, "--lr", "1e-3,2e-3"])
    with pytest.raises(SystemExit):
        main(["sweep", "--method", "lora", "--r", "4,x"])
    with pytest.raises(SystemExit, match="not even one job fits"):  # the memory guard, before any training step
        main(
            [
                "sweep",
                "--method",
                "lora",
                "--model",
                base_path,
                "--r",
                "4,8",
                "--task-digits",
                "1",
                "--train-size",
                "64",
                "--fused.memory-budget",
                "64KB",
                "--progress",
                "false",
            ]
        )


@pytest.mark.slow
def test_sweep_under_accelerate_launch_is_data_parallel_over_the_fused_array(base_path, tmp_path):
    """Two gloo ranks, each feeding its shard of every job's batches into one DDP-wrapped fused model: a job equals
    the same job under hf-dtrain finetune on the same two ranks (the Trainer's DDP)."""
    import sys

    from hf_dtrain.testing import free_port

    common = [
        "--model",
        base_path,
        "--task-digits",
        "1",
        "--train-size",
        "400",
        "--eval-size",
        "16",
        "--max-steps",
        "12",
        "--warmup-steps",
        "2",
        "--per-device-train-batch-size",
        "4",
        "--progress",
        "false",
        "--report",
        "false",
        "--logging-steps",
        "1",
        "--method",
        "lora",
    ]
    env = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def launch(*args):
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
            *args,
            *common,
        ]
        proc = processes.run(cmd, capture_output=True, text=True, env=env, cwd=root, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]

    launch("sweep", "--lr", "3e-3,1e-2", "--r", "4,8", "--output-dir", str(tmp_path / "sweep"))
    launch("finetune", "--learning-rate", "1e-2", "--lora-r", "8", "--output-dir", str(tmp_path / "alone"))
    with open(tmp_path / "sweep" / "lr0p01-r8" / "results.json") as f:
        fused = json.load(f)
    with open(tmp_path / "alone" / "results.json") as f:
        alone = json.load(f)
    assert fused["world_size"] == alone["world_size"] == 2
    a, b = _weights(tmp_path / "sweep" / "lr0p01-r8"), _weights(tmp_path / "alone")
    assert max(_rel(a[k], b[k]) for k in b if b[k].norm() > 0) < TOL
    for step, value in alone["losses"].items():
        assert abs(fused["losses"][step] - value) <= TOL * abs(value)


def test_the_sweep_recipe_and_flags_reach_the_configs_unchanged():
    import dataclasses

    from hf_dtrain.cli import build_parser
    from hf_dtrain.fused import FusedConfig
    from hf_dtrain.jobs.sweep import config_from_args

    ns = build_parser("sweep").parse_args(
        [
            "--recipe",
            "recipes/sweep_lorafa.yaml",
            "--seed",
            "5",
            "--fused.memory-budget",
            "2GiB",
            "--fused.max-grad-norm",
            "0.5",
            "--max-steps",
            "7",
        ]
    )
    cfg = config_from_args(ns)
    assert len(cfg.jobs) == 4  # lr 2 x r 2; the --seed flag replaced the recipe's seed axis
    args = [j.training_args() for j in cfg.jobs]
    assert {(a.learning_rate, j.lora_r, a.seed, a.max_steps, j.method) for a, j in zip(args, cfg.jobs)} == {
        (lr, r, 5, 7, "lorafa") for lr in (1e-3, 4e-3) for r in (8, 16)
    }
    assert cfg.fused == FusedConfig(memory_budget="2GiB", max_grad_norm=0.5, on_overflow="split")
    assert cfg.output_dir == "outputs/sweep-lorafa"
    flags = {a.dest for a in build_parser("sweep")._actions}
    assert {f"fused.{f.name}" for f in dataclasses.fields(FusedConfig)} <= flags  # every engine field is a flag
