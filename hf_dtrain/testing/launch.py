"""Test and benchmark helpers: free ports, fresh Python processes, gloo groups, multi-process runs in one call, and
an elastic-agent style launcher of one process per rank."""

from __future__ import annotations

import multiprocessing as mp
import os
import runpy
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from hf_dtrain import processes

from ..distributed.groups import release_process_group


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_python(code: str, timeout: float = 300, env: dict | None = None, cwd: str | None = None) -> str:
    """Run ``code`` in a fresh Python process; return stdout, raise with stderr on failure or timeout."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = processes.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd
    )
    if proc.returncode != 0:
        raise RuntimeError(f"subprocess failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc.stdout


# the repository root (recipes/ and its accelerate configs): the tests and benchmarks run from a checkout
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def accelerate_launch(
    *argv: str, config: str = "cpu_2proc", env: dict | None = None, timeout: float = 600, check: bool = True
) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file recipes/accelerate/<config>.yaml <argv>`` from the repository root, as a
    user launches a recipe or ``-m hf_dtrain.cli ...`` on CPU: gloo ranks (``ACCELERATE_USE_CPU``), one intra-op
    thread each, this checkout importable, a free main-process port. Returns the finished process; with ``check``
    a failure raises with the end of its stderr."""
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        f"recipes/accelerate/{config}.yaml",
        "--main_process_port",
        str(free_port()),
        *map(str, argv),
    ]
    full_env = dict(
        os.environ,
        ACCELERATE_USE_CPU="true",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
    )
    full_env.update(env or {})
    proc = processes.run(cmd, capture_output=True, text=True, env=full_env, cwd=REPO, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"accelerate launch {' '.join(map(str, argv))} failed:\n{proc.stderr[-4000:]}")
    return proc


@contextmanager
def gloo_group(rank: int, world_size: int, addr: str = "127.0.0.1", port: int | str = 29500, timeout_s: float = 60):
    """A gloo default process group for the block (every collective times out after ``timeout_s``), destroyed
    safely at the end. Keep DDP models inside a function called in the block, not in the block's own locals: a DDP
    freed after the group is destroyed drops the group's last reference with the GIL held, and the group's
    destructor then deadlocks with its worker threads (pytorch/pytorch#56297; one rank exits, the other never does).
    The exit collects reference cycles while the group is still registered, then destroys it."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        yield
    finally:
        release_process_group()


# What a forkserver imports once, so that each rank starts from the imported modules instead of importing torch,
# transformers and peft again (about 7 s a process on 2 cores, most of a short multi-rank test).
_PRELOAD = ["hf_dtrain.testing", "hf_dtrain.distributed", "transformers.models.llama.modeling_llama", "peft"]


def _rank_context():
    """The multiprocessing context ranks start in: a forkserver with the heavy modules preloaded where that is safe
    (Linux, no CUDA device: a process that touched CUDA must never be forked), else ``spawn``. The forkserver is
    started once per process by its first use, imports nothing but ``_PRELOAD`` and runs no threads when it forks."""
    if (
        "forkserver" not in mp.get_all_start_methods()
        or torch.cuda.is_available()
        or os.environ.get("HF_DTRAIN_SPAWN_RANKS")
    ):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _distributed_entry(
    fn, rank: int, world_size: int, port: int, args: tuple, pg_timeout_s: float, environ: dict | None = None
) -> None:
    if environ is not None:  # a forked rank has the forkserver's environment: take the caller's, as spawn would
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    with gloo_group(rank, world_size, port=port, timeout_s=pg_timeout_s):
        fn(rank, world_size, *args)


def run_distributed(fn, world_size: int = 2, args: tuple = (), timeout: float = 180, pg_timeout_s: float = 60) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes (see ``_rank_context``) joined by a gloo
    process group on a free localhost port. Every collective times out after ``pg_timeout_s``; the whole run is
    killed after ``timeout`` seconds. Raises if any rank fails or hangs. ``fn`` must be importable (a module-level
    function)."""
    ctx = _rank_context()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_distributed_entry, args=(fn, r, world_size, port, args, pg_timeout_s, environ))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        if hung:
            raise TimeoutError(f"ranks {hung} still running after {timeout}s")
        failed = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
        if failed:
            raise RuntimeError(f"ranks failed with exit codes {failed}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def _forked_rank(module: str, args: list[str], environ: dict, log_path: str | None, cwd: str) -> None:
    """``python -m module *args`` (or ``python module *args`` for a ``.py`` path) in a rank forked from the preloaded
    forkserver: the caller's environment, working directory and output file, and the intra-op threads
    ``OMP_NUM_THREADS`` asks for (the forkserver's OpenMP runtime read its own environment when torch loaded)."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    fd = os.open(log_path or os.devnull, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    sys.argv = [module, *args]
    if module.endswith(".py"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(module)))  # as ``python script.py`` puts its folder first
        runpy.run_path(module, run_name="__main__")
    else:
        runpy.run_module(module, run_name="__main__", alter_sys=True)


def _fork_target(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(module or script, its arguments)`` when ``argv`` is ``[sys.executable, "-m", module, ...]`` or
    ``[sys.executable, "script.py", ...]`` and ranks start from the forkserver here (``_rank_context``), else None
    (such a command then runs as a fresh interpreter)."""
    if len(argv) < 2 or argv[0] != sys.executable or _rank_context().get_start_method() != "forkserver":
        return None
    if argv[1] == "-m" and len(argv) > 2:
        return argv[2], list(argv[3:])
    if argv[1].endswith(".py"):
        return argv[1], list(argv[2:])
    return None


def forked_run(argv: list[str], env: dict, log_path: str, timeout: float = 300, cwd: str | None = None) -> int:
    """``argv`` (``[sys.executable, "-m", module, ...]`` or ``[sys.executable, "script.py", ...]``) as one process
    forked from the preloaded forkserver of ``run_distributed`` (torch, transformers and peft already imported) with
    exactly ``env`` as its environment and its output appended to ``log_path``; where no forkserver is used (see
    ``_rank_context``) a fresh interpreter, as ``processes.run``. Returns the exit code (negative: the signal that
    ended it); after ``timeout`` seconds the process is killed and ``TimeoutError`` raised. For a program whose work
    ends with its files flushed: a forked process leaves through ``os._exit`` (no ``atexit`` handlers)."""
    cwd = cwd or os.getcwd()
    target = _fork_target(argv)
    if target is None:
        with open(log_path, "a") as log:
            try:
                done = processes.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, timeout=timeout)
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"still running after {timeout}s: {argv}") from None
        return done.returncode
    process = _rank_context().Process(target=_forked_rank, args=(*target, dict(env), log_path, cwd))
    process.start()
    process.join(timeout)
    if process.exitcode is None:
        process.kill()
        process.join(5)
        raise TimeoutError(f"still running after {timeout}s: {argv}")
    return process.exitcode


