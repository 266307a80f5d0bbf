"""Composition: clashing combinations of sections are refused before anything starts, with a message naming both
sides and the fix; each side alone is taken. Checked through the run a job starts (``JobRun(..., start=False)``
stops before the process group)."""

import json

import pytest

from hf_dtrain.jobs.pretrain import PretrainConfig
from hf_dtrain.jobs.sft.config import FinetuneConfig
from hf_dtrain.run.job import JobRun


def preflight(cfg, world: int) -> JobRun:
    return JobRun(cfg, world_size=world, start=False)


@pytest.mark.parametrize(
    "kwargs,world,job,expected",
    [
        (
            dict(comm_hook="acp_sgd", optimizer="onebit_lamb"),
            2,
            PretrainConfig,
            r"optimizer=onebit_lamb exchanges .* comm_hook=acp_sgd would be a second exchange: drop --comm-hook",
        ),
        (dict(comm_hook="acp_sgd"), 1, PretrainConfig, r"comm_hook=acp_sgd needs >= 2 processes; this run has 1"),
        (dict(optimizer="decentlam"), 1, FinetuneConfig, r"optimizer=decentlam needs >= 2 processes"),
        (dict(fault_tolerance=True, comm_hook="dear"), 2, FinetuneConfig, r"comm_hook=dear defers each update"),
        (dict(hetero_speeds=[1.0, 2.0]), 2, FinetuneConfig, r"Trainer shards its loader again"),
        (dict(hetero_speeds=[1.0, 2.0, 3.0]), 2, PretrainConfig, r"hetero_speeds has 3 values for 2 processes"),
    ],
)
def test_clashes_are_refused_naming_both_sides(kwargs, world, job, expected):
    with pytest.raises(ValueError, match=r"cannot be combined: .*" + expected):
        preflight(job(**kwargs), world)


def test_two_optimizers_and_deepspeed_clashes(tmp_path):
    with pytest.raises(ValueError, match=r"two optimizers: --method lorafa builds its own .* --lorafa.optimizer false"):
        preflight(FinetuneConfig(optimizer="eva"), 2)
    zero3 = tmp_path / "ds.json"
    zero3.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(ValueError) as err:
        preflight(
            FinetuneConfig(method="lora", comm_hook="acp_sgd", delta=0.5, fault_tolerance=True, deepspeed=str(zero3)),
            2,
        )
    message = str(err.value)
    assert "comm_hook=acp_sgd is a DDP communication hook and DeepSpeed ZeRO-3 replaces DDP" in message
    assert "delta" not in message and "fault_tolerance with DeepSpeed ZeRO-3" in message  # DELTA works on ZeRO-3
    with pytest.raises(ValueError, match=r"hf-dtrain pretrain runs DDP through Accelerate"):
        preflight(PretrainConfig(deepspeed=str(zero3)), 2)
    preflight(PretrainConfig(comm_hook="acp_sgd", delta=0.5, fault_tolerance=True, optimizer="eva"), 2)


def test_fsdp_clashes_name_the_reason(tmp_path):
    zero3 = tmp_path / "ds.json"
    zero3.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(ValueError) as err:
        preflight(
            FinetuneConfig(
                method="lora", fsdp=True, comm_hook="acp_sgd", delta=0.5, fault_tolerance=True, deepspeed=str(zero3)
            ),
            2,
        )
    message = str(err.value)
    assert "fsdp and deepspeed are two sharding engines" in message
    assert "FSDP2 has no DDP hooks" in message and "set --fsdp.replicate N" in message
    assert "delta" not in message and "fault_tolerance with fsdp" not in message  # both work on FSDP2
    with pytest.raises(ValueError, match="each rank holds a shard, not a replica"):
        preflight(FinetuneConfig(method="lora", fsdp=True, optimizer="onebit_lamb"), 2)
    preflight(
        FinetuneConfig(method="lora", fsdp={"replicate": 2, "activation_checkpointing": True}, optimizer="eva"), 4
    )
    # HSDP: the hooks that can carry the replica exchange are taken, the others refused with their reason
    for method in ("allreduce", "bf16", "fp16", "acp_sgd"):
        preflight(PretrainConfig(fsdp={"replicate": 2}, comm_hook=method), 4)
    for method, why in [
        ("dear", "FSDP2 already does exactly that"),
        ("embrace", "FSDP2 shards the tables"),
        ("s2_reducer", "dense row shards"),
    ]:
        with pytest.raises(ValueError, match=f"comm_hook={method} cannot carry FSDP2's replica exchange: .*{why}"):
            preflight(PretrainConfig(fsdp={"replicate": 2}, comm_hook=method), 4)


