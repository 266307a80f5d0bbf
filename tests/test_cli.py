import json
import os
import sys

import pytest
import torch

from hf_dtrain import processes
from hf_dtrain.cli import build_parser, main
from hf_dtrain.jobs.finetune import FinetuneConfig, run_finetune
from hf_dtrain.run.flags import job_config_from_args
from hf_dtrain.run.job import JobRun


def _cfg(argv):
    return job_config_from_args(build_parser("finetune").parse_args(argv), FinetuneConfig)


def test_defaults_and_flags():
    cfg = _cfg([])
    assert cfg == FinetuneConfig()
    assert cfg.method == "lorafa" and cfg.model is None
    cfg = _cfg(
        [
            "--method",
            "lorafa",
            "--max-steps",
            "7",
            "--learning-rate",
            "0.01",
            "--target-modules",
            "q_proj",
            "v_proj",
            "--lorafa.optimizer",
            "false",
            "--bf16",
            "--no-remove-unused-columns",
        ]
    )
    assert cfg.method == "lorafa" and cfg.training == {
        "max_steps": 7,
        "learning_rate": 0.01,
        "bf16": True,
        "remove_unused_columns": False,
    }
    args = cfg.training_args()
    assert (args.max_steps, args.learning_rate, args.bf16, args.remove_unused_columns) == (7, 0.01, True, False)
    assert cfg.target_modules == ["q_proj", "v_proj"] and cfg.lorafa.optimizer is False
    assert _cfg(["--method", "smt", "--smt.num-blocks", "none"]).smt.num_blocks is None
    with pytest.raises(ValueError, match=r"smt.\* settings are given but method=lora; set --method smt"):
        _cfg(["--method", "lora", "--smt.block-size", "16"])


def test_bare_section_switches_turn_their_section_on():
    """``--fsdp`` alone, as the docs write it, is ``--fsdp true``; ``--fsdp false`` stays off."""
    from hf_dtrain.parallel import FSDPConfig

    assert _cfg(["--fsdp"]).fsdp == FSDPConfig()
    assert _cfg(["--fsdp", "--fsdp.activation-checkpointing", "true"]).fsdp == FSDPConfig(activation_checkpointing=True)
    assert _cfg(["--fsdp", "false"]).fsdp is None
    assert _cfg(["--fault-tolerance"]).fault_tolerance is not None