class _ForkedProcess:
    """What ``elastic_launch`` needs of ``subprocess.Popen`` (poll, wait, kill, send_signal; negative codes for
    signals), for a rank started from the forkserver."""

    def __init__(self, process):
        self.process, self.pid = process, process.pid

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self) -> int:
        self.process.join()
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def send_signal(self, sig: int) -> None:
        if self.process.exitcode is None:
            os.kill(self.pid, sig)


def elastic_launch(
    argv: list[str],
    world_size: int,
    env: dict | None = None,
    timeout: float = 300,
    log_dir: str | None = None,
    per_rank_env=None,
    per_rank_argv=None,
    master_addr: str = "127.0.0.1",
    grace_after_signal: float = 0.5,
    dump_signal: int | None = None,
    preloaded: bool = False,
) -> list[int]:
    """Start ``argv`` once per rank with torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR/PORT``,
    ``LOCAL_WORLD_SIZE=1`` and ``HF_DTRAIN_NODE_RANK=rank``: every rank its own emulated node) and behave as an
    elastic agent: when one rank dies the others are killed (at once after a signal; after up to 15 s for ranks
    that exit with an error, which may be refusing the same thing). Returns the exit codes (``-9`` for SIGKILL). Output
    goes to ``log_dir/rank{r}.out`` (files, not pipes: a rank blocked on a full pipe would stall its peers).
    ``per_rank_argv(rank, argv)``: the command of that rank (``Host.command`` to run it in an emulated host).
    ``grace_after_signal``: how long the others may run after a rank died of a signal (a test of what survivors
    do). ``dump_signal``: sent to a rank still running when that grace is over, a second before it is killed (the
    command registers ``faulthandler`` on it: its stacks land in its log, the reason it did not exit).
    ``preloaded``: a ``[sys.executable, "-m", module, ...]`` (or ``[sys.executable, "script.py", ...]``) command
    starts each rank from the forkserver of
    ``run_distributed`` (torch and transformers imported once, not in every rank: about 6 s of a rank's start on 2
    cores), for a module whose work ends with its files flushed (the rank leaves through ``os._exit``); where the
    forkserver is not used (``HF_DTRAIN_SPAWN_RANKS``, a CUDA device, ``per_rank_argv``) it is a fresh interpreter
    as without it."""
    port = free_port()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    procs, logs = [], []
    target = _fork_target(argv) if preloaded and per_rank_argv is None else None
    for rank in range(world_size):
        e = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK="0",
            WORLD_SIZE=str(world_size),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(port),
            LOCAL_WORLD_SIZE="1",
            HF_DTRAIN_NODE_RANK=str(rank),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
            **(env or {}),
        )
        if per_rank_env is not None:
            e.update(per_rank_env(rank))
        if target is not None:
            log_path = os.path.join(log_dir, f"rank{rank}.out") if log_dir else None
            process = _rank_context().Process(target=_forked_rank, args=(*target, e, log_path, os.getcwd()))
            process.start()
            procs.append(_ForkedProcess(process))
            continue
        log = open(os.path.join(log_dir, f"rank{rank}.out"), "a") if log_dir else subprocess.DEVNULL
        logs.append(log)
        command = per_rank_argv(rank, argv) if per_rank_argv is not None else argv
        procs.append(subprocess.Popen(command, env=e, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                # a rank killed by a signal: the others are stuck in a collective, stop them at once; a rank that
                # exited with an error: the others are usually refusing the same thing, give them time to say so
                grace = grace_after_signal if any(c is not None and c < 0 for c in codes) else 15.0
                end = time.monotonic() + grace
                while time.monotonic() < end and any(p.poll() is None for p in procs):
                    time.sleep(0.1)
                if dump_signal is not None and any(p.poll() is None for p in procs):
                    for p in procs:
                        if p.poll() is None:
                            p.send_signal(dump_signal)
                    time.sleep(1.0)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                return [p.wait() for p in procs]
            if all(c == 0 for c in codes):
                return codes
            time.sleep(0.2)
        raise TimeoutError(f"ranks still running after {timeout}s: {argv}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            if log is not subprocess.DEVNULL:
                log.close()


def relaunched(
    argv: list[str],
    world_size: int,
    log_dir: str,
    restarts: int = 0,
    env: dict | None = None,
    timeout: float = 600,
) -> list[list[int]]:
    """``argv`` on ``world_size`` ranks, launched again after each generation in which a rank failed, up to
    ``restarts`` times, as ``torchrun --max-restarts`` does: each generation is one :func:`elastic_launch` (its ranks
    forked from the preloaded forkserver where ``argv`` is ``[sys.executable, "-m", ...]``, so a generation costs no
    imports), told its number in ``HF_DTRAIN_FAULT_GENERATION`` (what the fault injector's
    schedule reads where torchrun would set ``TORCHELASTIC_RESTART_COUNT``), its output in
    ``log_dir/gen{g}/rank{r}.out`` (:func:`relaunch_output` reads them in order). ``timeout`` bounds all generations
    together. Returns each generation's exit codes; the last one is all 0 unless the restarts ran out."""
    deadline = time.monotonic() + timeout
    generations = []
    for gen in range(restarts + 1):
        folder = os.path.join(log_dir, f"gen{gen}")
        os.makedirs(folder, exist_ok=True)
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(generations)} generations ran past {timeout}s: {argv}")
        codes = elastic_launch(
            argv,
            world_size,
            dict(env or {}, HF_DTRAIN_FAULT_GENERATION=str(gen)),
            timeout=left,
            log_dir=folder,
            preloaded=True,
        )
        generations.append(codes)
        if all(c == 0 for c in codes):
            break
    return generations


def relaunch_output(log_dir: str, ranks) -> str:
    """What :func:`relaunched`'s ranks ``ranks`` (an iterable of rank numbers) wrote, generation by generation, each
    generation's ranks in the order given."""
    parts = []
    gen = 0
    while os.path.isdir(os.path.join(log_dir, f"gen{gen}")):
        for rank in ranks:
            path = os.path.join(log_dir, f"gen{gen}", f"rank{rank}.out")
            if os.path.exists(path):
                parts.append(open(path).read())
        gen += 1
    return "".join(parts)


def mean_over_ranks(value: float, group=None) -> float:
    """The mean of a per-rank number over the ranks of ``group`` (one all-reduce)."""
    t = torch.tensor(float(value), dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return float(t) / dist.get_world_size(group)
