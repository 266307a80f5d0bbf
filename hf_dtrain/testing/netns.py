"""A slow network on one machine: 2 to 4 "hosts" as Linux network namespaces joined by a bridge through veth pairs,
each link rate-limited with ``tc`` token buckets (``tbf``) in both directions.

Needs root, ``ip`` and ``tc`` (iproute2) and the bridge and veth modules; ``netem`` (delay) is used only if the
kernel has it. Traffic stays inside the namespaces (addresses ``10.77.<k>.x/24`` on an isolated bridge, no route out),
and everything is deleted on exit, also after an error. Where namespaces cannot be created, :func:`available` says
why, so a caller can fall back to loopback and report it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Host:
    namespace: str
    interface: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=check)


def _tc(namespace: str, command: str) -> None:
    """``tc <command>`` (words split on spaces) inside ``namespace``."""
    _run("ip", "netns", "exec", namespace, "tc", *command.split())


def available() -> tuple[bool, str]:
    """``(True, "")`` if namespaces, veth, a bridge and ``tbf`` can be set up here, else ``(False, reason)``."""
    if sys.platform != "linux":
        return False, f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"{tool} (iproute2) is not installed"
    try:
        with emulated_hosts(2, rate="1gbit"):
            pass
    except (subprocess.SubprocessError, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return False, f"could not create namespaces/veth/bridge/tbf: {detail.strip()}"
    return True, ""


def _netem_available() -> bool:
    return _run("modprobe", "-n", "sch_netem", check=False).returncode == 0


@contextmanager
def emulated_hosts(
    n: int, rate: str | None = "100mbit", delay_ms: float = 0.0, subnet: int = 77, rates: list | None = None
):
    """Create ``n`` hosts (2 to 4) whose links to a shared bridge carry at most ``rate`` each way (``tc tbf``;
    None: unlimited); ``rates`` gives each host its own (a slowed host). ``delay_ms`` adds ``netem`` delay where the
    kernel has it (raises otherwise). Yields the hosts."""
    if rates is not None and len(rates) != n:
        raise ValueError(f"rates has {len(rates)} entries for {n} hosts; give one rate per host (or None).")
    if not 2 <= n <= 4:
        raise ValueError(f"emulated_hosts supports 2 to 4 hosts, got n={n}.")
    if delay_ms and not _netem_available():
        raise ValueError(
            "delay_ms needs the sch_netem kernel module, which this kernel does not have; use delay_ms=0 "
            "(rate limits with tbf still work)."
        )
    # SIGTERM (timeout, kill) would end Python without running ``finally``: turn it into SystemExit meanwhile
    previous = (
        signal.signal(signal.SIGTERM, _raise_exit) if threading.current_thread() is threading.main_thread() else None
    )
    tag = f"hd{os.getpid() % 100000}"
    switch = f"{tag}sw"
    hosts = [Host(f"{tag}h{i}", f"{tag}a{i}", f"10.{subnet}.{os.getpid() % 250}.{i + 1}") for i in range(n)]
    created: list[str] = []
    try:
        _run("ip", "netns", "add", switch)
        created.append(switch)
        _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", switch, "link", "set", "br0", "up")
        for i, host in enumerate(hosts):
            peer = f"{tag}b{i}"
            _run("ip", "netns", "add", host.namespace)
            created.append(host.namespace)
            _run("ip", "link", "add", host.interface, "type", "veth", "peer", "name", peer)
            _run("ip", "link", "set", host.interface, "netns", host.namespace)
            _run("ip", "link", "set", peer, "netns", switch)
            _run("ip", "-n", switch, "link", "set", peer, "master", "br0")
            _run("ip", "-n", switch, "link", "set", peer, "up")
            _run("ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _run("ip", "-n", host.namespace, "link", "set", host.interface, "up")
            _run("ip", "-n", host.namespace, "link", "set", "lo", "up")
            link_rate = rates[i] if rates is not None else rate
            for ns, dev in ((host.namespace, host.interface), (switch, peer)):  # both directions
                if link_rate is not None:
                    _tc(ns, f"qdisc add dev {dev} root handle 1: tbf rate {link_rate} burst 64kb latency 50ms")
                if delay_ms:
                    parent = "parent 1:1" if link_rate is not None else "root"
                    _tc(ns, f"qdisc add dev {dev} {parent} netem delay {delay_ms / 2}ms")
        yield hosts
    finally:
        for ns in reversed(created):
            _run("ip", "netns", "del", ns, check=False)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def run_on_hosts(hosts: list[Host], argv, timeout: float = 300, env: dict | None = None) -> list[str]:
    """Run ``argv(rank, hosts)`` (a list of strings) in every host's namespace at once, with ``GLOO_SOCKET_IFNAME``
    set to the host's interface; return each rank's stdout. Every process is killed after ``timeout`` seconds;
    a failure or a timeout raises with the failing rank's stderr."""
    commands = [host.command(argv(rank, hosts)) for rank, host in enumerate(hosts)]
    envs = [dict(os.environ, GLOO_SOCKET_IFNAME=host.interface, **(env or {})) for host in hosts]
    return run_ranks(commands, envs, timeout)


def run_ranks(commands: list[list[str]], envs: list[dict], timeout: float = 300) -> list[str]:
    """Start every rank's command at once and return each stdout; kill all after ``timeout`` seconds; raise with the
    first failing rank's stderr. Output goes to files, not pipes: a rank blocked on a full pipe would stall the
    collective its peers wait in."""
    procs, files = [], []
    deadline = time.monotonic() + timeout
    try:
        for command, full_env in zip(commands, envs):
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            files.append((out, err))
            procs.append(subprocess.Popen(command, env=full_env, stdout=out, stderr=err, text=True))
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"ranks still running after {timeout}s on the emulated network") from None
        outputs, errors = [], []
        for out, err in files:
            out.seek(0)
            err.seek(0)
            outputs.append(out.read())
            errors.append(err.read())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
        for out, err in files:
            out.close()
            err.close()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        # the cause: a rank that did not merely lose its connection to the one that failed first
        cause = next((r for r in failed if "by peer" not in errors[r]), failed[0])
        codes = {r: procs[r].returncode for r in failed}
        raise RuntimeError(
            f"rank {cause} failed on the emulated network (exit codes {codes}):\n{errors[cause][-4000:]}"
        )
    return outputs
