"""``hf-dtrain pretrain`` on a mesh: tensor x pipeline parallelism on 4 processes (accelerate launch) against the
same job on one process (torchrun, the same data order): every step's loss within 1e-5 relative, the held-out loss
likewise, and the checkpoint (one safetensors file per pipeline rank and the index) loads with ``from_pretrained``
and equals the one-process model. Bad degrees are refused before any process group, naming the flag."""

import json
import os
import re
import sys

import pytest
import torch

from hf_dtrain import processes
from hf_dtrain.testing import free_port, relaunch_output, relaunched
from hf_dtrain.testing.fault import saved_tensors_differ, tensors_differ

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = [
    "pretrain",
    "--preset",
    "tiny",
    "--max-steps",
    "5",
    "--per-device-train-batch-size",
    "8",
    "--seq-len",
    "64",
    "--progress",
    "false",
    "--logging-steps",
    "0",
    "--data-bytes",
    "200000",
    "--eval-blocks",
    "8",
]


def _run(cmd, env=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="true", **(env or {}))
    proc = processes.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def mesh_run(tmp_path_factory):
    """The job on a tensor 2 x pipeline 2 mesh, uninterrupted, snapshotting every step and persisting the last one's
    DCP copy (``mesh/disk``)."""
    from hf_dtrain.testing import stop_snapshot_processes

    mesh = tmp_path_factory.mktemp("tp2pp2")
    try:
        _run(
            [
                sys.executable,
                "-m",
                "accelerate.commands.launch",
                "--config_file",
                "recipes/accelerate/cpu_4proc.yaml",
                "--main_process_port",
                str(free_port()),
                "-m",
                "hf_dtrain.cli",
                *JOB,
                "--tp",
                "2",
                "--pp",
                "2",
                "--output-dir",
                str(mesh),
                "--fault-tolerance.directory",
                str(mesh / "ft"),
                "--fault-tolerance.persist-dir",
                str(mesh / "disk"),
                "--fault-tolerance.persist-every",
                "5",
            ]
        )
    finally:
        stop_snapshot_processes(str(mesh / "ft"))
    return mesh


def _step_losses(directory, rank):
    return {h["step"]: float(h["loss"]).hex() for h in map(json.loads, open(directory / f"history_rank{rank}.jsonl"))}


@pytest.mark.slow
@pytest.mark.resume_cell("full training", "tp x pp, plain loop", "memory", "parity", "disk")
def test_a_tp_pp_mesh_resumes_bit_for_bit_after_kills(tmp_path, mesh_run):
    """``--tp 2 --pp 2 --fault-tolerance`` relaunched as ``torchrun --max-restarts`` does (each generation's ranks
    forked from the tests' preloaded forkserver: :func:`hf_dtrain.testing.relaunched`), each rank its own emulated
    node, every snapshot also written to disk: a node lost with its snapshot process after step 2's snapshot (rebuilt
    from the others' parity), then every node's memory lost after step 3's (the relaunch reads the disk copy), then a
    rank killed in step 5 after its forward and backward (memory). (A node lost right after a generation's first
    snapshot, before its parity is complete, has only the disk copy to go back to: that generation's restart reads
    it.) Each rank snapshots its own tensor-parallel shards of its pipeline stages; every step's loss on every rank
    and the saved model equal the uninterrupted mesh run's."""
    from hf_dtrain.testing import stop_snapshot_processes

    out, ft = tmp_path / "run", tmp_path / "ft"
    try:
        generations = relaunched(
            [
                sys.executable,
                "-m",
                "hf_dtrain.testing.fault",
                "--emulate-nodes",
                "--kills",
                "0:2:@2:node_lost,1:1:@3:all_lost,2:3:@4:mid_step",
                "--kill-log",
                str(tmp_path / "kills"),
                "hf_dtrain.cli",
                *JOB,
                "--tp",
                "2",
                "--pp",
                "2",
                "--fault-tolerance.directory",
                str(ft),
                "--fault-tolerance.persist-dir",
                str(tmp_path / "disk"),
                "--fault-tolerance.persist-every",
                "1",
                "--output-dir",
                str(out),
            ],
            4,
            str(out),
            restarts=3,
            env={"ACCELERATE_USE_CPU": "true"},
            timeout=600,
        )
    finally:
        stop_snapshot_processes(ft)
    rank0 = relaunch_output(str(out), [0])
    assert generations[-1] == [0] * 4 and len(generations) == 4, (generations, rank0[-4000:])
    assert len(open(tmp_path / "kills").read().split()) == 3
    said = re.findall(r"resumed after step (\d+) from (\w+)", rank0)
    assert [source for _, source in said] == ["parity", "disk", "memory"], said  # rank 0 says each
    got = json.loads((out / "results.json").read_text())
    assert got["fault_tolerance"]["restored"] == {"step": 4, "source": "memory"}
    for rank in range(4):  # the step log is appended to across the relaunches: the last line of a step counts
        assert _step_losses(out, rank) == _step_losses(mesh_run, rank)
    assert not saved_tensors_differ(mesh_run, out)  # the saved model (a file per pipeline stage), bit for bit