def test_recipe_then_explicit_flags_win(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("method: dora\nmax_steps: 9\nlora_r: 4\nlearning-rate: 0.002\ntarget_modules: [q_proj]\n")
    cfg = _cfg(["--recipe", str(recipe), "--max-steps", "3"])
    assert cfg.method == "dora" and cfg.lora_r == 4 and cfg.training_args().learning_rate == 0.002
    assert cfg.training_args().max_steps == 3  # explicit flag beats the recipe
    assert cfg.target_modules == ["q_proj"]
    cfg = _cfg(["--recipe", str(recipe), "--method", "lora", "--lora-r", "8"])
    assert cfg.method == "lora" and cfg.lora_r == 8 and cfg.training_args().max_steps == 9


def test_bad_recipe_key_and_bad_method(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("method: lora\nlora_rank: 4\n")
    with pytest.raises(ValueError, match=r"recipe .*r.yaml: unknown key\(s\) \['lora_rank'\]; valid keys .*lora_r"):
        _cfg(["--recipe", str(recipe)])
    with pytest.raises(SystemExit, match="lora_rank"):
        main(["finetune", "--recipe", str(recipe)])
    recipe.write_text("method: qlora\n")
    with pytest.raises(SystemExit, match=r"method='qlora'.*--method"):
        main(["finetune", "--recipe", str(recipe)])
    with pytest.raises(SystemExit):  # argparse rejects it with the valid choices
        main(["finetune", "--method", "qlora"])
    with pytest.raises(
        ValueError,
        match=r"method='topk' is unknown; set comm_hook.method \(--comm-hook\) to one of "
        r"allreduce, bf16, fp16, acp_sgd",
    ):
        FinetuneConfig(comm_hook="topk")
    with pytest.raises(ValueError, match="one of lora, dora, full, shira, supertuning, lorafa, smt, qbara, qahira"):
        FinetuneConfig(method="adapter")
    with pytest.raises(ValueError, match=r"quantize='fp4' is unknown; set --quantize to one of nf4, hqq4, int4"):
        FinetuneConfig(method="qahira", quantize="fp4")
    with pytest.raises(
        ValueError,
        match=r"method='smt' cannot train on a nf4 base; with --quantize nf4 use --method "
        r"one of lora, dora, lorafa, qbara, qahira",
    ):
        FinetuneConfig(method="smt", quantize="nf4")
    assert _cfg(["--method", "qahira", "--quantize", "hqq4", "--quant-group-size", "16"]).quant_group_size == 16


def test_module_entry_point_and_build_base(tmp_path):
    env = dict(os.environ, HF_DTRAIN_CACHE=str(tmp_path))
    out = processes.run(
        [sys.executable, "-m", "hf_dtrain.cli", "finetune", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0 and "--recipe" in out.stdout and "--smt.block-size" in out.stdout
    assert "--gradient_checkpointing" in out.stdout and "--bf16" in out.stdout and "--packing" in out.stdout
    out = processes.run(
        [sys.executable, "-m", "hf_dtrain.cli", "build-base", "--preset", "test", "--steps", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    path = out.stdout.strip().splitlines()[-1]
    assert path.startswith(str(tmp_path / "base" / "test-")) and os.path.isfile(os.path.join(path, "config.json"))


@pytest.fixture(scope="module")
def base_path(tiny_base):
    return tiny_base(200)


def _finetune(base_path, out, method, **kw):
    cfg = FinetuneConfig.from_dict(
        dict(
            method=method,
            model=base_path,
            output_dir=str(out),
            task_digits=1,
            train_size=kw.pop("train_size", 2000),
            eval_size=kw.pop("eval_size", 10),
            max_steps=kw.pop("max_steps", 500),
            per_device_train_batch_size=16,
            logging_steps=1000,
            progress=False,
            **kw,
        )
    )
    return run_finetune(cfg)


def _check_outputs(r, out, method):
    assert r["eval_loss_after"] < r["eval_loss_before"] - 0.3
    assert r["accuracy_after"] >= r["accuracy_before"]
    for name in ("adapter_config.json", "README.md", "results.json"):
        assert os.path.isfile(os.path.join(out, name)), name
    card = open(os.path.join(out, "README.md")).read()
    assert card.startswith("---\n") and "library_name: peft" in card and "hf_dtrain" in card
    assert f"- {method}" in card and "exact-match accuracy" in card
    saved = json.load(open(os.path.join(out, "results.json")))
    assert saved["accuracy_after"] == r["accuracy_after"] and saved["method"] == method


@pytest.mark.smoke
@pytest.mark.slow
def test_finetune_lora_end_to_end(base_path, tmp_path, capsys):
    out = tmp_path / "lora"
    r = _finetune(base_path, out, "lora", learning_rate=3e-3)
    _check_outputs(r, out, "lora")
    # --fast (the default): every peft LoRA layer ran through hf_dtrain.fast's lean function
    assert r["fast"]["enabled"] and r["fast"]["layers"] > 0 and r["fast"]["lean"] == r["fast"]["layers"]
    assert r["accuracy_after"] > r["accuracy_before"]
    assert 0 < r["trainable_params"] < r["total_params"] * 0.2
    printed = capsys.readouterr().out
    assert "| method" in printed and "lora" in printed and "accuracy" in printed

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), str(out))
    assert model.peft_config["default"].r == 8


@pytest.mark.slow
def test_finetune_lorafa_end_to_end(base_path, tmp_path):
    out = tmp_path / "lorafa"
    r = _finetune(base_path, out, "lorafa", learning_rate=3e-3, fast=False)
    _check_outputs(r, out, "lorafa")
    assert not r["fast"]["enabled"] and r["fast"]["plain"] == {"switched off": r["fast"]["layers"]}
    from hf_dtrain import fast

    assert fast.enabled()  # the switch as it was before the run


@pytest.mark.slow
def test_finetune_smt_end_to_end(base_path, tmp_path):
    out = tmp_path / "smt"
    r = _finetune(base_path, out, "smt", learning_rate=3e-3, smt={"block_size": 16, "warmup_steps": 5})
    _check_outputs(r, out, "smt")


@pytest.mark.slow
def test_smts_warmup_is_not_counted_in_max_steps(base_path, tmp_path):
    """SMT's warm-up scores before the Trainer in every engine, so ``max_steps`` updates of the selected blocks follow
    it, as for every other method (one process once scored inside the Trainer's first steps: with 10 of 24 steps
    scoring SMT made 14 updates, 0.80 against 0.85 on CR; a warm-up as long as max_steps was refused)."""
    import torch

    out = tmp_path / "smt"
    settings = dict(learning_rate=3e-3, max_steps=3, save_strategy="steps", save_steps=3, train_size=64, eval_size=4)
    _finetune(base_path, out, "smt", smt={"block_size": 16, "warmup_steps": 4}, **settings)
    state = torch.load(out / "checkpoint-3" / "optimizer.pt", weights_only=True)["state"]
    assert state and {int(s["step"]) for s in state.values()} == {3}  # every selected block updated at every step


@pytest.mark.slow
@pytest.mark.parametrize("method, quantize", [("qahira", "hqq4"), ("qbara", "nf4")])  # int4 + the merge: the QLoRA
def test_finetune_on_a_4bit_base_end_to_end(
    base_path, tmp_path, method, quantize, merge_qahira_exactly
):  # recipe's test
    """Train on a 4-bit base (evaluated before training: bitsandbytes must keep its gradients), save, and reload the
    adapter onto the same 4-bit base in a fresh process with identical logits."""
    if quantize == "hqq4":
        pytest.importorskip("hqq", reason="hqq (the test extra) provides the maintained zero-point 4-bit format")
    if quantize == "nf4":
        pytest.importorskip("bitsandbytes", reason="bitsandbytes>=0.46.1 (the test extra) runs 4-bit on CPU")
    out = tmp_path / method
    r = _finetune(base_path, out, method, quantize=quantize, quant_group_size=16, learning_rate=4e-3, max_steps=500)
    _check_outputs(r, out, method)
    assert r["quantize"] == quantize
    card = open(out / "README.md").read()
    assert f"--quantize {quantize}" in card and f'load_quantized_model(path, "{quantize}", group_size=16)' in card
    code = f"""
import json, sys, torch, hf_dtrain
from peft import PeftModel
from hf_dtrain.quantization import load_quantized_model
base = load_quantized_model({base_path!r}, {quantize!r}, group_size=16).eval()
ids = torch.arange(1, 17).view(2, 8)
with torch.no_grad():
    plain = base(input_ids=ids).logits.flatten()[:64].tolist()
    model = PeftModel.from_pretrained(base, {str(out)!r}).eval()
    adapted = model(input_ids=ids).logits.flatten()[:64].tolist()
sys.stdout.write(json.dumps({{"plain": plain, "adapted": adapted}}))
"""
    runs = [processes.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300) for _ in range(2)]
    assert all(p.returncode == 0 for p in runs), runs[0].stderr[-3000:]
    first, second = (json.loads(p.stdout) for p in runs)
    assert first["adapted"] == second["adapted"]  # the saved adapter reloads deterministically onto the 4-bit base
    assert first["plain"] != first["adapted"]  # and it is the trained adapter that was loaded
    if method == "qahira":  # the recipe merges into the 4-bit model exactly, saves it, and reads it back
        merge_qahira_exactly(out)


@pytest.mark.slow
@pytest.mark.parametrize("method, quantize", [("smt", None), ("lorafa", None), ("qahira", "hqq4")])
def test_finetune_under_accelerate_launch_with_two_cpu_processes(base_path, tmp_path, method, quantize):
    """The recipe's 2-process accelerate config really gives 2 gloo ranks; SMT selects before DDP wraps; DDP carries
    a 4-bit HQQ base."""
    from hf_dtrain.testing import accelerate_launch

    if quantize == "hqq4":
        pytest.importorskip("hqq", reason="hqq (the test extra) provides the maintained zero-point 4-bit format")

    out = tmp_path / method
    cmd = [
        "-m",
        "hf_dtrain.cli",
        "finetune",
        "--method",
        method,
        "--model",
        base_path,
        "--output-dir",
        str(out),
        "--task-digits",
        "1",
        "--train-size",
        "2000",
        "--eval-size",
        "10",
        "--max-steps",
        "300",
        "--learning-rate",
        "3e-3",
        "--progress",
        "false",
        "--logging-steps",
        "1000",
    ]
    if method == "smt":
        cmd += ["--smt.block-size", "16", "--smt.warmup-steps", "5"]
    if quantize:
        cmd += ["--quantize", quantize, "--quant-group-size", "16"]
    if method == "lorafa":  # the Trainer's way in for communication hooks (hf_dtrain.callbacks.CommHookCallback)
        cmd += ["--comm-hook", "acp_sgd", "--comm-hook.rank", "2", "--comm-hook.start-iter", "5"]
    proc = accelerate_launch(*cmd, config="cpu_2proc")
    r = json.load(open(out / "results.json"))
    assert r["world_size"] == 2 and r["replicas_identical"]  # DDP really averaged the gradients
    _check_outputs(r, out, method)
    if method == "lorafa":
        assert r["comm"]["method"] == "acp_sgd" and r["comm"]["steps"] == 300  # the hook ran on every step
    assert proc.stdout.count("| method") == 1  # only rank 0 reports


def _reload_and_merge(base_path, adapter_dir):
    """The saved adapter loads with peft onto the base, changes its output and merges exactly."""
    import warnings

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.arange(1, 17).reshape(2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = AutoModelForCausalLM.from_pretrained(base_path).eval()
        with torch.no_grad():
            base_logits = base(input_ids=ids).logits
        model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        assert (logits - base_logits).abs().max() > 1e-4
        torch.testing.assert_close(model.merge_and_unload()(input_ids=ids).logits, logits, rtol=1e-4, atol=1e-4)


def _launch_finetune(config, base_path, out, method, steps, extra=()):
    from hf_dtrain.testing import accelerate_launch

    cmd = [
        "-m",
        "hf_dtrain.cli",
        "finetune",
        "--method",
        method,
        "--model",
        base_path,
        "--output-dir",
        str(out),
        "--task-digits",
        "1",
        "--train-size",
        "1000",
        "--eval-size",
        "10",
        "--max-steps",
        str(steps),
        "--learning-rate",
        "3e-3",
        "--progress",
        "false",
        "--logging-steps",
        "1",
        *extra,
    ]
    if method == "smt":
        cmd += ["--smt.block-size", "16", "--smt.warmup-steps", "5"]
    proc = accelerate_launch(*cmd, config=config)
    return proc, json.load(open(out / "results.json"))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["smt", "lorafa", "qbara", "qahira"])
def test_finetune_under_the_accelerate_fsdp2_config_shards_and_trains(base_path, tmp_path, method):
    """``accelerate launch --config_file recipes/accelerate/fsdp2_cpu_2proc.yaml ... finetune``: 2 gloo ranks, the
    model really sharded by FSDP2 (each rank holds half the parameter bytes), the loss falls, the adapter is saved
    once, reloads with peft and merges. SMT's run equals the DDP launch of the same command step for step (LoRA-FA's
    own optimizer on row shards is compared with one process in tests/parallel/test_fsdp.py)."""
    import torch
    from safetensors.torch import load_file

    from hf_dtrain.parallel import FSDPConfig

    steps = 40
    proc, r = _launch_finetune("fsdp2_cpu_2proc", base_path, tmp_path / "fsdp", method, steps)
    assert "runs as FSDP2 on CPU" in proc.stdout
    assert r["world_size"] == 2 and r["engine"] == "fsdp2"
    assert FSDPConfig(**r["config"]["fsdp"]) == FSDPConfig(
        layer_classes=["LlamaDecoderLayer"], activation_checkpointing=True
    )  # the YAML's settings
    whole = r["total_params"] * 4
    assert r["param_bytes_local"] < 0.55 * whole  # sharded: about half on each of the 2 ranks
    assert r["eval_loss_after"] < r["eval_loss_before"]
    assert proc.stdout.count("| method") == 1  # only rank 0 reports
    _reload_and_merge(base_path, tmp_path / "fsdp")
    if method == "smt":
        _, ddp = _launch_finetune("cpu_2proc", base_path, tmp_path / "ddp", method, steps)
        assert ddp["engine"] == "ddp" and ddp["param_bytes_local"] == whole
        # the same averaged gradients, reduce-scattered instead of all-reduced: float rounding only
        losses = [r["losses"][k] for k in sorted(r["losses"], key=int)]
        want = [ddp["losses"][k] for k in sorted(ddp["losses"], key=int)]
        assert len(losses) == steps
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-4, atol=0)
        saved = load_file(tmp_path / "fsdp" / "adapter_model.safetensors")
        want = load_file(tmp_path / "ddp" / "adapter_model.safetensors")
        assert saved.keys() == want.keys()
        for k, v in want.items():
            # Adam's normalised steps turn rounding differences of tiny gradients into differences of up to
            # ~1e-3 of the tensor's scale after 40 steps
            scale = float(v.abs().max()) if v.numel() else 0.0
            torch.testing.assert_close(saved[k], v, rtol=1e-3, atol=2e-3 * scale, msg=k)


@pytest.mark.slow
def test_pretrain_under_the_accelerate_fsdp2_config_equals_the_ddp_launch(tmp_path):
    """``hf-dtrain pretrain`` under the Accelerate FSDP2 config: the model sharded (half the bytes per rank),
    activation checkpointing from the YAML, and every step's loss, the held-out loss and the saved model bit for bit
    those of the DDP launch (two ranks: every gradient sum has two operands, the same in either engine)."""
    from safetensors.torch import load_file

    from hf_dtrain.testing import accelerate_launch

    runs = {}
    for config in ("fsdp2_cpu_2proc", "cpu_2proc"):
        out = tmp_path / config
        cmd = [
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
            "32",
            "--data-bytes",
            "200000",
            "--progress",
            "false",
            "--output-dir",
            str(out),
        ]
        accelerate_launch(*cmd, config=config)
        runs[config] = (json.load(open(out / "results.json")), load_file(out / "model.safetensors"))
    (fsdp, fsdp_model), (ddp, ddp_model) = runs["fsdp2_cpu_2proc"], runs["cpu_2proc"]
    assert fsdp["engine"] == "fsdp2" and ddp["engine"] == "ddp" and fsdp["world_size"] == 2
    assert fsdp["config"]["fsdp"]["activation_checkpointing"] is True
    assert fsdp["param_bytes_local"] * 2 == ddp["param_bytes_local"]
    assert [h["loss"] for h in fsdp["history"]] == [h["loss"] for h in ddp["history"]]
    assert fsdp["history"][-1]["loss"] < fsdp["history"][0]["loss"] - 0.3
    assert fsdp["held_out_loss"] == ddp["held_out_loss"]
    assert fsdp_model.keys() == ddp_model.keys()
    assert all(torch.equal(fsdp_model[k], ddp_model[k]) for k in ddp_model)


@pytest.mark.slow
@pytest.mark.parametrize("comm_hook", ["dear", "embrace", "embrace:sharded"])
def test_finetune_trainer_way_in_for_dear_and_embrace(base_path, tmp_path, comm_hook):
    """Full fine-tuning under accelerate launch (2 gloo ranks) with --comm-hook: the Trainer callback registers the
    method (EmbRace takes the embeddings out of DDP before the Trainer wraps the model; DeAR's deferred update is
    applied before the evaluation), every step goes through it, the replicas agree and the loss falls. With EmbRace's
    sharded tables, each rank trains a column slice and the full tables are put back at the end of training: the
    replicas agree on them and the saved model holds plain, full-size embeddings."""
    from hf_dtrain.testing import accelerate_launch

    comm_hook, _, exchange = comm_hook.partition(":")
    out = tmp_path / comm_hook
    cmd = [
        "-m",
        "hf_dtrain.cli",
        "finetune",
        "--method",
        "full",
        "--model",
        base_path,
        "--output-dir",
        str(out),
        "--task-digits",
        "1",
        "--train-size",
        "1000",
        "--eval-size",
        "10",
        "--max-steps",
        "40",
        "--learning-rate",
        "1e-3",
        "--progress",
        "false",
        "--logging-steps",
        "1000",
        "--comm-hook",
        comm_hook,
    ]
    cmd += ["--comm-hook.exchange", exchange] if exchange else []
    accelerate_launch(*cmd, config="cpu_2proc")
    r = json.load(open(out / "results.json"))
    assert r["world_size"] == 2 and r["replicas_identical"]
    assert r["comm"]["method"] == comm_hook and r["comm"]["steps"] == 40  # the method ran on every step
    assert r["eval_loss_after"] < r["eval_loss_before"]
    if exchange:
        from safetensors import safe_open
        from transformers import AutoConfig

        assert r["config"]["comm_hook"]["exchange"] == exchange
        config = AutoConfig.from_pretrained(out)
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            table = f.get_tensor("model.embed_tokens.weight")
        assert tuple(table.shape) == (config.vocab_size, config.hidden_size)
        with safe_open(str(base_path) + "/model.safetensors", "pt") as f:  # the table trained: every column moved
            assert not torch.isclose(table, f.get_tensor("model.embed_tokens.weight")).all(0).any()


def test_every_committed_recipe_loads():
    """A typo in a committed recipe fails here, not in a user's run: finetune recipes become FinetuneConfig, the
    communication-method recipes CommHookConfig, the pretrain recipes a PretrainConfig that passes the clash check."""
    import glob

    import yaml

    from hf_dtrain.comm import CommHookConfig

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    finetune = sorted(glob.glob(os.path.join(root, "recipes", "finetune_*.yaml")))
    comm = sorted(glob.glob(os.path.join(root, "recipes", "comm_*.yaml")))
    assert len(finetune) >= 6 and comm
    for path in finetune:
        cfg = _cfg(["--recipe", path])
        assert cfg.method == yaml.safe_load(open(path))["method"]
    for path in comm:
        data = yaml.safe_load(open(path))["comm_hook"]
        assert CommHookConfig.from_any(data) == CommHookConfig(**data)
    from hf_dtrain.jobs.pretrain import PretrainConfig

    pretrain = sorted(glob.glob(os.path.join(root, "recipes", "pretrain_*.yaml")))
    assert pretrain
    pretrain.append(os.path.join(root, "recipes", "fault_tolerance_fsdp2.yaml"))
    for path in pretrain:
        cfg = job_config_from_args(build_parser("pretrain").parse_args(["--recipe", path]), PretrainConfig)
        data = yaml.safe_load(open(path))
        assert cfg.comm_hook == (CommHookConfig(**data["comm_hook"]) if data.get("comm_hook") else None)
        world = 2
        if cfg.parallel is not None:  # the recipe's degrees fit its model on the processes it names
            p = cfg.parallel
            world = p.tp * p.pp * p.dp_replicate * (p.dp_shard or 1)
        JobRun(cfg, world_size=world, start=False)  # the committed combination composes, its layout fits
        assert (cfg.fsdp is not None) == ("fsdp" in data) and (cfg.fault_tolerance is not None) == (
            "fault_tolerance" in data
        )
