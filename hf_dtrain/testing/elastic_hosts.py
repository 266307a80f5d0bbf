"""Hosts of an elastic run as processes: start one (``hf-dtrain elastic`` under torchrun), lose one (every process
of it killed at once, as a lost machine), wait on the run's log. Shared by the elastic tests and
``benchmarks/elastic.py`` (where each host is a network namespace)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterable

import psutil

from hf_dtrain.jobs.elastic import read_log, torchrun_command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def launch_host(
    config,
    endpoint: str,
    run_id: str,
    log,
    wrap: Callable[[list], list] | None = None,
    env: dict | None = None,
    local_addr: str | None = None,
    store_host: bool | None = None,
) -> subprocess.Popen:
    """This host's torchrun agent for ``config`` (an ``ElasticConfig``), its output to the file ``log``; ``wrap``
    turns the command into one that runs elsewhere (``Host.command`` of a network namespace), ``env`` adds to its
    environment (``GLOO_SOCKET_IFNAME`` there)."""
    cmd, extra = torchrun_command(config, endpoint, run_id, local_addr=local_addr, store_host=store_host)
    env = dict(
        os.environ,
        **extra,
        **(env or {}),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    )
    return subprocess.Popen(
        wrap(cmd) if wrap else cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def lose_host(host: subprocess.Popen) -> None:
    """The host is gone: its agent, its workers and its snapshot process, killed at once (SIGKILL)."""
    try:
        procs = [psutil.Process(host.pid)] + psutil.Process(host.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    host.wait()


def kill_strays(marker: str) -> None:
    """Kill what is left of a run whose command lines contain ``marker`` (its snapshot processes outlive workers)."""
    for p in psutil.process_iter(["cmdline"]):
        if marker in " ".join(p.info["cmdline"] or []):
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def wait_for_log(
    output_dir: str, until: Callable[[list], bool], timeout: float, hosts: Iterable[subprocess.Popen], what: str
) -> list[dict]:
    """The run's log once ``until(log)`` holds; ``AssertionError`` naming ``what`` after ``timeout`` seconds or when
    every host has exited."""
    hosts = list(hosts)
    deadline = time.monotonic() + timeout
    log: list = []
    while time.monotonic() < deadline:
        try:
            log = read_log(output_dir)
        except (OSError, json.JSONDecodeError):
            log = []
        if log and until(log):
            return log
        if all(h.poll() is not None for h in hosts):
            break
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}; the log ends with {log[-3:]}")
