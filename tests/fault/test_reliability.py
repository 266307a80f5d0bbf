"""What a long run relies on around the snapshot engine: two jobs never share snapshots, a lost snapshot process is
replaced (never a silent fresh start), nothing a local user does to the sockets or directories stalls or hijacks
the service, an orphaned snapshot process exits, and a rank that dies is named by the survivors."""

import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

import pytest

from hf_dtrain import processes
from hf_dtrain.fault import SnapshotEngine
from hf_dtrain.fault.smp import SnapshotManager
from hf_dtrain.fault.snapshot import SnapshotError, SnapshotMismatch, default_directory
from hf_dtrain.fault.wire import SMPClient, connect, private_dir
from hf_dtrain.testing import stop_snapshot_processes
from hf_dtrain.testing.launch import elastic_launch
from tests.fault.test_snapshot import _setup
from tests.fault.test_snapshot import _steps as _train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_two_jobs_with_default_settings_never_share_snapshots(ft_dir, tmp_path, monkeypatch):
    """Default directories differ per job; in one directory (the same output directory), the second job's restore is
    refused on its identity, naming what differs and the flag that starts fresh, and that flag works."""
    runtime = tempfile.mkdtemp(dir="/tmp")  # short: a Unix socket path has at most 107 bytes
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime)  # the default root, private to this test
    job_a, job_b = {"seed": 0, "learning_rate": 1e-3}, {"seed": 1, "learning_rate": 3e-4}
    model, opt, sched = _setup()
    a = SnapshotEngine(model, opt, sched, parity=0, identity=job_a, idle_exit=5)
    model_b, opt_b, sched_b = _setup()
    b = SnapshotEngine(model_b, opt_b, sched_b, parity=0, identity=job_b, idle_exit=5)
    try:
        root = os.path.join(runtime, "hf_dtrain_ft")
        assert a.base != b.base and os.path.dirname(a.base) == os.path.dirname(b.base) == root
        assert default_directory("x") == os.path.join(root, "x") and os.stat(root).st_mode & 0o777 == 0o700
        _train(model, opt, sched, a, 1, 2)
        assert b.restore() is None  # B sees nothing of A's
    finally:
        for e in (a, b):
            e.close(shutdown=True)
        shutil.rmtree(runtime, ignore_errors=True)
    # both in one directory (the same output directory): refused, naming the difference
    a = SnapshotEngine(model, opt, sched, directory=ft_dir, parity=0, identity=job_a)
    _train(model, opt, sched, a, 1, 3)
    a.close()
    b = SnapshotEngine(model_b, opt_b, sched_b, directory=ft_dir, parity=0, identity=job_b)
    with pytest.raises(
        SnapshotMismatch,
        match=r"belongs to another job: .*job\.learning_rate: 0\.001 there, "
        r"0\.0003 here.*job\.seed: 0 there, 1 here.*fresh-start true",
    ):
        b.restore()
    b.close()
    fresh = SnapshotEngine(model_b, opt_b, sched_b, directory=ft_dir, parity=0, identity=job_b, fresh_start=True)
    assert fresh.restore() is None and fresh.available()[0] == []  # A's snapshots dropped, B starts at 0
    fresh.close(shutdown=True)


def test_a_killed_snapshot_process_is_replaced_and_training_goes_on(ft_dir, caplog):
    model, opt, sched = _setup()
    engine = SnapshotEngine(model, opt, sched, directory=ft_dir, parity=0)
    _train(model, opt, sched, engine, 1, 2)
    old = json.load(open(os.path.join(ft_dir, "node0", "smp.json")))
    os.kill(old["pid"], signal.SIGKILL)
    time.sleep(0.3)
    with caplog.at_level("WARNING"):
        _train(model, opt, sched, engine, 3, 4)  # the next snapshot finds it gone
    new = json.load(open(os.path.join(ft_dir, "node0", "smp.json")))
    assert new["pid"] != old["pid"] and new["address"][1] == old["address"][1]  # same peer port
    assert engine.respawns == 1 and "was lost" in caplog.text and "fresh snapshot" in caplog.text
    assert engine.available()[0] == [3, 4]
    engine.close()


