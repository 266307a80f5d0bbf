"""Process groups and the rank monitor: starting the default group so a restarted generation does not read the
dead one's addresses, ending it cleanly, and naming the rank that died when a collective fails."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout  # what init_process_group uses

from hf_dtrain.errors import UserError


def release_process_group() -> None:
    """End a distributed run cleanly: collect what still references DDP models, then destroy the default process
    group. Freeing a DDP model after its gloo group is gone (or at interpreter exit) can abort or hang the process
    (pytorch/pytorch#56297); call this after the last collective, once the DDP model's own references are dropped
    (``del model`` in the caller)."""
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def init_distributed(backend: str | None = None, timeout=None) -> bool:
    """Initialize the default process group before Accelerate / the Trainer do, when torchrun's or accelerate's
    elastic agent launched this process and shares its store with the workers (``TORCHELASTIC_USE_AGENT_STORE``).

    That store outlives a failed generation, and torch puts no per-attempt prefix on the keys gloo and NCCL
    publish their addresses under: a restarted generation (``--max-restarts``) reads the dead one's addresses and
    fails in ``connectFullMesh`` (``Connection refused``) or hangs. Here the keys are prefixed with
    ``TORCHELASTIC_RESTART_COUNT``. Returns whether it initialized the group (Accelerate and the Trainer then use
    it as it is). ``timeout``: a ``timedelta`` every collective of the group waits at most (torch's default when
    None)."""
    timeout = timeout or default_pg_timeout
    if not dist.is_available() or dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return False
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=default_pg_timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"hf_dtrain/attempt_{attempt}", store)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend,
        store=store,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )
    return True


class _StopSignals:
    """The process's one watcher of stop signals (SIGTERM, SIGUSR1): ``signal.set_wakeup_fd`` and a thread that reads
    it, so a signal is acted on even while the main thread sits inside a collective (a Python handler would wait for
    the collective to return, forever when a peer is gone). Each signal goes to the listeners that asked for it,
    highest ``priority`` first, until one returns True (it took charge); when none does, the rank exits as the
    signal's default action would (status 128 + the signal)."""

    def __init__(self) -> None:
        self.listeners: list[tuple[int, int, tuple, object]] = []  # (priority, order, signals, listener)
        self.previous: dict[int, object] = {}
        self.lock = threading.Lock()
        self.read_fd = self.write_fd = None
        self.previous_fd = None
        self.thread: threading.Thread | None = None
        self.order = 0
        # set when a SIGTERM comes: a rank whose collective failed after it is a survivor the launcher stops (a peer
        # died), whichever listener took the signal (a preemption notice's, first)
        self.terminated = threading.Event()

    def add(self, listener, signals: tuple, priority: int) -> object | None:
        if threading.current_thread() is not threading.main_thread():  # handlers are set from the main thread only
            return None
        with self.lock:
            if self.thread is None:
                self.read_fd, self.write_fd = os.pipe()
                os.set_blocking(self.write_fd, False)
                self.previous_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
                self.thread = threading.Thread(
                    target=self._run, args=(self.read_fd,), daemon=True, name="hf_dtrain-stop"
                )
                self.thread.start()
            for s in signals:
                if s not in self.previous:  # the wake-up thread acts; the handler only makes the signal non-fatal
                    self.previous[s] = signal.signal(s, lambda *_: None)
            self.order += 1
            entry = (priority, self.order, tuple(signals), listener)
            self.listeners.append(entry)
            return entry

    def remove(self, entry) -> None:
        if entry is None:
            return
        with self.lock:
            self.listeners.remove(entry)
            wanted = {s for _, _, signals, _ in self.listeners for s in signals}
            for s in [s for s in self.previous if s not in wanted]:
                signal.signal(s, self.previous.pop(s))
            if self.listeners or self.thread is None:
                return
            signal.set_wakeup_fd(self.previous_fd)
            thread, write_fd, read_fd = self.thread, self.write_fd, self.read_fd
            self.thread = self.read_fd = self.write_fd = None
        os.close(write_fd)  # the thread reads EOF and ends
        thread.join(timeout=5)
        os.close(read_fd)

    def _run(self, read_fd: int) -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                with self.lock:
                    ordered = sorted(self.listeners, key=lambda e: (-e[0], -e[1]))
                    asked = [e[3] for e in ordered if signum in e[2]]
                    if not asked and signum not in self.previous:
                        continue  # another handler's signal (SIGINT's KeyboardInterrupt): not ours
                if signum == signal.SIGTERM:
                    self.terminated.set()
                if not any(listener(signum) for listener in asked):
                    os._exit(128 + signal.SIGTERM)


_STOP = _StopSignals()


@contextlib.contextmanager
def stop_signals(listener, signals: tuple = (signal.SIGTERM,), priority: int = 0):
    """While inside, ``listener(signum) -> bool`` hears ``signals`` from the stop-signal thread (see
    :class:`_StopSignals`), after listeners of higher ``priority``; True: it took charge (the rank goes on until it
    exits by itself). Outside the main thread it does nothing (signals stay as they were)."""
    entry = _STOP.add(listener, signals, priority)
    try:
        yield
    finally:
        _STOP.remove(entry)


class RankFailure(UserError, RuntimeError):
    """Another rank stopped (killed, crashed, its host lost) while this one was in a collective with it."""

    exit_at_once = True  # hf_dtrain.errors.report_and_exit: no clean-up that waits on the dead peer


class CommFailure(UserError, RuntimeError):
    """A collective or transfer failed, said with what this rank was doing (a layer's own wording, such as the
    pipeline stage that waited): :meth:`RankMonitor.guard` keeps that wording after the dead rank's name."""


class RankMonitor:
    """Names the rank that died when a collective fails, instead of a raw gloo/NCCL traceback.

    Each rank publishes a heartbeat (a counter, its host, pid and the step it is on) every ``interval`` seconds
    in the rendezvous store (``MASTER_ADDR:MASTER_PORT``, which torchrun's agent or rank 0 hosts). When a collective
    inside :meth:`guard` fails, the survivor reads the heartbeats twice, ``3 * interval`` apart: a rank whose
    counter stood still is dead, and :class:`RankFailure` says which, on which host, at which step, and how to
    resume. ``monitor.step = n`` as training goes."""

    def __init__(self, interval: float = 1.0, resume_hint: str = "relaunch the same command to resume"):
        self.interval, self.resume_hint = interval, resume_hint
        self._step = 0
        self.step_of = None  # or a callable giving the current step (a Trainer's state.global_step)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"hf_dtrain/heartbeat/{attempt}/"
        self.store = None
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            try:
                self.store = dist.TCPStore(
                    os.environ["MASTER_ADDR"],
                    int(os.environ["MASTER_PORT"]),
                    self.world,
                    is_master=False,
                    timeout=timedelta(seconds=max(5.0, 3 * interval)),
                )
            except Exception:  # no TCP store there (a file:// rendezvous): failures pass through unnamed
                self.store = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._beats = 0
        self._beat()
        self._thread = threading.Thread(target=self._run, daemon=True, name="hf_dtrain-heartbeat")
        self._thread.start()

    def _beat(self) -> None:
        if self.store is None:
            return
        if self.step_of is not None:
            self._step = self.step_of()
        self._beats += 1
        waiting, at = _main_thread_place()
        self.store.set(
            self.prefix + str(self.rank),
            json.dumps(
                {"n": self._beats, "host": self.host, "pid": self.pid, "step": self.step, "waiting": waiting, "at": at}
            ),
        )

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:  # published by the heartbeat thread at once (the loop never waits on it)
        self._step = value
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._beat()
            except Exception:  # the store is gone (its host died): diagnose() says so
                return

    def _read(self) -> dict:
        out = {}
        for r in range(self.world):
            key = self.prefix + str(r)
            if self.store.check([key]):
                out[r] = json.loads(self.store.get(key))
        return out

    def diagnose(self) -> str | None:
        """A message naming the dead ranks, or None when every rank's heartbeat still moves."""
        if self.store is None:
            return None
        if self.step_of is not None:
            self._step = self.step_of()
        try:
            first = self._read()
            self._wait_unless_stopped(3 * self.interval)
            second = self._read()
        except Exception:
            return (
                f"hf_dtrain: the rendezvous store at {self.address} is unreachable, so rank 0 (or the launcher "
                f"that hosted it) is gone; rank {self.rank} (host {self.host}) stops at step {self.step}. "
                f"{self.resume_hint[0].upper()}{self.resume_hint[1:]}."
            )
        dead = [
            r
            for r in range(self.world)
            if r != self.rank and (r not in second or second[r]["n"] == first.get(r, {}).get("n"))
        ]
        if not dead:
            # every peer alive: one whose main thread is not inside a collective never joined the one this rank
            # waited in (it hangs elsewhere, or runs another code path)
            hung = [r for r in range(self.world) if r != self.rank and second.get(r, {}).get("waiting") is False]
            if not hung:
                return None
            named = "; ".join(
                f"rank {r} (host {second[r].get('host', '?')}, pid {second[r].get('pid', '?')}, at step "
                f"{second[r].get('step', '?')}) is alive but not in a collective: its main thread is at "
                f"{second[r].get('at', '?')}"
                for r in hung
            )
            return (
                f"hf_dtrain: rank {self.rank} (host {self.host}) waited in a collective at step {self.step} until the "
                f"timeout; {named}. That rank hangs or took another code path; rank {self.rank} stops. "
                f"{self.resume_hint[0].upper()}{self.resume_hint[1:]}."
            )
        beats = {r: second.get(r, {}) for r in dead}
        named = ", ".join(
            f"rank {r} (host {b.get('host', '?')}, pid {b.get('pid', '?')}, last at step {b.get('step', '?')})"
            for r, b in beats.items()
        )
        return (
            f"hf_dtrain: {named} stopped responding while rank {self.rank} (host {self.host}) was in a "
            f"collective at step {self.step}; rank {self.rank} stops too. {self.resume_hint[0].upper()}"
            f"{self.resume_hint[1:]}."
        )

    def _wait_unless_stopped(self, seconds: float) -> None:
        """Sleep ``seconds``, unless a launcher's stop signal comes first (or came already): a collective failed and
        the launcher stops the survivors, so a peer died and the launcher's summary names it; the rank exits at once
        (:meth:`_on_launcher_stop`) instead of waiting for the heartbeats, on every restart."""
        if not _under_launcher():
            time.sleep(seconds)
        elif _STOP.terminated.wait(seconds):  # at once when it came already
            self._on_launcher_stop(signal.SIGTERM)

    def _on_launcher_stop(self, signum: int) -> bool:
        """A launcher (torchrun's agent) stops the survivors with SIGTERM at once when a rank dies, before any
        collective could fail: this says so, with the step and the resume hint, and exits as SIGTERM would, at once
        (the heartbeats could name the dead rank only after ``3 * interval``; the launcher's table names it, and
        every restart would wait that long). Asked after a preemption handler (``hf_dtrain.fault``), which claims
        the signal when fault tolerance is on."""
        if self.step_of is not None:
            with contextlib.suppress(Exception):
                self._step = self.step_of()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        print(
            f"hf_dtrain: rank {self.rank} (host {self.host}) was stopped by the launcher (SIGTERM) at step "
            f"{self.step}, most likely because another rank failed (the launcher's summary names it). "
            f"{self.resume_hint[0].upper()}{self.resume_hint[1:]}.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + signal.SIGTERM)

    @contextlib.contextmanager
    def _launcher_stop(self):
        """Under a launcher (torchrun, accelerate launch), SIGTERM prints the resume hint (:meth:`_on_launcher_stop`)
        instead of ending the rank without a word."""
        if not _under_launcher():
            yield
            return
        with stop_signals(self._on_launcher_stop, (signal.SIGTERM,), priority=0):
            yield

    @contextlib.contextmanager
    def guard(self):
        """Context manager: a failing collective inside becomes a :class:`RankFailure` naming the dead rank (the
        original error chained); any other error, or one no dead rank explains, passes through unchanged. Under a
        launcher, a SIGTERM sent because a peer died prints the same, with the resume hint, before the rank exits."""
        with self._launcher_stop():  # also while a failed collective is diagnosed: the launcher's SIGTERM comes then
            try:
                yield self
            except Exception as e:
                failed = is_comm_error(e) and not isinstance(e, RankFailure)
                if failed:  # the launcher's SIGTERM already came (a preemption notice took it): a peer died
                    self._wait_unless_stopped(0)
                message = self.diagnose() if failed else None
                if message is None:
                    raise
                if isinstance(e, CommFailure):
                    message = f"{message} ({e})"
                raise RankFailure(message) from e

    def close(self) -> None:
        self._stop.set()
        self._wake.set()


def _under_launcher() -> bool:
    """Run by torchrun's or accelerate launch's elastic agent, which stops the other ranks when one dies."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "TORCHELASTIC_RESTART_COUNT" in os.environ


# where a rank's main thread waits on its peers: a collective (torch.distributed), or DDP's reducer inside backward
_WAITING = (os.path.join("torch", "distributed", ""), os.path.join("torch", "autograd", ""))


def _main_thread_place() -> tuple[bool, str]:
    """Whether the main thread's innermost Python frame waits on peers (in ``torch.distributed``, or in autograd
    where DDP's reducer waits), and where it is (``file:line in function``)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return False, "?"
    name = frame.f_code.co_filename
    return any(w in name for w in _WAITING), f"{os.path.basename(name)}:{frame.f_lineno} in {frame.f_code.co_name}"


def is_comm_error(e: BaseException) -> bool:
    """``e`` is a failed collective or transfer (torch's ``DistError``, or a backend's runtime error)."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        s in text
        for s in (
            "Gloo",
            "gloo",
            "NCCL",
            "Connection reset",
            "Connection closed",
            "Broken pipe",
            "connectFullMesh",
            "Timed out",
            "timed out",
        )
    )
