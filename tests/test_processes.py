"""``hf_dtrain.processes.run``: a child and everything it started are gone when the child times out, fails or exits
(``subprocess.run`` kills only the child on a timeout: a benchmark's worker outlived ``gpu_check`` by ten minutes)."""

import os
import subprocess
import sys
import time

import psutil
import pytest

from hf_dtrain import processes

# a child that starts a grandchild (in a session of its own, as a nested processes.run does) and one in its own
# group, writes their pids, then sleeps or exits
CHILD = """
import subprocess, sys, time
sleeper = [sys.executable, "-c", "import time; time.sleep(300)"]
apart = subprocess.Popen(sleeper, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
inside = subprocess.Popen(sleeper)
open(sys.argv[1], "w").write(f"{apart.pid} {inside.pid}")
if sys.argv[2] == "sleep":  # well short of the grandchildren: a kill that missed them leaves them running
    time.sleep(30)
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pids(path) -> list[int]:
    for _ in range(100):
        if os.path.exists(path) and open(path).read().strip():
            return [int(p) for p in open(path).read().split()]
        time.sleep(0.05)
    raise AssertionError("the child wrote no pids")


def test_a_timed_out_child_leaves_no_descendant(tmp_path):
    """On timeout the child, its grandchild in its group and the one that started a session of its own are killed."""
    pids = tmp_path / "pids"
    with pytest.raises(subprocess.TimeoutExpired):
        processes.run([sys.executable, "-c", CHILD, str(pids), "sleep"], timeout=5, capture_output=True)
    started = _pids(pids)
    time.sleep(0.2)
    left = [p for p in started if _alive(p)]
    for p in left:  # not to leave them to the next test
        psutil.Process(p).kill()
    assert not left


def test_a_child_that_exits_leaves_nothing_in_its_group(tmp_path):
    """A child that exits leaving a process in its group: that process is killed; one that left the group on purpose
    (a snapshot process starts a session of its own) is not this call's to kill."""
    pids = tmp_path / "pids"
    result = processes.run([sys.executable, "-c", CHILD, str(pids), "exit"], timeout=60, capture_output=True)
    assert result.returncode == 0
    apart, inside = _pids(pids)
    time.sleep(0.2)
    try:
        assert not _alive(inside)
        assert _alive(apart)
    finally:
        psutil.Process(apart).kill()


def test_a_terminated_parent_takes_its_children_with_it(tmp_path):
    """A SIGTERM to a process waiting in ``processes.run`` (a launcher's, ``timeout``'s) kills the child's tree before
    the process ends by it."""
    import signal

    pids = tmp_path / "pids"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from hf_dtrain import processes; processes.run([sys.executable, '-c', sys.argv[1], "
            "sys.argv[2], 'sleep'])",
            CHILD,
            str(pids),
        ]
    )
    started = _pids(pids)
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=30) == -signal.SIGTERM  # ended by the signal, as without the handler
    time.sleep(0.2)
    left = [p for p in started if _alive(p)]
    for p in left:
        psutil.Process(p).kill()
    assert not left
