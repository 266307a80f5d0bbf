"""The tests' relaunch helpers: ``relaunched`` starts a failed generation again (up to its restarts, each told its
number) and stops at the first that succeeds; ``forked_run`` runs one script forked from the preloaded forkserver,
returning its exit code and output, and kills it at its timeout; the fault worker's torch-only model keeps its ranks
free of transformers."""

import os
import sys
import textwrap
import time

import pytest

from hf_dtrain.testing import forked_run, relaunch_output, relaunched, run_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# fails (exit 3) in generations before $PASS_AT, says which rank and generation it is
SCRIPT = textwrap.dedent(
    """
    import os, sys
    gen, rank = int(os.environ["HF_DTRAIN_FAULT_GENERATION"]), int(os.environ["RANK"])
    print(f"gen {gen} rank {rank}", flush=True)
    sys.exit(3 if gen < int(os.environ["PASS_AT"]) else 0)
    """
)


def test_relaunched_starts_failed_generations_again_until_one_succeeds(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, str(script)]
    generations = relaunched(argv, 2, str(tmp_path / "a"), restarts=3, env={"PASS_AT": "2"}, timeout=120)
    assert generations == [[3, 3], [3, 3], [0, 0]]  # stopped at the first generation that succeeded
    said = relaunch_output(str(tmp_path / "a"), range(2)).split()
    assert " ".join(said) == "gen 0 rank 0 gen 0 rank 1 gen 1 rank 0 gen 1 rank 1 gen 2 rank 0 gen 2 rank 1"
    # the restarts run out: every generation's codes, the last one failed
    generations = relaunched(argv, 2, str(tmp_path / "b"), restarts=1, env={"PASS_AT": "5"}, timeout=120)
    assert generations == [[3, 3], [3, 3]]


def test_forked_run_returns_the_code_and_output_and_kills_at_its_timeout(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import os, sys\nprint('from', os.environ['WHO'], flush=True)\nsys.exit(7)\n")
    log = str(tmp_path / "out.log")
    assert forked_run([sys.executable, str(script)], dict(os.environ, WHO="fork"), log, timeout=120) == 7
    assert open(log).read() == "from fork\n"
    slow = tmp_path / "slow.py"
    slow.write_text("import os, time\nopen(os.environ['PIDFILE'], 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
    pidfile = tmp_path / "pid"
    with pytest.raises(TimeoutError, match="still running after 3"):
        forked_run([sys.executable, str(slow)], dict(os.environ, PIDFILE=str(pidfile)), log, timeout=3)
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}"), f"the timed-out process {pid} is still running"


def test_the_fault_workers_torch_model_imports_no_transformers():
    """``FT_MODEL=torch`` (the launcher relaunch tests' fresh ranks): the worker builds its model and trains a step
    without importing transformers, which is what makes those ranks start fast; another engine is refused."""
    code = textwrap.dedent(
        """
        import os, sys
        os.environ["FT_MODEL"] = "torch"
        from hf_dtrain.testing import ft_worker
        from hf_dtrain.testing.batches import random_batch
        model = ft_worker._model("ddp")
        model(**random_batch()).loss.backward()
        assert "transformers" not in sys.modules, "transformers was imported"
        try:
            ft_worker._model("fsdp2")
        except SystemExit as e:
            print(e)
        """
    )
    out = run_python(code, env={"PYTHONPATH": ROOT}, timeout=120)
    assert "FT_MODEL=torch runs under DDP only (FT_ENGINE='fsdp2')" in out
