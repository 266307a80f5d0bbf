"""Fault injection (after torchft's injector), 3 gloo ranks, one emulated node each with its own snapshot process:

* DDP through every failure in turn (``FAILURE_CHAIN``), all ranks relaunched as an elastic agent would after each:
  a trainer SIGKILLed before its optimizer step and one in the middle of a snapshot (written, not committed), both
  resumed from the snapshot processes; a node lost (its trainer and its snapshot process), rebuilt from the peers'
  parity; two nodes lost with parity for one, resumed from the disk copy. Each restore from the source and step
  its failure leaves, and all 36 losses (3 ranks, 12 steps) bit for bit, the first step after each restore
  included (DDP's buckets are rebuilt before it);
* a node lost at the worst moment (right after its snapshot, every parity exchange held back): still rebuilt from
  parity, the same losses;
* two nodes lost without a disk copy configured: a clear error on every rank and no training from a wrong state.
"""

import os
import signal

import pytest

from hf_dtrain.testing import stop_snapshot_processes
from hf_dtrain.testing.fault import (
    FAILURE_CHAIN_STEPS,
    check_failure_chain,
    failed_outputs,
    run_failure_chain,
    worker_final_state_differs,
)
from hf_dtrain.testing.fault import kill_snapshot_process as _kill_smp
from hf_dtrain.testing.fault import launch_ft_workers as _launch
from hf_dtrain.testing.fault import worker_losses as _losses

pytestmark = pytest.mark.slow

WORLD = 3


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    """The uninterrupted run over the chain's 12 steps (a shorter run's losses are its first steps)."""
    out = str(tmp_path_factory.mktemp("reference"))
    assert _launch(WORLD, {"FT_OUT": out, "FT_NOFT": "1", "FT_STEPS": str(FAILURE_CHAIN_STEPS)}) == [0] * WORLD
    return out


@pytest.fixture(scope="module")
def references(reference_dir):
    """Every rank's losses of the uninterrupted run."""
    return [_losses(reference_dir, r) for r in range(WORLD)]


@pytest.fixture(scope="module")
def reference(references):
    """Rank 0's losses of the uninterrupted run over the worker's default 8 steps."""
    return {step: loss for step, loss in references[0].items() if step <= 8}


def _run(tmp_path, fault: str, kill_smps=(), persist_every=0, expect_first_codes=None, extra_env=None):
    out, ft_dir = str(tmp_path / "out"), str(tmp_path / "ft")
    os.makedirs(out)
    env = {"FT_OUT": out, "FT_DIR": ft_dir, "FT_FAULT": fault, "FT_SHUTDOWN": "1", **(extra_env or {})}
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


def test_lost_node_is_rebuilt_from_parity_even_right_after_its_snapshot_while_the_exchange_lags(tmp_path, reference):
    """A lost node (its trainer and snapshot process killed at once) is rebuilt from the peers' parity, checksums
    verified, at the worst moment: every parity exchange held back 0.6 s (a loaded host; the test model's steps take a
    fraction of that), node 1 lost right after its step-7 snapshot: a step whose snapshots and parity every survivor
    holds still exists (a snapshot slot is reused only once the previous step's parity is complete at every holder), so
    node 1 is rebuilt from parity and every loss equals the uninterrupted run's."""
    out, codes = _run(tmp_path, "1:7:node_lost", extra_env={"HF_DTRAIN_FT_EXCHANGE_DELAY": "0.6"})
    assert codes == [0] * WORLD, failed_outputs(out, codes)
    step, source = open(os.path.join(out, "rank1.restore")).read().split()[:2]
    assert source == "parity" and 5 <= int(step) <= 7
    assert "rebuilt" in open(tmp_path / "ft" / "node1" / "smp.log").read()
    assert _losses(out) == reference
    for node in range(WORLD):  # after the restore every step's parity completed everywhere: no slot reused early
        assert "not complete at every holder" not in open(tmp_path / "ft" / f"node{node}" / "smp.log").read()


def test_more_lost_nodes_than_parity_without_a_disk_copy_is_a_clear_error(tmp_path, reference):
    """Two of three nodes lost with parity 1, relaunched without a disk copy configured: every rank refuses with a
    clear error and none trains from a wrong state. (With the disk copy configured the run resumes from it, exactly:
    the last failure of the chain below.)"""
    out, ft_dir, disk = str(tmp_path / "out"), str(tmp_path / "ft"), str(tmp_path / "disk")
    os.makedirs(out)
    env = {
        "FT_OUT": out,
        "FT_DIR": ft_dir,
        "FT_FAULT": "1:5:after_snapshot",
        "FT_SHUTDOWN": "1",
        "FT_PERSIST": disk,
        "FT_PERSIST_EVERY": "2",
    }
    try:
        codes = _launch(WORLD, env)
        assert any(c == -signal.SIGKILL for c in codes), codes
        for node in (1, 2):
            _kill_smp(ft_dir, node)
        env.pop("FT_FAULT")
        no_disk = {k: v for k, v in env.items() if not k.startswith("FT_PERSIST")}
        codes = _launch(WORLD, no_disk)
        assert all(c == 3 for c in codes), failed_outputs(out, codes)  # every rank refuses
        error = open(os.path.join(out, "rank0.error")).read()
        assert "SnapshotError" in error and "none can be restored" in error and "persist_dir" in error
        assert "2 nodes of erasure group [0, 1, 2] are lost" in open(os.path.join(out, "rank1.error")).read()
        assert not os.path.exists(os.path.join(out, "rank0.restore"))
        assert _losses(out) == {s: l for s, l in reference.items() if s <= 5}  # no step ran after the refusal
    finally:
        stop_snapshot_processes(ft_dir)


@pytest.mark.resume_cell("full training", "DDP, plain loop", "memory", "parity", "disk")
def test_ddp_chain_is_bit_for_bit_at_every_step(tmp_path, references, reference_dir):
    """Every step of every rank equal to the uninterrupted DDP run's, through a killed trainer, a mid-snapshot kill,
    a lost node (parity) and two lost nodes (disk): without the bucket rebuild after a restore, the first step after
    it reduces in DDP's initial buckets and some losses differ in the last bit."""
    out = str(tmp_path / "out")
    os.makedirs(out)
    check_failure_chain(run_failure_chain(WORLD, {"FT_OUT": out, "FT_ENGINE": "ddp"}, str(tmp_path / "ft")))
    got = [_losses(out, r) for r in range(WORLD)]
    assert sum(len(g) for g in got) == WORLD * FAILURE_CHAIN_STEPS == 36
    assert got == references
    assert not worker_final_state_differs(reference_dir, out)  # every rank's weights and AdamW state at the end
