"""In-memory snapshots of DeepSpeed ZeRO training (DeepSpeed's CPU accelerator, gloo, one emulated node per rank):
each rank snapshots its own ZeRO partitions (the fp32 master partitions DeepSpeed keeps apart from the model, the
AdamW state on them, its 16-bit partitions or flat groups, the engine's counters) plus the scheduler, RNGs and data
position, and after each failure the run resumes with every step's loss equal (``float.hex``) to the uninterrupted
ZeRO run:

* ZeRO-3, 3 ranks: a trainer SIGKILLed before its step, or mid-snapshot, restored from memory; a lost node rebuilt
  from parity; two lost nodes with parity 1 from the disk copy;
* ZeRO-2, 2 ranks: a trainer SIGKILLed before its step.
"""

import os
import signal

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is in the test extra; install hf-dtrain[test]")

from hf_dtrain.testing import stop_snapshot_processes  # noqa: E402
from hf_dtrain.testing.fault import kill_snapshot_process, launch_ft_workers, worker_losses  # noqa: E402

pytestmark = pytest.mark.slow

CASES = [("zero3", 3, "1:5:before_step", (), "memory"), ("zero3", 3, "2:4:mid_snapshot", (), "memory"),
         ("zero3", 3, "1:4:after_snapshot", (1,), "parity"), ("zero3", 3, "1:5:after_snapshot", (1, 2), "disk"),
         ("zero2", 2, "1:5:before_step", (), "memory")]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cache = {}

    def get(kind, world):
        if (kind, world) not in cache:
            out = str(tmp_path_factory.mktemp(f"reference_{kind}"))
            env = {"FT_ENGINE": kind, "DS_ACCELERATOR": "cpu", "FT_OUT": out, "FT_NOFT": "1"}
            assert launch_ft_workers(world, env) == [0] * world, open(os.path.join(out, "rank0.out")).read()[-3000:]
            cache[kind, world] = [worker_losses(out, r) for r in range(world)]
        return cache[kind, world]

    return get


@pytest.mark.parametrize("kind, world, fault, lost_nodes, source", CASES)
def test_zero_run_resumes_exactly(tmp_path, references, kind, world, fault, lost_nodes, source):
    reference = references(kind, world)
    out, ft_dir = str(tmp_path / "out"), str(tmp_path / "ft")
    os.makedirs(out)
    env = {"FT_ENGINE": kind, "DS_ACCELERATOR": "cpu", "FT_OUT": out, "FT_DIR": ft_dir, "FT_FAULT": fault,
           "FT_SHUTDOWN": "1"}
    if source == "disk":
        env.update(FT_PERSIST=str(tmp_path / "disk"), FT_PERSIST_EVERY="2")
    try:
        codes = launch_ft_workers(world, env)
        assert any(c == -signal.SIGKILL for c in codes), (codes, open(os.path.join(out, "rank0.out")).read()[-3000:])
        for node in lost_nodes:
            kill_snapshot_process(ft_dir, node)
        env.pop("FT_FAULT")
        codes = launch_ft_workers(world, env)
        assert codes == [0] * world, open(os.path.join(out, "rank1.out")).read()[-3000:]
    finally:
        stop_snapshot_processes(ft_dir)
    restored = open(os.path.join(out, "rank1.restore")).read().split()[:2]
    assert restored[1] == source and int(restored[0]) >= 3, restored
    if fault.endswith("mid_snapshot"):
        assert restored[0] == "3"  # step 4 was written on rank 2 but never committed
    if source == "disk":
        assert restored[0] == "4"
    assert [worker_losses(out, r) for r in range(world)] == reference  # every step of every rank, bit for bit
