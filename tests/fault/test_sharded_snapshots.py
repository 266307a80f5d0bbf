"""In-memory snapshots of FSDP2-sharded training, 3 gloo ranks, one emulated node each with its own snapshot
process: each rank snapshots its own shards of the parameters and the AdamW state (plus the scheduler and RNGs).
One run goes through every failure in turn (``hf_dtrain.testing.fault.FAILURE_CHAIN``), relaunched after each:

* a trainer SIGKILLed before its optimizer step, then one in the middle of a snapshot (written, not committed):
  restored from the snapshot processes;
* a whole node lost (its trainer and its snapshot process): its shards rebuilt from the other nodes' parity;
* two nodes lost with parity for one: the persisted disk copy (every 2nd snapshot) is used.

Each relaunch restores from the source its failure leaves, and every step's loss of every rank equals
(``float.hex``) the uninterrupted FSDP2 run's.
"""

import os

import pytest

from hf_dtrain.testing.fault import (
    FAILURE_CHAIN_STEPS,
    check_failure_chain,
    launch_ft_workers,
    run_failure_chain,
    worker_final_state_differs,
    worker_losses,
)

pytestmark = pytest.mark.slow

WORLD = 3


@pytest.mark.resume_cell("full training", "FSDP2, plain loop", "memory", "parity", "disk")
def test_sharded_run_resumes_exactly_after_each_failure(tmp_path):
    ref, out = str(tmp_path / "ref"), str(tmp_path / "out")
    os.makedirs(out)
    os.makedirs(ref)
    env = {"FT_ENGINE": "fsdp2", "FT_STEPS": str(FAILURE_CHAIN_STEPS)}
    assert launch_ft_workers(WORLD, {**env, "FT_OUT": ref, "FT_NOFT": "1"}) == [0] * WORLD
    check_failure_chain(run_failure_chain(WORLD, {**env, "FT_OUT": out}, str(tmp_path / "ft")))
    assert "2 nodes of erasure group [0, 1, 2] are lost" in open(os.path.join(out, "rank1.out")).read()
    assert [worker_losses(out, r) for r in range(WORLD)] == [worker_losses(ref, r) for r in range(WORLD)]
    assert not worker_final_state_differs(ref, out)  # every rank's shards of the weights and AdamW state at the end
