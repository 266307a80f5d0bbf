"""Fault injection (after torchft's injector), 3 gloo ranks, one emulated node each with its own snapshot process:

* a trainer SIGKILLed before its optimizer step, or in the middle of a snapshot (written, not committed), then all
  ranks restarted as an elastic agent would: the run resumes from the snapshot processes and every step's loss
  equals the uninterrupted run's bit for bit;
* a node lost (its trainer and its snapshot process killed): rebuilt from the peers' parity, checksums verified,
  the same losses;
* two nodes lost with parity for one: a clear error in the log and the disk snapshot used instead, the same losses;
  without a disk snapshot, a clear error and no training from a wrong state.
"""

import os
import signal

import pytest

from hf_dtrain.testing import stop_snapshot_processes
from hf_dtrain.testing.fault import failed_outputs
from hf_dtrain.testing.fault import kill_snapshot_process as _kill_smp
from hf_dtrain.testing.fault import launch_ft_workers as _launch
from hf_dtrain.testing.fault import worker_losses as _losses

pytestmark = pytest.mark.slow

WORLD = 3


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("reference"))
    assert _launch(WORLD, {"FT_OUT": out, "FT_NOFT": "1"}) == [0] * WORLD
    return _losses(out)


def _run(tmp_path, fault: str, kill_smps=(), persist_every=0, expect_first_codes=None):
    out, ft_dir = str(tmp_path / "out"), str(tmp_path / "ft")
    os.makedirs(out)
    env = {"FT_OUT": out, "FT_DIR": ft_dir, "FT_FAULT": fault, "FT_SHUTDOWN": "1"}
    if persist_every:
        env.update(FT_PERSIST=str(tmp_path / "disk"), FT_PERSIST_EVERY=str(persist_every))
    try:
        codes = _launch(WORLD, env)
        assert any(c == -signal.SIGKILL for c in codes), codes  # the fault happened
        for node in kill_smps:
            _kill_smp(ft_dir, node)
        env.pop("FT_FAULT")
        codes = _launch(WORLD, env)
        return out, codes
    finally:
        stop_snapshot_processes(ft_dir)


@pytest.mark.parametrize("fault", ["1:5:before_step", "2:4:mid_snapshot"])
def test_killed_trainer_resumes_exactly_from_the_snapshot_processes(tmp_path, reference, fault):
    out, codes = _run(tmp_path, fault)
    assert codes == [0] * WORLD, failed_outputs(out, codes)
    restored = open(os.path.join(out, "rank0.restore")).read().split()[:2]
    expected = {"1:5:before_step": 4, "2:4:mid_snapshot": 3}[fault]  # the last step every rank committed
    assert restored == [str(expected), "memory"]
    assert _losses(out) == reference  # every step, bit for bit (float.hex)


def test_lost_node_is_rebuilt_from_parity(tmp_path, reference):
    out, codes = _run(tmp_path, "1:4:after_snapshot", kill_smps=[1])
    assert codes == [0] * WORLD, failed_outputs(out, codes)
    step, source = open(os.path.join(out, "rank1.restore")).read().split()[:2]
    assert source == "parity" and int(step) >= 3
    assert "rebuilt" in open(os.path.join(tmp_path / "ft", "node1", "smp.log")).read()
    assert _losses(out) == reference


def test_more_lost_nodes_than_parity_is_a_clear_error_then_the_disk_copy(tmp_path, reference):
    """Two of three nodes lost with parity 1: relaunched without a disk copy configured, every rank refuses with a
    clear error (none trains from a wrong state); relaunched with it, the run resumes from disk, exactly."""
    out, ft_dir, disk = str(tmp_path / "out"), str(tmp_path / "ft"), str(tmp_path / "disk")
    os.makedirs(out)
    env = {"FT_OUT": out, "FT_DIR": ft_dir, "FT_FAULT": "1:5:after_snapshot", "FT_SHUTDOWN": "1",
           "FT_PERSIST": disk, "FT_PERSIST_EVERY": "2"}
    try:
        codes = _launch(WORLD, env)
        assert any(c == -signal.SIGKILL for c in codes), codes
        for node in (1, 2):
            _kill_smp(ft_dir, node)
        env.pop("FT_FAULT")
        no_disk = {k: v for k, v in env.items() if not k.startswith("FT_PERSIST")}
        codes = _launch(WORLD, no_disk)
        assert all(c == 3 for c in codes), codes  # every rank refuses
        error = open(os.path.join(out, "rank0.error")).read()
        assert "SnapshotError" in error and "none can be restored" in error and "persist_dir" in error
        assert "2 nodes of erasure group [0, 1, 2] are lost" in open(os.path.join(out, "rank1.error")).read()
        assert not os.path.exists(os.path.join(out, "rank0.restore"))
        codes = _launch(WORLD, env)
        assert codes == [0] * WORLD, failed_outputs(out, codes)
        assert open(os.path.join(out, "rank0.restore")).read().split()[:2] == ["4", "disk"]
        assert "2 nodes of erasure group [0, 1, 2] are lost" in open(os.path.join(out, "rank1.out")).read()
        assert _losses(out) == reference
    finally:
        stop_snapshot_processes(ft_dir)
