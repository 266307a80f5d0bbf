"""Every documented relaunch path, tried as a user's job would fail: 10 SIGKILLs at seeded random moments (start-up,
mid-step, mid-snapshot, after a snapshot, after the last step), each generation relaunched the path's own way, and
the run must finish with every step's loss equal (``float.hex``) to the uninterrupted run, no step missing, and no
process left behind. Paths: the same command again (``elastic_launch``, as a user or a scheduler would),
``torchrun --max-restarts``, ``accelerate launch --max_restarts`` and the Trainer's ``resume_from_checkpoint``. The
same-command and Trainer paths start each generation forked from the tests' preloaded forkserver (the relaunched
program without the imports: a second a generation instead of 6-10); torchrun and accelerate start fresh
interpreters, as users' do."""

import contextlib
import json
import os
import random
import signal
import subprocess
import sys

import pytest

from hf_dtrain import processes
from hf_dtrain.testing import stop_snapshot_processes
from hf_dtrain.testing.fault import (
    failed_outputs,
    launch_ft_workers,
    saved_tensors_differ,
    worker_final_state_differs,
    worker_losses,
)
from hf_dtrain.testing.launch import free_port

pytestmark = pytest.mark.slow

WORLD, STEPS, KILLS = 2, 24, 10
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PHASES = ("startup", "before_step", "mid_snapshot", "after_snapshot")


def kill_schedule(seed: int, kills: int = KILLS) -> str:
    """``kills`` kills, one per generation: random phases, ranks and steps (1-2 steps after the generation's start,
    so each kill happens), the last one after the final step."""
    rng = random.Random(seed)
    entries = [f"{g}:{rng.randrange(WORLD)}:{rng.randint(1, 2)}:{rng.choice(PHASES)}" for g in range(kills - 1)]
    return ",".join(entries + [f"{kills - 1}:{rng.randrange(WORLD)}:1:after_last"])


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """model -> the uninterrupted run's folder (its losses and its final state), run once per model the tests use:
    ``llama`` (the tiny LLaMA) and ``torch`` (the worker's torch-only model, for the launchers' fresh interpreters)."""
    done = {}

    def reference(model):
        if model not in done:
            out = str(tmp_path_factory.mktemp(f"reference_{model}"))
            env = {"FT_OUT": out, "FT_NOFT": "1", "FT_STEPS": str(STEPS), "FT_MODEL": model}
            assert launch_ft_workers(WORLD, env) == [0] * WORLD, failed_outputs(out, [1] * WORLD)
            done[model] = out
        return done[model]

    return reference


@pytest.fixture
def reference(references):
    return references("llama")


def _env(out, ft_dir, seed, model="llama"):
    return {
        "FT_OUT": out,
        "FT_DIR": ft_dir,
        "FT_STEPS": str(STEPS),
        "FT_PARITY": "0",
        "FT_RELATIVE": "1",
        "FT_KILLS": kill_schedule(seed),
        "FT_MODEL": model,
    }


def _check(out, ft_dir, reference):
    assert sorted(worker_losses(out)) == list(range(1, STEPS + 1))  # no step lost
    assert worker_losses(out) == worker_losses(reference)  # every step, bit for bit
    # and the state the last generation ends with (restored after the last step: the 10th kill is after it)
    assert not worker_final_state_differs(reference, out)
    kills = open(os.path.join(out, "kills")).read().split()
    assert len(kills) == KILLS, kills
    leftover = [p for p in _smp_pids(ft_dir) if _alive(p)]
    assert not leftover, f"snapshot processes left running: {leftover}"


def _smp_pids(ft_dir):
    import glob

    pids = []
    for info in glob.glob(os.path.join(ft_dir, "node*", "smp.json")):
        with contextlib.suppress(OSError, ValueError):
            pids.append(json.load(open(info))["pid"])
    return pids


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_same_command_relaunched_after_10_kills(tmp_path, reference):
    out, ft_dir = str(tmp_path / "out"), str(tmp_path / "ft")
    os.makedirs(out)
    env = _env(out, ft_dir, seed=1)
    try:
        for gen in range(KILLS + 1):
            codes = launch_ft_workers(WORLD, dict(env, FT_GEN=str(gen)))
            if gen < KILLS:
                assert -signal.SIGKILL in codes, (gen, codes, open(os.path.join(out, "rank0.out")).read()[-2000:])
            else:
                assert codes == [0] * WORLD, failed_outputs(out, codes)
        _check(out, ft_dir, reference)
    finally:
        stop_snapshot_processes(ft_dir)


