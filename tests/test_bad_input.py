"""Malformed input, as users write it: CLI flags and YAML recipes of both jobs, the Python configs, adapter and
model directories, DeepSpeed configs and disk snapshots. Each must be refused before any process group or step with
an error of the stated class whose message names the field or the file (and none may hang: each case has a
timeout). Damaged disk snapshots are the exception that must *not* fail: the newest intact one is used instead."""

import math
import os

import pytest

from hf_dtrain import cli
from hf_dtrain.comm.config import CommHookConfig
from hf_dtrain.decentralized.config import GossipConfig
from hf_dtrain.fault import InMemoryFaultToleranceCallback, SnapshotConfig
from hf_dtrain.jobs.pretrain import PretrainConfig
from hf_dtrain.jobs.sft.config import FinetuneConfig
from hf_dtrain.memory.config import DeltaConfig
from hf_dtrain.optim.config import EvaConfig, OneBitLambConfig
from hf_dtrain.tuners import LoraFAConfig, QAHiRAConfig, QBaRAConfig, SMTConfig

pytestmark = [pytest.mark.timeout(60), pytest.mark.default_base]  # the base is built before any guard runs
NAN, INF = math.nan, math.inf

# (config class, keyword arguments, error class, a regex the message must contain: the field)
PYTHON = [
    (PretrainConfig, dict(max_steps=0), ValueError, r"max_steps"),
    (PretrainConfig, dict(max_steps=-1), ValueError, r"max_steps"),
    (PretrainConfig, dict(max_steps=2.5), ValueError, r"max_steps.*whole number"),
    (PretrainConfig, dict(max_steps=True), ValueError, r"max_steps"),
    (PretrainConfig, dict(seq_len=1), ValueError, r"seq_len"),
    (PretrainConfig, dict(seq_len="abc"), ValueError, r"seq_len"),
    (PretrainConfig, dict(per_device_train_batch_size=0), ValueError, r"per_device_train_batch_size"),
    (PretrainConfig, dict(learning_rate=0), ValueError, r"learning_rate"),
    (PretrainConfig, dict(learning_rate=-1e-3), ValueError, r"learning_rate"),
    (PretrainConfig, dict(learning_rate=NAN), ValueError, r"learning_rate.*finite"),
    (PretrainConfig, dict(learning_rate=INF), ValueError, r"learning_rate.*finite"),
    (PretrainConfig, dict(learning_rate="fast"), ValueError, r"learning_rate"),
    (PretrainConfig, dict(warmup_steps=-5), ValueError, r"warmup_steps"),
    (PretrainConfig, dict(weight_decay=-0.1), ValueError, r"weight_decay"),
    (PretrainConfig, dict(seed=-1), ValueError, r"seed"),
    (PretrainConfig, dict(data_bytes=0), ValueError, r"data_bytes"),
    (PretrainConfig, dict(eval_blocks=-1), ValueError, r"eval_blocks"),
    (PretrainConfig, dict(logging_steps=-1), ValueError, r"logging_steps"),
    (PretrainConfig, dict(progress="maybe"), ValueError, r"progress.*true or false"),
    (PretrainConfig, dict(save_model="false"), ValueError, r"save_model.*true or false"),
    (PretrainConfig, dict(preset="huge"), ValueError, r"preset"),
    (PretrainConfig, dict(dataset="missing.jsonl"), ValueError, r"dataset: missing.jsonl does not exist"),
    (PretrainConfig, dict(text_column=3), ValueError, r"text_column.*string"),
    (PretrainConfig, dict(optimizer="sgd"), ValueError, r"optimizer"),
    (PretrainConfig, dict(hetero_speeds=[1.0, -1.0]), ValueError, r"hetero_speeds"),
    (PretrainConfig, dict(hetero_speeds=[1.0, NAN]), ValueError, r"hetero_speeds"),
    (PretrainConfig, dict(hetero_speeds="fast"), ValueError, r"could not convert|hetero_speeds"),
    (PretrainConfig, dict(deepspeed="no_such_ds.json"), ValueError, r"no_such_ds.json"),
    (PretrainConfig, dict(fault_tolerance="yes please"), ValueError, r"fault_tolerance"),
    (PretrainConfig, dict(delta=INF), ValueError, r"budget.*finite"),
    (PretrainConfig, dict(delta=NAN), ValueError, r"budget.*finite"),
    (PretrainConfig, dict(delta=-0.5), ValueError, r"budget"),
    (PretrainConfig, dict(delta=1.5), ValueError, r"budget"),
    (PretrainConfig, dict(comm_hook="powersgd"), ValueError, r"comm_hook\.method"),
    (FinetuneConfig, dict(max_steps=0), ValueError, r"max_steps"),
    (FinetuneConfig, dict(per_device_train_batch_size=0), ValueError, r"per_device_train_batch_size"),
    (FinetuneConfig, dict(bf16="sometimes"), ValueError, r"SFTConfig|bf16"),
    (FinetuneConfig, dict(lora_alpha=-16), ValueError, r"lora_alpha"),
    (FinetuneConfig, dict(lora_alpha=0), ValueError, r"lora_alpha"),
    (FinetuneConfig, dict(lora_r=0), ValueError, r"lora_r"),
    (FinetuneConfig, dict(lora_dropout=1.0), ValueError, r"lora_dropout"),
    (FinetuneConfig, dict(lora_dropout=-0.1), ValueError, r"lora_dropout"),
    (FinetuneConfig, dict(warmup_steps=-5), ValueError, r"warmup_steps"),
    (FinetuneConfig, dict(gradient_accumulation_steps=0), ValueError, r"gradient_accumulation_steps"),
    (FinetuneConfig, dict(train_size=0), ValueError, r"train_size"),
    (FinetuneConfig, dict(eval_size=0), ValueError, r"eval_size"),
    (FinetuneConfig, dict(max_length=0), ValueError, r"max_length"),
    (FinetuneConfig, dict(learning_rate=NAN), ValueError, r"learning_rate"),
    (FinetuneConfig, dict(method="smt", smt={"block_size": 0}), ValueError, r"smt.block_size"),
    (FinetuneConfig, dict(method="smt", smt={"num_blocks": 0}), ValueError, r"smt.num_blocks"),
    (FinetuneConfig, dict(method="smt", smt={"warmup_steps": 0}), ValueError, r"smt.warmup_steps"),
    (FinetuneConfig, dict(quant_group_size=0), ValueError, r"quant_group_size"),
    (FinetuneConfig, dict(method="qbara", qbara={"pool": 0}), ValueError, r"qbara.pool"),
    (FinetuneConfig, dict(training={"no_such_setting": 1}), ValueError, r"no_such_setting"),
    (FinetuneConfig, dict(peft_config="./no/adapter_config.json"), ValueError, r"peft_config"),
    (FinetuneConfig, dict(task_digits=0), ValueError, r"task_digits"),
    (FinetuneConfig, dict(method="qlora"), ValueError, r"method"),
    (FinetuneConfig, dict(quantize="int8"), ValueError, r"quantize"),
    (FinetuneConfig, dict(method="smt", quantize="nf4"), ValueError, r"method.*nf4"),
    (FinetuneConfig, dict(model="/no/such/base"), ValueError, r"model: /no/such/base does not exist"),
    (FinetuneConfig, dict(dataset="./missing.csv"), ValueError, r"dataset: ./missing.csv does not exist"),
    (FinetuneConfig, dict(target_modules=[1, 2]), ValueError, r"target_modules.*strings"),
    (FinetuneConfig, dict(report="no"), ValueError, r"report.*true or false"),
    (CommHookConfig, dict(rank=0), ValueError, r"comm_hook\.rank"),
    (CommHookConfig, dict(start_iter=-1), ValueError, r"start_iter"),
    (CommHookConfig, dict(start_iter=1), ValueError, r"start_iter"),
    (CommHookConfig, dict(min_compression_rate=NAN), ValueError, r"min_compression_rate"),
    (CommHookConfig, dict(sketch_width_factor=0), ValueError, r"sketch_width_factor"),
    (CommHookConfig, dict(use_error_feedback="yes"), ValueError, r"use_error_feedback"),
    (CommHookConfig, dict(exchange="broadcast"), ValueError, r"exchange"),
    (DeltaConfig, dict(budget=None), ValueError, r"budget is required"),
    (DeltaConfig, dict(budget=NAN), ValueError, r"budget"),
    (DeltaConfig, dict(budget=INF), ValueError, r"budget"),
    (DeltaConfig, dict(budget=0.5, granularity="op"), ValueError, r"granularity"),
    (DeltaConfig, dict(budget=0.5, allow_offload="no"), ValueError, r"allow_offload"),
    (SnapshotConfig, dict(every_n_steps=0), ValueError, r"every_n_steps"),
    (SnapshotConfig, dict(parity=-1), ValueError, r"parity"),
    (SnapshotConfig, dict(timeout=-1), ValueError, r"timeout"),
    (SnapshotConfig, dict(timeout=NAN), ValueError, r"timeout"),
    (SnapshotConfig, dict(idle_exit=0), ValueError, r"idle_exit"),
    (SnapshotConfig, dict(group_size=0), ValueError, r"group_size"),
    (SnapshotConfig, dict(persist_every=-2), ValueError, r"persist_every"),
    (SnapshotConfig, dict(fresh_start="yes"), ValueError, r"fresh_start"),
    (EvaConfig, dict(damping=0), ValueError, r"damping"),
    (EvaConfig, dict(damping=NAN), ValueError, r"damping"),
    (OneBitLambConfig, dict(freeze_step=0), ValueError, r"freeze_step"),
    (GossipConfig, dict(topology="star"), ValueError, r"topology"),
    (LoraFAConfig, dict(lora_alpha=NAN), ValueError, r"lora_alpha"),
    (LoraFAConfig, dict(lora_alpha=-1), ValueError, r"lora_alpha"),
    (LoraFAConfig, dict(r=0), ValueError, r"\br\b"),
    (LoraFAConfig, dict(lora_dropout=1.5), ValueError, r"lora_dropout"),
    (QBaRAConfig, dict(pool=0), ValueError, r"pool"),
    (QBaRAConfig, dict(lora_alpha=INF), ValueError, r"lora_alpha"),
    (QAHiRAConfig, dict(group_size=0), ValueError, r"group_size"),
    (SMTConfig, dict(block_size=0), ValueError, r"block_size"),
    (SMTConfig, dict(num_blocks=4, trainable_ratio=0.1), ValueError, r"num_blocks.*trainable_ratio"),
    (SMTConfig, dict(trainable_ratio=1.5), ValueError, r"trainable_ratio"),
    (SMTConfig, dict(score="random"), ValueError, r"score"),
]


