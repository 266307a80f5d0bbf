"""A job's process group takes the job's collective timeout (``pretrain --process-group-timeout``, the Trainer's
``--ddp-timeout``): a rank that hangs without dying ends the run after it, not after torch's half hour, and the rank
monitor names it (alive, not in a collective, where its main thread is)."""

import multiprocessing as mp
import os
import re
import time

import pytest

from hf_dtrain.testing import free_port

pytestmark = pytest.mark.timeout(120)


def _rank(rank: int, port: int, out) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import torch.distributed as dist

    from hf_dtrain.jobs.pretrain.config import pretrain_config_class
    from hf_dtrain.run.job import JobRun

    cfg = pretrain_config_class().from_dict({"process_group_timeout": 3, "progress": False})
    run = JobRun(cfg, world_size=2)  # starts the process group as the job does
    if rank == 1:  # alive and silent: never joins the collective
        with run.guard(step_of=lambda: 7):  # the rank monitor, as the jobs run their loops
            time.sleep(60)
        return
    try:
        with run.guard(step_of=lambda: 7):
            dist.barrier()
        out.put("the barrier returned")
    except Exception as e:  # gloo's timeout, as the monitor says it
        out.put(f"{type(e).__name__}: {e}")


def test_a_hanging_rank_ends_the_run_after_the_jobs_timeout():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        said = out.get(timeout=90)  # with torch's default the barrier would wait 1800 s
    finally:
        for p in procs:
            p.kill()
    # the rank that hangs is named, alive, with where its main thread is
    assert said.startswith("RankFailure: hf_dtrain: rank 0 "), said
    assert re.search(
        r"rank 1 \(host .*, pid \d+, at step 7\) is alive but not in a collective: its main thread is "
        r"at test_process_group_timeout.py:\d+ in _rank",
        said,
    ), said


def test_the_timeout_is_checked():
    from hf_dtrain.jobs.pretrain.config import pretrain_config_class
    from hf_dtrain.settings import SettingsError

    with pytest.raises(SettingsError, match="process_group_timeout"):
        pretrain_config_class().from_dict({"process_group_timeout": 0})