@pytest.mark.slow
@pytest.mark.resume_cell("full training", "tp x pp, plain loop", "another world size")
def test_a_tp_pp_run_restarts_as_dp_shard_4_from_its_dcp_copy_with_the_state_equal(tmp_path, mesh_run):
    """The ``--tp 2 --pp 2`` run restarted as ``--dp-shard 4`` (FSDP2) on new nodes (its in-memory snapshots gone,
    its persisted DCP copy of step 5 kept): the same job in another layout, so each rank reads its FSDP2 shards of
    the copy the pipeline stages' tensor-parallel shards wrote; the gathered model it saves equals the tp x pp run's
    bit for bit."""
    from safetensors.torch import load_file

    from hf_dtrain.testing import stop_snapshot_processes

    out, ft = tmp_path / "dp4", tmp_path / "ft"
    try:
        _run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "4",
                "--master-port",
                str(free_port()),
                "-m",
                "hf_dtrain.cli",
                *JOB,
                "--dp-shard",
                "4",
                "--output-dir",
                str(out),
                "--fault-tolerance.directory",
                str(ft),
                "--fault-tolerance.persist-dir",
                str(mesh_run / "disk"),
                "--fault-tolerance.persist-every",
                "5",
            ]
        )
    finally:
        stop_snapshot_processes(str(ft))
    got = json.loads((out / "results.json").read_text())
    assert got["fault_tolerance"]["restored"] == {"step": 5, "source": "resharded"}
    assert got["engine"].startswith("mesh pp 1 x dp_replicate 1 x dp_shard 4 x tp 1")
    want = {}
    for f in sorted(mesh_run.glob("model-*.safetensors")):  # one file per pipeline rank
        want.update(load_file(str(f)))
    assert not tensors_differ(want, load_file(str(out / "model.safetensors")))


@pytest.mark.slow
def test_pretrain_on_a_tp_pp_mesh_equals_one_process(tmp_path, mesh_run):
    ref, mesh = tmp_path / "one", mesh_run
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "1",
            "--master_port",
            str(free_port()),
            "-m",
            "hf_dtrain.cli",
            *JOB,
            "--parallel",
            "--output-dir",
            str(ref),
        ]
    )
    want, got = (json.loads((d / "results.json").read_text()) for d in (ref, mesh))
    assert got["engine"] == "mesh pp 2 x dp_replicate 1 x dp_shard 1 x tp 2"
    assert len(got["pipeline"]["bounds"]) == 2
    torch.testing.assert_close(
        torch.tensor([h["loss"] for h in got["history"]]),
        torch.tensor([h["loss"] for h in want["history"]]),
        rtol=1e-5,
        atol=0,
    )
    assert got["held_out_loss"] == pytest.approx(want["held_out_loss"], rel=1e-5)
    index = json.loads((mesh / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    from transformers import LlamaForCausalLM

    a, b = (LlamaForCausalLM.from_pretrained(str(d)).state_dict() for d in (ref, mesh))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize(
    "world, flags, match",
    [
        (4, ["--tp", "3"], r"--tp 3 x --pp 1 x --dp-replicate 1 = 3 does not divide the 4 processes"),
        (4, ["--tp", "2", "--dp-shard", "4"], r"= 8, but there are 4 processes"),
        (8, ["--tp", "8"], r"--tp 8 does not divide the model's num_attention_heads \(4\)"),
        (8, ["--pp", "8"], r"8 stages, but the model has 4 decoder layers"),
        (4, ["--tp", "2", "--delta", "0.5"], r"delta with --tp/--pp"),
        (4, ["--pipeline.schedule", "GPipe"], r"pipeline.schedule given but --pp is 1"),
    ],
)
def test_bad_degrees_are_refused_before_any_process_group(monkeypatch, world, flags, match):
    from hf_dtrain.cli import main

    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit, match=match):
        main(["pretrain", "--preset", "tiny", *flags])
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_finetune_says_the_trainer_cannot_drive_a_pipeline():
    from hf_dtrain.cli import main

    with pytest.raises(SystemExit, match=r"--pp is a pretrain flag: the Trainer cannot drive a pipeline"):
        main(["finetune", "--method", "lorafa", "--pp", "2"])
