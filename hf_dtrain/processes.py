"""Child processes that do not outlive what started them.

``subprocess.run(..., timeout=)`` kills the child it started when the time is up, and nothing the child started: a
benchmark's worker, started by a benchmark that ``gpu_check`` ran, kept a core busy for more than ten minutes after
both had gone, with parent 1. :func:`run` is ``subprocess.run`` with the child in a process group of its own (a new
session). When the time is up, on an error or an interrupt, the child and all its descendants are killed, found by
their parent links (``psutil``) before any is killed, so a level that started its own group (another :func:`run`
below) goes too; the moment the child exits, what it left in its group is killed (it may hold the pipes being read);
a SIGTERM or SIGHUP to this process kills the child's tree before it is handled (a SIGKILL cannot be seen).
Processes that detach on purpose (the snapshot processes, with their own idle exit) are started apart, not through
this.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading

__all__ = ["kill_group", "kill_tree", "run"]


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` (not yet reaped), every process below it (followed through their parents while they still
    hang from it) and what is left of its process group."""
    import psutil

    try:
        root = psutil.Process(proc.pid)
        found = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        found = []
    for p in found:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p.kill()
    kill_group(proc)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of the process group ``proc`` leads (started with ``start_new_session=True``)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def _killed_with_this_process(proc: subprocess.Popen):
    """While the child runs, a SIGTERM or SIGHUP to this process (a launcher's, a ``timeout``'s, a scheduler's) kills
    the child's tree first, then is handled as it would have been (by default: this process ends by it). Only the main
    thread can set signal handlers; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}

    def handler(signum, frame):
        kill_tree(proc)
        signal.signal(signum, previous[signum])
        os.kill(os.getpid(), signum)  # as if this handler had not been here

    for signum in (signal.SIGTERM, signal.SIGHUP):
        previous[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, old in previous.items():
            if signal.getsignal(signum) is handler:
                signal.signal(signum, old)


def _kill_group_on_exit(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        kill_group(proc)


def run(argv, *, timeout: float | None = None, input=None, capture_output: bool = False, check: bool = False, **kwargs):
    """``subprocess.run(argv, ...)`` (the same arguments and result; ``TimeoutExpired`` and ``CalledProcessError``
    alike) with the child in a process group of its own, killed with everything below it on timeout, an error or an
    interrupt, and its group's leftovers killed when it exits."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with subprocess.Popen(argv, start_new_session=True, **kwargs) as proc, _killed_with_this_process(proc):
        # the moment the child exits (before it is reaped, so its pid cannot be reused), its group's leftovers are
        # killed: they may hold the pipes this call reads to the end
        threading.Thread(target=_kill_group_on_exit, args=(proc,), daemon=True).start()
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            kill_tree(proc)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, e.timeout, output=out, stderr=err) from None
        except BaseException:
            kill_tree(proc)
            raise
        finally:
            kill_group(proc)  # the child has exited: what it left running in its group
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        result.check_returncode()
    return result