@pytest.mark.parametrize(
    "cls, kwargs, error, message",
    PYTHON,
    ids=[f"{c.__name__}-{'-'.join(f'{k}={v!r}' for k, v in kw.items())}" for c, kw, *_ in PYTHON],
)
def test_python_configs(cls, kwargs, error, message):
    with pytest.raises(error, match=message):
        # the fine-tuning job's Trainer settings are top-level keys of its plain data, as in YAML
        cls.from_dict(kwargs) if cls is FinetuneConfig else cls(**kwargs)


def test_callbacks_refuse_bad_settings():
    from hf_dtrain.memory import DeltaCallback

    with pytest.raises(ValueError, match=r"budget.*finite"):
        DeltaCallback(budget=NAN)
    with pytest.raises(ValueError, match=r"timeout"):
        InMemoryFaultToleranceCallback(timeout=-1)
    with pytest.raises(TypeError, match=r"stateful\['hook'\].*state_dict"):
        from hf_dtrain.fault import SnapshotEngine
        from hf_dtrain.testing import tiny_llama

        SnapshotEngine(tiny_llama(seed=0, hidden_size=32), stateful={"hook": object()}, parity=0)


# (job, YAML recipe text, regex the message must contain: the recipe file and the field)
RECIPES = [
    ("pretrain", "fault_tolerance: 'yes please'\n", r"fault_tolerance"),
    ("pretrain", "fault_tolerance: 'false'\n", r"fault_tolerance"),
    ("pretrain", "seq_len: abc\n", r"seq_len"),
    ("pretrain", "max_steps: -3\n", r"max_steps"),
    ("pretrain", "learning_rate: .nan\n", r"learning_rate"),
    ("pretrain", "progress: perhaps\n", r"progress"),
    ("pretrain", "eval_blocks: -1\n", r"eval_blocks"),
    ("pretrain", "delta: {budget: .inf}\n", r"budget"),
    ("pretrain", "delta: {granularity: layer}\n", r"budget is required"),
    ("pretrain", "comm_hook: {rank: 0}\n", r"comm_hook\.rank"),
    ("pretrain", "fault_tolerance: {every_n_steps: 0}\n", r"every_n_steps"),
    ("pretrain", "fault_tolerance: {parity: two}\n", r"parity"),
    ("pretrain", "fault_tolerance: {bogus: 1}\n", r"unknown key.*bogus"),
    ("pretrain", "unknown_field: 1\n", r"unknown key.*unknown_field"),
    ("pretrain", "- a\n- list\n", r"expected a mapping"),
    ("pretrain", "seq_len: [1, 2\n", r"recipe|while parsing|expected"),
    ("pretrain", "hetero_speeds: [1, 0]\n", r"hetero_speeds"),
    ("pretrain", "optimizer: eva\neva: {damping: -1}\n", r"damping"),
    ("finetune", "max_steps: 0\n", r"max_steps"),
    ("finetune", "lora_alpha: -16\n", r"lora_alpha"),
    ("finetune", "method: qlora\n", r"method"),
    ("finetune", "train_size: 0\n", r"train_size"),
    ("finetune", "gradient_accumulation_steps: 0\n", r"gradient_accumulation_steps"),
    ("finetune", "target_modules: 5\n", r"target_modules"),
    ("finetune", "deepspeed: missing_ds.json\n", r"missing_ds.json"),
    ("finetune", "lorafa: {optimizer: 'no'}\n", r"lorafa.optimizer"),
    ("finetune", "learning_rate: .nan\n", r"learning_rate"),
]