def test_a_lost_snapshot_process_never_leads_to_a_silent_fresh_start(ft_dir):
    """The whole node lost (trainer and snapshot process): the relaunch stops, saying what was lost and how to start
    over; with fresh_start it trains from step 0."""
    model, opt, sched = _setup()
    engine = SnapshotEngine(model, opt, sched, directory=ft_dir, parity=0)
    _train(model, opt, sched, engine, 1, 3)
    engine.close()
    stop_snapshot_processes(ft_dir)
    time.sleep(0.3)
    model, opt, sched = _setup()
    relaunched = SnapshotEngine(model, opt, sched, directory=ft_dir, parity=0)
    with pytest.raises(
        SnapshotError,
        match=r"took snapshots .* none can be restored, so it will not silently "
        r"start over.*snapshot process was lost.*fresh-start true",
    ):
        relaunched.restore()
    relaunched.close()
    fresh = SnapshotEngine(model, opt, sched, directory=ft_dir, parity=0, fresh_start=True)
    assert fresh.restore() is None
    fresh.close(shutdown=True)


def test_an_idle_unauthenticated_connection_does_not_delay_others(ft_dir):
    model, opt, sched = _setup()
    engine = SnapshotEngine(model, opt, sched, directory=ft_dir, parity=0)
    try:
        info = engine.client.info()
        idle_unix = socket.socket(socket.AF_UNIX)
        idle_unix.connect(os.path.join(engine.dir, "smp.sock"))
        idle_tcp = socket.create_connection(tuple(info["address"]))  # connected, never a byte sent
        time.sleep(0.2)
        t0 = time.perf_counter()
        client = SMPClient(engine.dir, engine.key, timeout=10)
        reply, _ = client.call({"op": "status"})
        peer = connect(tuple(info["address"]), engine.key, 10)
        peer.send_bytes(json.dumps({"op": "ping"}).encode())
        elapsed = time.perf_counter() - t0
        # a server that served connections one at a time would hold these behind the idle ones until their
        # handshake deadline dropped them; the bound is half that deadline, not a speed
        assert reply["node"] == 0 and elapsed < SnapshotManager.HANDSHAKE_SECONDS / 2, elapsed
        # malformed authenticated requests are refused; the connection keeps serving
        client.conn.send_bytes(b"\xff not json")
        assert "error" in json.loads(client.conn.recv_bytes())
        client.conn.send_bytes(b"[1, 2]")
        assert "JSON object" in json.loads(client.conn.recv_bytes())["error"]
        assert client.call({"op": "bogus"})[0]["error"].startswith("unknown op")
        assert client.call({"op": "status"})[0]["node"] == 0
        # the idle connection is dropped once the handshake deadline (5 s) has passed: its challenge, then EOF
        idle_tcp.settimeout(15)
        t0 = time.perf_counter()
        while idle_tcp.recv(1024):
            pass
        assert time.perf_counter() - t0 < 2 * SnapshotManager.HANDSHAKE_SECONDS
        for s in (idle_unix, idle_tcp, peer):
            s.close()
        client.close()
    finally:
        engine.close(shutdown=True)


def test_the_runtime_directory_must_be_private(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)  # another user created it first
    with pytest.raises(PermissionError, match=rf"{theirs} is owned by uid 65534.*fault_tolerance.directory"):
        private_dir(str(theirs))
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    os.chmod(open_to_all, 0o777)
    with pytest.raises(PermissionError, match=rf"mode 0o777.*e\.g\. {open_to_all}/hf_dtrain_ft_\d+") as info:
        private_dir(str(open_to_all))
    assert "chmod" not in str(info.value)  # never advice to change a shared directory such as /tmp
    readable = tmp_path / "readable"
    readable.mkdir()
    os.chmod(readable, 0o755)  # ours, from an earlier release: tightened
    private_dir(str(readable))
    assert os.stat(readable).st_mode & 0o777 == 0o700
    link = tmp_path / "link"
    link.symlink_to(readable)
    with pytest.raises(PermissionError, match="a symlink"):
        private_dir(str(link))


