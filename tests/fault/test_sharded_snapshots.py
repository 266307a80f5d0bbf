"""In-memory snapshots of FSDP2-sharded training, 3 gloo ranks, one emulated node each with its own snapshot
process: each rank snapshots its own shards of the parameters and the AdamW state (plus the scheduler and RNGs), and
after each failure the run resumes with every step's loss equal (``float.hex``) to the uninterrupted FSDP2 run:

* a trainer SIGKILLed before its optimizer step, or in the middle of a snapshot (written, not committed): restored
  from the snapshot processes;
* a whole node lost (its trainer and its snapshot process): its shards rebuilt from the other nodes' parity;
* two nodes lost with parity for one: the persisted disk copy (every 2nd snapshot) is used.
"""

import os
import signal

import pytest

from hf_dtrain.testing import stop_snapshot_processes
from hf_dtrain.testing.fault import kill_snapshot_process, launch_ft_workers, worker_losses

pytestmark = pytest.mark.slow

WORLD = 3
FSDP2 = {"FT_ENGINE": "fsdp2"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("reference"))
    assert launch_ft_workers(WORLD, {**FSDP2, "FT_OUT": out, "FT_NOFT": "1"}) == [0] * WORLD
    return [worker_losses(out, r) for r in range(WORLD)]


@pytest.mark.parametrize("fault, lost_nodes, source", [("1:5:before_step", (), "memory"),
                                                       ("2:4:mid_snapshot", (), "memory"),
                                                       ("1:4:after_snapshot", (1,), "parity"),
                                                       ("1:5:after_snapshot", (1, 2), "disk")])
def test_sharded_run_resumes_exactly(tmp_path, reference, fault, lost_nodes, source):
    out, ft_dir = str(tmp_path / "out"), str(tmp_path / "ft")
    os.makedirs(out)
    env = {**FSDP2, "FT_OUT": out, "FT_DIR": ft_dir, "FT_FAULT": fault, "FT_SHUTDOWN": "1"}
    if source == "disk":
        env.update(FT_PERSIST=str(tmp_path / "disk"), FT_PERSIST_EVERY="2")
    try:
        codes = launch_ft_workers(WORLD, env)
        assert any(c == -signal.SIGKILL for c in codes), codes  # the fault happened
        for node in lost_nodes:
            kill_snapshot_process(ft_dir, node)
        env.pop("FT_FAULT")
        codes = launch_ft_workers(WORLD, env)
        assert codes == [0] * WORLD, open(os.path.join(out, "rank1.out")).read()[-3000:]
    finally:
        stop_snapshot_processes(ft_dir)
    restored = open(os.path.join(out, "rank1.restore")).read().split()[:2]
    expected = {"memory": 3, "parity": 3, "disk": 4}[source]  # the newest step every rank can load, at least
    assert restored[1] == source and int(restored[0]) >= expected, restored
    if fault == "2:4:mid_snapshot":
        assert restored[0] == "3"  # step 4 was written on rank 2 but never committed
    if source == "disk":
        assert restored[0] == "4"
        assert "2 nodes of erasure group [0, 1, 2] are lost" in open(os.path.join(out, "rank1.out")).read()
    assert [worker_losses(out, r) for r in range(WORLD)] == reference  # every step of every rank, bit for bit