def _exit_message(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    code = info.value.code
    return (code if isinstance(code, str) else "") + capsys.readouterr().err, code


@pytest.mark.parametrize("job, text, message", RECIPES, ids=[f"{j}-{t.strip()[:30]}" for j, t, _ in RECIPES])
def test_yaml_recipes(tmp_path, capsys, job, text, message):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(text)
    out, code = _exit_message([job, "--recipe", str(recipe)], capsys)
    assert code not in (0, None)
    assert f"hf-dtrain {job}" in out and __import__("re").search(message, out), out


# (job, flags, regex the message must contain: the flag)
FLAGS = [
    ("pretrain", ["--eval-blocks", "-1"], r"eval_blocks"),
    ("pretrain", ["--max-steps", "0"], r"max_steps"),
    ("pretrain", ["--seq-len", "abc"], r"--seq-len"),
    ("pretrain", ["--data-bytes", "0"], r"data_bytes"),
    ("pretrain", ["--delta.budget", "inf"], r"budget"),
    ("pretrain", ["--delta", "nan"], r"budget"),
    ("pretrain", ["--fault-tolerance", "maybe"], r"--fault-tolerance"),
    ("pretrain", ["--fault-tolerance.timeout", "-1"], r"timeout"),
    ("pretrain", ["--fault-tolerance.parity", "x"], r"--fault-tolerance.parity"),
    ("pretrain", ["--fault-tolerance.fresh-start", "perhaps"], r"--fault-tolerance.fresh-start"),
    ("pretrain", ["--comm-hook", "powersgd"], r"comm_hook"),
    ("pretrain", ["--comm-hook.start-iter", "-1"], r"start_iter"),
    ("pretrain", ["--learning-rate", "nan"], r"learning_rate"),
    ("pretrain", ["--warmup-steps", "-5"], r"warmup_steps"),
    ("pretrain", ["--preset", "giant"], r"preset"),
    ("pretrain", ["--no-such-flag", "1"], r"unrecognized arguments"),
    ("pretrain", ["--dataset", "nowhere/at/all.txt"], r"nowhere/at/all.txt"),
    ("pretrain", ["--recipe", "no_such_recipe.yaml"], r"no_such_recipe.yaml"),
    ("finetune", ["--max-steps", "0"], r"max_steps"),
    ("finetune", ["--bf16", "maybe"], r"--bf16"),
    ("finetune", ["--lora-alpha", "-16"], r"lora_alpha"),
    ("finetune", ["--warmup-steps", "-5"], r"warmup_steps"),
    ("finetune", ["--gradient-accumulation-steps", "0"], r"gradient_accumulation_steps"),
    ("finetune", ["--train-size", "0"], r"train_size"),
    ("finetune", ["--method", "qlora"], r"--method"),
    ("finetune", ["--deepspeed", "bad.json"], r"bad.json"),
    ("finetune", ["--lora-dropout", "2"], r"lora_dropout"),
    ("finetune", ["--model", "./no/such/dir"], r"./no/such/dir"),
    ("finetune", ["--quantize", "int8"], r"quantize"),
    ("finetune", ["--per-device-train-batch-size", "0"], r"per_device_train_batch_size"),
    ("finetune", ["--target-modules", "no_such_proj"], r"target_modules=\['no_such_proj'\] match no module.*q_proj"),
    ("finetune", ["--max-length", "1"], r"max_length=1 must be >= 2"),  # TRL stopped on a one-token sequence
    ("finetune", ["--seed", "-1"], r"seed=-1 must be in 0 \.\. 2\*\*32 - 1"),  # numpy refused it after start-up
    ("sweep", ["--seed", "0,-1"], r"seed=-1 must be in 0 \.\. 2\*\*32 - 1"),
]


@pytest.mark.parametrize("job, flags, message", FLAGS, ids=[f"{j}-{' '.join(f)}" for j, f, _ in FLAGS])
def test_cli_flags(tmp_path, capsys, monkeypatch, job, flags, message):
    monkeypatch.chdir(tmp_path)
    if "bad.json" in flags:
        (tmp_path / "bad.json").write_text("{not json")
    out, code = _exit_message([job, *flags], capsys)
    assert code not in (0, None)
    assert __import__("re").search(message, out), out


def test_unreadable_deepspeed_config_names_the_file(tmp_path):
    for text, message in (
        ("{not json", r"cannot be read as JSON"),
        ('{"zero_optimization": {"stage": 7}}', r"stage must be 0, 1, 2 or 3"),
    ):
        path = tmp_path / "ds.json"
        path.write_text(text)
        with pytest.raises(ValueError, match=rf"{path}.*{message}|{message}"):
            FinetuneConfig(deepspeed=str(path))


def test_deepspeed_presets_and_the_recipe_are_one_config(tmp_path):
    """``--deepspeed zero2`` / ``zero3`` name built-in configs; the shipped recipe JSON is the zero3 preset, and an
    unknown name is neither a preset nor a file."""
    import json
    from pathlib import Path

    from hf_dtrain.parallel.zero import deepspeed_config, zero_stage
    from hf_dtrain.run.job import JobRun

    assert zero_stage(deepspeed_config("zero2")) == 2
    assert zero_stage(deepspeed_config("zero3")) == 3
    recipe = Path(__file__).resolve().parent.parent / "recipes" / "deepspeed" / "zero3.json"
    assert json.loads(recipe.read_text()) == deepspeed_config("zero3")
    with pytest.raises(ValueError, match=r"no such file and no preset; set --deepspeed to zero2 or zero3"):
        FinetuneConfig(deepspeed="zero4")
    with pytest.raises(ValueError, match=r"optimizer=eva keeps per-layer vectors"):
        JobRun(FinetuneConfig(method="lora", deepspeed="zero3", optimizer="eva"), world_size=2, start=False)


def test_trainer_deepspeed_without_cuda_is_refused_not_silently_ddp(tmp_path):
    """Accelerate does not enable DeepSpeed on a CPU: finetune says so before loading anything, instead of training
    with DDP while the user asked for ZeRO."""
    import torch

    from hf_dtrain.jobs.finetune import run_finetune

    if torch.cuda.is_available():
        pytest.skip("on a CUDA machine the Trainer takes the DeepSpeed config")
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 3}}')
    with pytest.raises(ValueError, match=r"does not enable DeepSpeed for the Trainer and would silently run DDP"):
        run_finetune(FinetuneConfig(deepspeed=str(path), model=str(tmp_path)))  # not loaded


