"""Preemption from outside, as a cloud or SLURM does it: a job started under a launcher, and when its log shows the
``n``-th logged step, a signal to every rank at once (the launcher's descendants running the job's module). Used by
the preemption tests and ``benchmarks/preemption.py``, which also read how long each signal took to end the ranks."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from dataclasses import dataclass, field

from hf_dtrain import processes

# a logged step on rank 0: pretrain's "step N: loss X", the Trainer's {'loss': ...} line
LOSS_LINE = re.compile(r"^step \d+: loss |^\{'loss': ")
# the line a rank prints when it stops for a notice (hf_dtrain.fault.snapshot.SnapshotEngine.stop_for_notice)
STOPPED = re.compile(
    r"hf_dtrain: rank (\d+) \(host [^)]*\) stopped for (\w+) \(a preemption notice\) after step (\d+), saved"
)


@dataclass
class Notice:
    """One signal sent: at which logged line, to which pids, and how long until the last of them had exited."""

    line: int
    signum: int
    pids: list[int]
    sent: float
    seconds_to_exit: float | None = None


@dataclass
class PreemptedRun:
    returncode: int
    output: str
    notices: list[Notice] = field(default_factory=list)

    def stops(self) -> list[tuple[int, str, int]]:
        """(rank, signal name, step) of every stop line the ranks printed, in order."""
        return [(int(r), s, int(step)) for r, s, step in STOPPED.findall(self.output)]


def _workers(pid: int, marker: str) -> list:
    import psutil

    try:
        found = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in found:
        try:
            if marker in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            continue
    return out


def run_preempted(
    cmd: list[str],
    env: dict,
    at: list[tuple[int, int]],
    marker: str = "hf_dtrain.cli",
    timeout: float = 600,
    cwd: str | None = None,
    after_exit=None,
) -> PreemptedRun:
    """Run ``cmd`` (a launcher) to its end; ``at``: ``(n, signum)`` pairs, ascending: when rank 0 has logged its
    ``n``-th step line (counted over the whole output, restarts included), ``signum`` goes to every process below
    the launcher whose command line holds ``marker``, at once. Each notice records the seconds from the signal until
    the last of those processes exited; ``after_exit(i)`` is then called for the ``i``-th notice (the node lost: its
    snapshot processes killed before the launcher's restart has started Python again)."""
    import psutil

    pending = list(at)
    notices: list[Notice] = []
    lines: list[str] = []
    count = 0
    with subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    ) as proc:
        killer = threading.Timer(timeout, processes.kill_tree, args=(proc,))
        killer.daemon = True
        killer.start()
        try:
            for line in proc.stdout:
                lines.append(line)
                if not LOSS_LINE.search(line):
                    continue
                count += 1
                if pending and count >= pending[0][0]:
                    n, signum = pending.pop(0)
                    workers = _workers(proc.pid, marker)
                    notice = Notice(n, signum, [p.pid for p in workers], time.monotonic())
                    for p in workers:
                        try:
                            p.send_signal(signum)
                        except psutil.NoSuchProcess:
                            pass
                    notices.append(notice)
                    index = len(notices) - 1

                    def timed(notice=notice, workers=workers, i=index):
                        psutil.wait_procs(workers, timeout=timeout)
                        notice.seconds_to_exit = time.monotonic() - notice.sent
                        if after_exit is not None:
                            after_exit(i)

                    threading.Thread(target=timed, daemon=True).start()
            proc.wait()
        finally:
            killer.cancel()
            processes.kill_tree(proc)
    deadline = time.monotonic() + 30
    while any(n.seconds_to_exit is None for n in notices) and time.monotonic() < deadline:
        time.sleep(0.05)
    return PreemptedRun(proc.returncode, "".join(lines), notices)


__all__ = ["LOSS_LINE", "STOPPED", "Notice", "PreemptedRun", "run_preempted"]