def test_accelerate_fsdp_configs_that_fsdp2_cannot_honour_are_refused():
    from types import SimpleNamespace

    from torch.distributed.fsdp import CPUOffloadPolicy

    from hf_dtrain.parallel import FSDPConfig

    plugin = SimpleNamespace(
        fsdp_version=2,
        reshard_after_forward=False,
        auto_wrap_policy="TRANSFORMER_BASED_WRAP",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        cpu_offload=CPUOffloadPolicy(),
        activation_checkpointing=True,
    )
    assert FSDPConfig.from_accelerate(plugin, mixed_precision="bf16") == FSDPConfig(
        reshard_after_forward=False,
        param_dtype="bf16",
        cpu_offload=True,
        layer_classes=["LlamaDecoderLayer"],
        activation_checkpointing=True,
    )
    for change, match in [
        ({"fsdp_version": 1}, "hf_dtrain shards with FSDP2 only: set fsdp_config.fsdp_version: 2"),
        ({"auto_wrap_policy": "SIZE_BASED_WRAP"}, "set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP"),
        ({"reshard_after_forward": 2}, "takes true or false"),
    ]:
        with pytest.raises(ValueError, match=match):
            FSDPConfig.from_accelerate(SimpleNamespace(**{**vars(plugin), **change}), mixed_precision="no")


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match=r"optimizer='sgd2' is unknown; set --optimizer to one of adamw, eva"):
        PretrainConfig(optimizer="sgd2")
    with pytest.raises(ValueError, match=r"method='powersgd' is unknown; set comm_hook.method"):
        PretrainConfig(comm_hook="powersgd")
    with pytest.raises(ValueError, match=r"DeltaConfig.budget must be a fraction in \(0, 1\] or bytes"):
        PretrainConfig(delta=0)
    with pytest.raises(ValueError, match=r"granularity='op' is unknown; set delta.granularity to one of layer"):
        PretrainConfig(delta={"budget": 0.5, "granularity": "op"})
    with pytest.raises(ValueError, match=r"eva.\* settings are given but optimizer=adamw; set --optimizer eva"):
        PretrainConfig(eva={"damping": 0.1})
    with pytest.raises(
        ValueError,
        match=r"PretrainConfig.delta: unknown key\(s\) \['budgett'\]; valid keys are "
        r"allow_offload, budget, granularity",
    ):
        PretrainConfig.from_dict({"delta": {"budgett": 0.5}})


def test_cli_refuses_a_clash_before_training(capsys):
    from hf_dtrain.cli import main

    with pytest.raises(SystemExit, match=r"hf-dtrain pretrain: .*cannot be combined.*second exchange"):
        main(["pretrain", "--comm-hook", "acp_sgd", "--optimizer", "onebit_lamb", "--max-steps", "1"])
    with pytest.raises(SystemExit, match=r"hf-dtrain finetune: .*two optimizers"):
        main(["finetune", "--method", "lorafa", "--optimizer", "eva", "--max-steps", "1"])


@pytest.mark.parametrize("streaming", [False, True])
def test_pretrain_on_a_local_jsonl_dataset_one_process(tmp_path, streaming):
    """hf-dtrain pretrain on a user's text (a local jsonl, loaded or streamed through datasets) in one process with
    DELTA: it trains, writes its per-step log and results, and the DELTA budget holds."""
    from hf_dtrain.cli import main

    rows = [{"text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 20} for i in range(300)]
    data = tmp_path / "corpus.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "out"
    assert (
        main(
            [
                "pretrain",
                "--dataset",
                str(data),
                "--streaming",
                str(streaming).lower(),
                "--max-steps",
                "6",
                "--per-device-train-batch-size",
                "4",
                "--seq-len",
                "64",
                "--delta.budget",
                "0.6",
                "--progress",
                "false",
                "--save-model",
                "false",
                "--output-dir",
                str(out),
            ]
        )
        == 0
    )
    results = json.load(open(out / "results.json"))
    assert [h["step"] for h in results["history"]] == list(range(1, 7))
    assert len((out / "history_rank0.jsonl").read_text().splitlines()) == 6
    budget = max(results["delta"]["budget_bytes"].values())
    assert all(b <= budget for b in results["delta"]["saved_bytes"])
    assert (results["held_out_loss"] is None) == streaming  # a stream has no held-out split


def test_every_way_of_starting_a_run_prefixes_the_launcher_store_with_the_generation(monkeypatch):
    """``init_distributed`` (the restarted generation's own store keys, so gloo does not read a dead generation's
    addresses) runs before the process group whichever way a job starts its run: ``JobRun(cfg)`` (finetune, sweep,
    fed) and ``JobRun(cfg, start=False)`` then ``start()`` (pretrain). Lost on the second way once, a tp x pp
    restart under torchrun failed in ``connectFullMesh`` (``Connection refused``) now and then."""
    import hf_dtrain.distributed.groups as groups

    class Started(Exception):
        pass

    def record(backend=None, timeout=None):
        raise Started

    monkeypatch.setattr(groups, "init_distributed", record)
    with pytest.raises(Started):
        JobRun(FinetuneConfig())
    run = JobRun(PretrainConfig(), start=False)
    with pytest.raises(Started):
        run.start()