def test_truncated_weights_name_the_file(tmp_path):
    """A model or adapter directory with a damaged ``*.safetensors``: the error names the file."""
    import torch
    from safetensors.torch import save_file

    from hf_dtrain.models import check_weight_files

    save_file({"w": torch.zeros(64, 64)}, str(tmp_path / "adapter_model.safetensors"))
    check_weight_files(str(tmp_path))  # intact
    data = (tmp_path / "adapter_model.safetensors").read_bytes()
    (tmp_path / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"adapter_model.safetensors is damaged or truncated"):
        check_weight_files(str(tmp_path))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"adapter_model.safetensors is damaged"):
        check_weight_files(str(tmp_path))


def _disk_run(ft_dir, disk, steps=4):
    import torch

    from hf_dtrain.fault import SnapshotEngine
    from hf_dtrain.testing import random_batch, tiny_llama

    torch.manual_seed(0)
    model = tiny_llama(seed=0, hidden_size=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = SnapshotEngine(model, opt, directory=ft_dir, parity=0, persist_dir=disk, persist_every=1)
    for step in range(1, steps + 1):
        model(**random_batch(batch=2, seq=8, seed=step)).loss.backward()
        engine.wait()
        opt.step()
        opt.zero_grad()
        engine.snapshot(step, extra={"next_step": step + 1})
    engine.close(shutdown=True)
    return lambda: SnapshotEngine(
        tiny_llama(seed=1, hidden_size=32),
        torch.optim.AdamW(model.parameters()),
        directory=ft_dir,
        parity=0,
        persist_dir=disk,
        persist_every=1,
    )


@pytest.mark.parametrize("damage", ["json", "truncated", "stray_folder", "flipped_byte"])
def test_a_damaged_newest_disk_snapshot_falls_back_to_the_newest_intact_one(tmp_path, caplog, damage):
    from hf_dtrain.testing import stop_snapshot_processes

    ft_dir, disk = str(tmp_path / "ft"), str(tmp_path / "disk")
    engine_factory = _disk_run(ft_dir, disk)
    try:
        newest = os.path.join(disk, "snapshot-4")
        if damage == "json":
            open(os.path.join(newest, "rank0.json"), "w").write("{damaged")
        elif damage == "truncated":
            path = os.path.join(newest, "rank0.safetensors")
            os.truncate(path, os.path.getsize(path) // 2)
        elif damage == "flipped_byte":
            path = os.path.join(newest, "rank0.safetensors")
            data = bytearray(open(path, "rb").read())
            data[-10] ^= 0xFF
            open(path, "wb").write(bytes(data))
        else:
            os.makedirs(os.path.join(disk, "snapshot-foo"))
            os.makedirs(os.path.join(disk, "snapshot-9"))  # no rank file: not a snapshot of this rank
        for f in os.listdir(os.path.join(ft_dir, "node0")):  # a relaunch as if the job had not completed
            if f.startswith("run-rank"):
                os.unlink(os.path.join(ft_dir, "node0", f))
        engine = engine_factory()
        with caplog.at_level("WARNING"):
            restored = engine.restore()
        engine.close(shutdown=True)
        if damage == "stray_folder":
            assert restored.step == 4 and restored.source == "disk"
        else:
            assert restored.step == 3 and restored.source == "disk", restored
            assert "snapshot-4" in caplog.text  # says which copy it skipped and why
    finally:
        stop_snapshot_processes(ft_dir)


def test_a_snapshot_directory_too_long_for_a_unix_socket_is_named(tmp_path):
    from hf_dtrain.fault import SnapshotEngine
    from hf_dtrain.testing import tiny_llama

    long_dir = str(tmp_path / ("d" * 90))
    with pytest.raises(ValueError, match=r"smp.sock is \d+ bytes; Unix sockets allow 107.*fault_tolerance.directory"):
        SnapshotEngine(tiny_llama(seed=0, hidden_size=32), directory=long_dir, parity=0)


def test_a_model_whose_config_does_not_match_its_weights_is_named(tmp_path, capsys, tiny_base):
    """A checkpoint whose config.json gives other shapes than its weights: one line naming the directory and the fix
    (transformers' RuntimeError traceback before)."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_base(5), model)
    config = json.loads((model / "config.json").read_text())
    config["hidden_size"] *= 2
    (model / "config.json").write_text(json.dumps(config))
    argv = ["finetune", "--model", str(model), "--max-steps", "1", "--output-dir", str(tmp_path / "out")]
    out, code = _exit_message([*argv, "--progress", "false", "--report", "false"], capsys)
    assert code not in (0, None) and "Traceback" not in out
    assert f"--model {model}: its weights do not have the shapes its config.json gives" in out, out[-2000:]
