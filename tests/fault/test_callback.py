"""InMemoryFaultToleranceCallback under the Trainer: SIGKILLed after step 4 of 10, restarted, resumed through
``resume_checkpoint`` from the snapshot process's memory; killed again after step 7 with the snapshot process (the
node gone), resumed from the disk copy: the losses logged after each restart and the weights and AdamW state at the
end equal the uninterrupted run's; a finished run stops its snapshot process."""

import json
import os
import signal
import sys
from types import SimpleNamespace

import pytest

from hf_dtrain import processes
from hf_dtrain.testing import forked_run, stop_snapshot_processes
from hf_dtrain.testing.fault import saved_tensors_differ

pytestmark = pytest.mark.slow

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_trainer_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(out, **env):
    """The worker as one process forked from the tests' preloaded forkserver (a relaunch of the same script, without
    importing torch, transformers and peft again); ``.returncode`` and ``.stderr`` (its output) of that run."""
    e = dict(
        os.environ,
        FT_OUT=str(out),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
        **env,
    )
    log = os.path.join(str(out), "worker.out")
    start = os.path.getsize(log) if os.path.exists(log) else 0
    code = forked_run([sys.executable, WORKER], e, log, timeout=300, cwd=ROOT)
    with open(log) as f:
        f.seek(start)
        return SimpleNamespace(returncode=code, stderr=f.read())


def _losses(out):
    got = {}
    for line in open(out / "losses.jsonl"):
        step, loss = json.loads(line)
        got[step] = loss
    return got


@pytest.mark.resume_cell("full training", "the Trainer, one process", "memory", "disk")
def test_trainer_killed_and_resumed_from_memory_then_disk_matches_the_uninterrupted_run(tmp_path):
    ref = tmp_path / "ref"
    ref.mkdir()
    assert _run(ref, FT_NOFT="1").returncode == 0
    out, ft_dir = tmp_path / "run", tmp_path / "ft"
    out.mkdir()
    try:
        _killed_then_resumed(out, ft_dir, ref)
    finally:
        stop_snapshot_processes(ft_dir)


def _killed_then_resumed(out, ft_dir, ref):
    disk = str(out / "disk")
    killed = _run(out, FT_DIR=str(ft_dir), FT_PERSIST=disk, FT_KILL_AT="4")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert max(_losses(out)) == 4  # killed once step 4 was logged and snapshotted
    killed = _run(out, FT_DIR=str(ft_dir), FT_PERSIST=disk, FT_KILL_AT="7")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert json.load(open(out / "restored.json")) == {"step": 4, "source": "memory"}
    stop_snapshot_processes(ft_dir)  # the node is gone with its memory
    resumed = _run(out, FT_DIR=str(ft_dir), FT_PERSIST=disk)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.load(open(out / "restored.json")) == {"step": 7, "source": "disk"}
    got, want = _losses(out), _losses(ref)
    assert sorted(got) == list(range(1, 11))  # no step lost, none run twice
    assert got == want  # steps 5-10 after the restores, exactly
    assert not saved_tensors_differ(ref, out)  # the weights and AdamW state at the end, bit for bit
    # the restored Trainer's log history holds step 4's line (the snapshot waits for the Trainer's log of its step)
    history = json.load(open(out / "history.json"))
    assert [h["step"] for h in history if "loss" in h] == list(range(1, 11))
    assert not os.path.exists(ft_dir / "node0" / "smp.json")  # the finished run stopped its snapshot process


def test_accelerate_recipe_killed_then_resumed(tmp_path, tiny_base):
    """recipes/fault_tolerance_accelerate.py under accelerate launch, 2 gloo ranks as 2 emulated nodes (parity on):
    rank 0 dies after step 6, the launcher stops rank 1; the relaunch resumes both ranks after step 6 from memory
    and finishes with the loss falling."""
    from hf_dtrain.testing import free_port

    base = tiny_base(50)
    out, snaps = tmp_path / "out", tmp_path / "ft"

    def launch(*extra):
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            "recipes/accelerate/cpu_2proc.yaml",
            "--main_process_port",
            str(free_port()),
            "recipes/fault_tolerance_accelerate.py",
            "--model",
            base,
            "--steps",
            "14",
            "--batch-size",
            "4",
            "--emulate-nodes",
            "--snapshot-dir",
            str(snaps),
            "--out",
            str(out),
            *extra,
        ]
        env = dict(
            os.environ,
            ACCELERATE_USE_CPU="true",
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
        )
        return processes.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)

    try:
        first = launch("--kill-at", "6")
        assert first.returncode != 0 and not (out / "ft_0.json").exists()
        second = launch()
        assert second.returncode == 0, second.stderr[-4000:]
        assert "resumed after step 6 from memory" in second.stdout
        for rank in range(2):
            r = json.load(open(out / f"ft_{rank}.json"))
            assert r["restored"] == {"step": 6, "source": "memory"}
            assert [s for s, _ in r["losses"]] == list(range(7, 15))
    finally:
        stop_snapshot_processes(snaps)


@pytest.mark.resume_cell("full training", "the Trainer, one process", "another world size")
def test_a_trainer_restart_on_another_world_size_is_refused_naming_it(tmp_path, monkeypatch):
    """Under the Trainer the callback resumes rank by rank: a restore that resharded (snapshots of another world
    size) is refused with the way out, before anything is handed to the Trainer."""
    from types import SimpleNamespace

    from hf_dtrain.fault import InMemoryFaultToleranceCallback, SnapshotEngine
    from hf_dtrain.fault.snapshot import Restored
    from hf_dtrain.testing import tiny_llama

    def resharded(self, apply=True):
        return Restored(8, "memory-resharded", {"next_step": 9}, "taken on 2 ranks and resharded onto 3", {})

    monkeypatch.setattr(SnapshotEngine, "restore", resharded)
    callback = InMemoryFaultToleranceCallback(directory=str(tmp_path / "ft"), parity=0)
    trainer = SimpleNamespace(
        model=tiny_llama(seed=0),
        train_dataset=None,
        is_deepspeed_enabled=False,
        args=SimpleNamespace(device="cpu", output_dir=str(tmp_path / "out")),
    )
    try:
        with pytest.raises(
            ValueError,
            match=r"taken on another world size \(taken on 2 ranks.*relaunch with that "
            r"many.*fresh-start true",
        ):
            callback.resume_checkpoint(trainer)
    finally:
        callback.engine.close(shutdown=True)
