"""In-memory snapshots of DeepSpeed ZeRO training (DeepSpeed's CPU accelerator, gloo, one emulated node per rank):
each rank snapshots its own ZeRO partitions (the fp32 master partitions DeepSpeed keeps apart from the model, the
AdamW state on them, its 16-bit partitions or flat groups, the engine's counters) plus the scheduler, RNGs and data
position, and after each failure the run resumes with every step's loss equal (``float.hex``) to the uninterrupted
ZeRO run:

* ZeRO-3 and ZeRO-2, 3 ranks, one run each through every failure in turn (``hf_dtrain.testing.fault.FAILURE_CHAIN``):
  a trainer SIGKILLed before its step, one mid-snapshot, a lost node (parity), two lost nodes with parity 1 (the
  disk copy);
* ZeRO-1, 2 ranks: a trainer SIGKILLed before its step (ZeRO-1 runs ZeRO-2's optimizer class without partitioned
  gradients: its own test all the same).
"""

import os
import signal

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is in the test extra; install hf-dtrain[test]")

from hf_dtrain.testing import stop_snapshot_processes
from hf_dtrain.testing.fault import (
    FAILURE_CHAIN_STEPS,
    check_failure_chain,
    failed_outputs,
    launch_ft_workers,
    run_failure_chain,
    worker_final_state_differs,
    worker_losses,
)

pytestmark = pytest.mark.slow

DS = {"DS_ACCELERATOR": "cpu"}


def _reference(out: str, kind: str, world: int, steps: int) -> list[dict]:
    os.makedirs(out)
    env = {**DS, "FT_ENGINE": kind, "FT_OUT": out, "FT_NOFT": "1", "FT_STEPS": str(steps)}
    codes = launch_ft_workers(world, env)
    assert codes == [0] * world, failed_outputs(out, codes)
    return [worker_losses(out, r) for r in range(world)]


@pytest.mark.parametrize("stage", ["zero3", "zero2"])
@pytest.mark.resume_cell("full training", "ZeRO-3, ZeRO-2, your own loop", "memory", "parity", "disk")
def test_zero_resumes_exactly_after_each_failure(tmp_path, stage):
    out = str(tmp_path / "out")
    os.makedirs(out)
    reference = _reference(str(tmp_path / "ref"), stage, 3, FAILURE_CHAIN_STEPS)
    env = {**DS, "FT_ENGINE": stage, "FT_OUT": out}
    check_failure_chain(run_failure_chain(3, env, str(tmp_path / "ft")))
    assert [worker_losses(out, r) for r in range(3)] == reference
    # every rank's partitions at the end: the model's, DeepSpeed's fp32 masters, the AdamW state on them
    assert not worker_final_state_differs(str(tmp_path / "ref"), out)


@pytest.mark.resume_cell("full training", "ZeRO-1, your own loop", "memory")
def test_zero1_killed_trainer_resumes_exactly(tmp_path):
    stage = "zero1"
    out, ft_dir = str(tmp_path / "out"), str(tmp_path / "ft")
    os.makedirs(out)
    reference = _reference(str(tmp_path / "ref"), stage, 2, 8)
    env = {**DS, "FT_ENGINE": stage, "FT_OUT": out, "FT_DIR": ft_dir, "FT_FAULT": "1:5:before_step", "FT_SHUTDOWN": "1"}
    try:
        codes = launch_ft_workers(2, env)
        assert codes[1] == -signal.SIGKILL, codes
        env.pop("FT_FAULT")
        codes = launch_ft_workers(2, env)
        assert codes == [0, 0], failed_outputs(out, codes)
    finally:
        stop_snapshot_processes(ft_dir)
    assert open(os.path.join(out, "rank1.restore")).read().split()[:2] == ["4", "memory"]
    assert [worker_losses(out, r) for r in range(2)] == reference
    assert not worker_final_state_differs(str(tmp_path / "ref"), out)
