"""The rank monitor when a peer dies under a launcher: torchrun's agent SIGTERMs the survivors at once. A survivor
whose collective failed exits at once with the launcher's line, whether the SIGTERM came before the failure (and a
preemption handler took it as a notice) or while the heartbeats are read; outside a launcher the heartbeats are read
in full. A :class:`RankFailure` ends the process without the interpreter's clean-up (which waits on the dead peer)."""

import subprocess
import sys
import textwrap

import pytest

from hf_dtrain.testing import free_port

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    port, when, launched = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    if launched:
        os.environ["TORCHELASTIC_RUN_ID"] = "test"
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    from hf_dtrain.distributed.groups import RankMonitor, stop_signals
    monitor = RankMonitor(interval=float(sys.argv[4]))
    # a preemption notice's listener (hf_dtrain.fault.preempt): above the monitor's, it takes every SIGTERM
    with stop_signals(lambda signum: True, (signal.SIGTERM,), priority=10):
        with monitor.guard():
            if when == "before":
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1.0)  # the stop-signal thread has it
            else:  # while the heartbeats are read
                threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
            raise RuntimeError("Gloo connectFullMesh failed: Connection reset by peer")
    """
)


def _run(when: str, launched: bool, interval: float):
    argv = [sys.executable, "-c", SCRIPT, str(free_port()), when, "1" if launched else "0", str(interval)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=100)


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_failed_collective_after_the_launchers_stop_exits_at_once_with_its_line(when):
    # interval 10: the heartbeats would be read 30 s apart, then the failure passed through (no dead peer in a world
    # of one); the launcher's SIGTERM ends the rank first, as 128 + SIGTERM, with the launcher's line
    done = _run(when, launched=True, interval=10.0)
    assert done.returncode == 143, (done.returncode, done.stderr[-3000:])
    assert "was stopped by the launcher (SIGTERM) at step 0, most likely because another rank failed" in done.stderr
    assert "Traceback" not in done.stderr


def test_outside_a_launcher_the_heartbeats_are_read_in_full():
    done = _run("during", launched=False, interval=0.5)
    # no launcher stops survivors there: the signal is the notice's, the failure (no dead peer named) goes through
    assert done.returncode == 1, (done.returncode, done.stderr[-3000:])
    assert "Connection reset by peer" in done.stderr and "stopped by the launcher" not in done.stderr


def test_a_rank_failure_ends_the_process_without_the_interpreters_clean_up():
    script = textwrap.dedent(
        """
        import atexit
        from hf_dtrain.distributed import RankFailure
        from hf_dtrain.errors import report_and_exit
        atexit.register(print, "clean-up ran")
        try:
            raise RankFailure("hf_dtrain: rank 1 stopped responding")
        except RankFailure as e:
            report_and_exit("pretrain", e)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "hf-dtrain pretrain: hf_dtrain: rank 1 stopped responding" in done.stderr
    assert "clean-up ran" not in done.stdout
