"""Preemption notices: SIGTERM (what a cloud's shutdown, Kubernetes and SLURM send) or SIGUSR1 (what SLURM's
``--signal`` sends ahead of the end) to the ranks of a job with snapshots is a notice, not a crash. The signal is
recorded by the stop-signal thread (``hf_dtrain.distributed.groups.stop_signals``, so it is seen even while the main
thread sits inside a collective); at the next step boundary every rank learns, through one all-reduce on the engine's
control group, whether any rank got one, so all stop after the same step; the engine then writes that step's
snapshot to ``persist_dir`` and the rank exits with status 128 + the signal (what launchers and SLURM's requeue read
as "stopped by the signal": run again). A rank that has not exited ``deadline`` seconds after its signal exits
anyway, saying what the newest saved step is; a notice whose peers do not answer (one died, and the launcher stops
the survivors with SIGTERM) is said to be that and ends the rank at once."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time

# the signals taken as a notice
NOTICE_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class Preemption:
    """One rank's handling of a stop notice for the engine whose ``ranks`` it agrees over. ``deadline``: the seconds
    from the signal to the exit, whatever happens (cloud providers give 30 s after the notice); ``describe``: a
    callable giving the newest saved step's words, for the line printed when the deadline passes."""

    def __init__(self, ranks, deadline: float, describe) -> None:
        from hf_dtrain.distributed.groups import stop_signals

        self.ranks, self.deadline, self.describe = ranks, deadline, describe
        self.signum = 0  # the signal received (0: none)
        self.received: float | None = None  # its time.monotonic()
        self.host = socket.gethostname()
        self._timer: threading.Timer | None = None
        self._pending = None  # (work, tensor) of the all-reduce the last step boundary started
        # a loop that never asks (agree) is left the signal's usual ending: its SIGTERM is not held for the deadline
        self.asked = False
        self._stack = contextlib.ExitStack()
        # above the rank monitor's listener, which would take a SIGTERM for the launcher stopping the survivors
        self._stack.enter_context(stop_signals(self._notice, NOTICE_SIGNALS, priority=10))

    def _notice(self, signum: int) -> bool:
        """On the stop-signal thread: record the first notice and start the deadline; not taken (the next listener,
        or the signal's usual ending) while the training loop has not reached a step boundary that asks."""
        if not self.asked:
            return False
        if self.signum:
            return True
        self.signum, self.received = signum, time.monotonic()
        self._timer = threading.Timer(self.deadline, self._expired)
        self._timer.daemon = True
        self._timer.start()
        return True

    @property
    def name(self) -> str:
        return signal_name(self.signum) if self.signum else ""

    def _expired(self) -> None:
        self.exit(
            f"hf_dtrain: rank {self.ranks.rank} (host {self.host}) got {self.name} and could not finish its step and "
            f"save within the {self.deadline:g} s deadline (fault_tolerance.preempt_deadline); it exits without "
            f"saving. {self.describe()} Relaunch the same command to resume from it."
        )

    def agree(self) -> int:
        """At a step boundary, on every rank: the signal any rank had got by the previous boundary (0: none). Each
        boundary starts an all-reduce (MAX) of the signal numbers on the engine's control group and reads the one the
        previous boundary started, done by now in the background: no wait in the step, and every rank reads the same
        value at the same step, one step after the signal at most. When the others do not answer and this rank got a
        notice, it is a launcher stopping the survivors of a rank that died: said, and the rank exits at once."""
        self.asked = True
        ranks = self.ranks
        if not ranks.distributed:
            return self.signum
        import torch
        import torch.distributed as dist

        agreed = 0
        try:
            if self._pending is not None:
                work, t = self._pending
                self._pending = None
                work.wait()
                agreed = int(t.item())
            t = torch.tensor([self.signum], dtype=torch.int64)
            self._pending = (dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ranks.group, async_op=True), t)
        except Exception as e:
            if not self.signum:
                raise  # the rank monitor names the dead rank
            self.exit(
                f"hf_dtrain: rank {ranks.rank} (host {self.host}) got {self.name} and the other ranks did not answer "
                f"at the step boundary ({type(e).__name__}), most likely because another rank failed and the launcher "
                f"stopped the rest (its summary names it). {self.describe()} Relaunch the same command to resume."
            )
        return agreed

    def elapsed(self) -> float:
        return 0.0 if self.received is None else time.monotonic() - self.received

    def exit(self, line: str, signum: int | None = None) -> None:
        """Print ``line`` and end the process with status 128 + the signal (no clean-up that could wait on a peer)."""
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.write(line + "\n")  # one write: the ranks' lines do not interleave
            sys.stderr.flush()
        os._exit(128 + (signum or self.signum or signal.SIGTERM))

    def close(self) -> None:
        """Wait for the all-reduce in flight (every rank started it), stop listening."""
        if self._pending is not None:
            with contextlib.suppress(Exception):
                self._pending[0].wait()
            self._pending = None
        if self._timer is not None:
            self._timer.cancel()
        self._stack.close()