def _agent_run(tmp_path, reference, command, seed):
    """``command`` (a launcher with restarts) on the worker's torch-only model: the launcher starts fresh
    interpreters, which without transformers start in half the time; the tiny LLaMA's relaunches are the
    same-command test's."""
    out, ft_dir = str(tmp_path / "out"), str(tmp_path / "ft")
    os.makedirs(out)
    env = dict(
        os.environ,
        **_env(out, ft_dir, seed, model="torch"),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    )
    try:
        with open(os.path.join(out, "agent.out"), "w") as log:
            proc = processes.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=400, cwd=ROOT)
        assert proc.returncode == 0, open(os.path.join(out, "agent.out")).read()[-4000:]
        _check(out, ft_dir, reference)
    finally:
        stop_snapshot_processes(ft_dir)


def test_torchrun_max_restarts_after_10_kills(tmp_path, references):
    _agent_run(
        tmp_path,
        references("torch"),
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(WORLD),
            "--max-restarts",
            str(KILLS),
            "--monitor-interval",
            "0.2",
            "--master-port",
            str(free_port()),
            "-m",
            "hf_dtrain.testing.ft_worker",
        ],
        seed=2,
    )


def test_accelerate_launch_max_restarts_after_10_kills(tmp_path, references):
    _agent_run(
        tmp_path,
        references("torch"),
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            os.path.join(ROOT, "recipes", "accelerate", "cpu_2proc.yaml"),
            "--main_process_port",
            str(free_port()),
            "--max_restarts",
            str(KILLS),
            "--monitor_interval",
            "0.2",
            "-m",
            "hf_dtrain.testing.ft_worker",
        ],
        seed=3,
    )


@pytest.mark.resume_cell("full training", "the Trainer, one process", "memory")
def test_trainer_resume_from_checkpoint_after_10_kills(tmp_path):
    """The Trainer path (``trainer.train(resume_from_checkpoint=ft.resume_checkpoint(trainer))``), the same script
    relaunched after each of 10 kills (start-up, before an optimizer step, after a step's snapshot): the
    logged losses equal the uninterrupted run's at every step, none missing."""
    from tests.fault.test_callback import _losses, _run

    ref = tmp_path / "ref"
    ref.mkdir()
    assert _run(ref, FT_NOFT="1").returncode == 0
    rng = random.Random(4)
    phases = ("startup", "before_step", "step_end")
    kills = ",".join(f"{g}:1:{phases[g % 3] if g < 3 else rng.choice(phases)}" for g in range(KILLS))
    out, ft_dir = tmp_path / "run", tmp_path / "ft"
    out.mkdir()
    try:
        restored = []  # each generation's restore (None: it started afresh), and the lines the last one logged
        for gen in range(KILLS + 1):
            (out / "restored.json").unlink(missing_ok=True)
            logged = len(open(out / "losses.jsonl").readlines()) if (out / "losses.jsonl").exists() else 0
            done = _run(out, FT_DIR=str(ft_dir), FT_KILLS=kills, FT_GEN=str(gen))
            expect = -signal.SIGKILL if gen < KILLS else 0
            assert done.returncode == expect, (gen, done.stderr[-3000:])
            restored.append(json.load(open(out / "restored.json")) if (out / "restored.json").exists() else None)
        happened = open(out / "kills").read().split()
        assert len(happened) == KILLS
        # the relaunches resumed (a restart from scratch logs the same losses): the last one restored a step from
        # memory and logged only the steps after it
        last = restored[-1]
        assert last is not None and last["source"] == "memory" and last["step"] > 0, restored
        assert len(open(out / "losses.jsonl").readlines()) - logged == 10 - last["step"], restored
        # every step logged (a step's snapshot is taken once the Trainer has logged it), equal to the uninterrupted
        # run's
        assert _losses(out) == _losses(ref)
        assert not saved_tensors_differ(ref, out)  # the weights and AdamW state at the end
        assert not _smp_pids(str(ft_dir)) or not any(_alive(p) for p in _smp_pids(str(ft_dir)))
    finally:
        stop_snapshot_processes(ft_dir)