_ORPHAN = """
import os, sys, torch
from hf_dtrain.fault import SnapshotEngine
from hf_dtrain.testing import tiny_llama
model = tiny_llama(seed=0, hidden_size=32)
engine = SnapshotEngine(model, torch.optim.AdamW(model.parameters()), directory=sys.argv[1], parity=0, idle_exit=1.0)
engine.snapshot(1, extra={})
engine.wait()
print(engine.client.info()["pid"], flush=True)
os.kill(os.getpid(), 9)
"""


def test_an_orphaned_snapshot_process_exits_after_the_grace_period(ft_dir):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = processes.run([sys.executable, "-c", _ORPHAN, ft_dir], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    pid = int(proc.stdout.split()[0])
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    gone = time.monotonic() - t0
    assert gone < 4.0, f"snapshot process still alive {gone:.1f} s after its trainer died (grace 1 s)"
    exited = json.load(open(os.path.join(ft_dir, "node0", "exited.json")))
    assert "fault_tolerance.idle_exit" in exited["reason"]


def test_interrupted_writes_leave_no_temporary_files(ft_dir, tmp_path):
    disk = tmp_path / "disk"
    (disk / "snapshot-3").mkdir(parents=True)
    stale = disk / "snapshot-3" / "rank0.safetensors.4242.tmp"  # a writer killed mid-persist
    stale.write_bytes(b"partial")
    model, opt, sched = _setup()
    engine = SnapshotEngine(model, opt, sched, directory=ft_dir, parity=0, persist_dir=str(disk), persist_every=1)
    assert not stale.exists()
    _train(model, opt, sched, engine, 1, 2)
    engine.close(shutdown=True)
    assert not list(disk.rglob("*.tmp"))


@pytest.mark.slow
def test_a_killed_rank_is_named_by_the_survivor(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    argv = [
        sys.executable,
        "-m",
        "hf_dtrain.testing.fault",
        "1:3",
        "hf_dtrain.cli",
        "pretrain",
        "--max-steps",
        "6",
        "--per-device-train-batch-size",
        "2",
        "--seq-len",
        "16",
        "--data-bytes",
        "100000",
        "--eval-blocks",
        "2",
        "--output-dir",
        str(out / "run"),
        "--fault-tolerance.directory",
        str(tmp_path / "ft"),
        "--progress",
        "false",
        "--save-model",
        "false",
    ]
    t0 = time.monotonic()
    codes = elastic_launch(
        argv, 2, env={"ACCELERATE_USE_CPU": "true"}, log_dir=str(out), timeout=240, grace_after_signal=60
    )
    try:
        text = open(out / "rank0.out").read()
        assert codes[1] == -signal.SIGKILL and codes[0] == 1, (codes, text[-3000:])
        assert "hf-dtrain pretrain [rank 0]: hf_dtrain: rank 1 (host " in text, text[-3000:]
        assert "stopped responding" in text
        assert "last at step 3" in text and "Relaunch the same command to resume from the snapshot processes" in text
        assert "Traceback" not in text
        assert time.monotonic() - t0 < 120
    finally:
        stop_snapshot_processes(tmp_path / "ft")


def test_the_snapshot_process_imports_neither_torch_nor_the_package(tmp_path):
    """The snapshot process is started by path so it stays light (it starts in a second and exits fast when its job
    is gone): none of its modules may import ``hf_dtrain``, torch or transformers. (An import of
    ``hf_dtrain.errors`` in ``erasure.py`` once pulled all three in, and an orphan took 2 s longer to exit.)"""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import smp; "
        "print(sorted(m for m in ('hf_dtrain', 'torch', 'transformers') if m in sys.modules))"
    )
    out = processes.run(
        [sys.executable, "-c", code, os.path.join(ROOT, "hf_dtrain", "fault")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
