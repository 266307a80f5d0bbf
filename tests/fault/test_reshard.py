"""Restore onto another world size (FSDP2, gloo, one emulated node per rank): every 4th snapshot is also persisted
as a ``torch.distributed.checkpoint`` checkpoint in DCP's safetensors layout. A 4-rank run loses two nodes for good;
the job restarts on 2 ranks, which reshard the newest persisted snapshot (the in-memory ones of the survivors were
taken on 4 ranks and cannot load), train on and persist; then it restarts on 3 ranks. After each restore the whole
model and optimizer state (gathered from the shards) equals, bit for bit, the state the previous world size had at
that step. A restart with another model is refused on every rank, naming what differs."""

import os

import pytest
from safetensors.torch import load_file

from hf_dtrain.testing import stop_snapshot_processes
from hf_dtrain.testing.fault import kill_snapshot_process, launch_ft_workers, tensors_differ

pytestmark = pytest.mark.slow


def _equal(a: str, b: str) -> None:
    x, y = load_file(a), load_file(b)
    assert any(k.startswith("optim.state.") and k.endswith("exp_avg_sq") for k in x)  # the optimizer's state too
    bad = tensors_differ(x, y)
    assert not bad, bad[:5]


@pytest.mark.resume_cell("full training", "FSDP2, plain loop", "another world size")
def test_restart_on_fewer_then_more_ranks_reshards_the_persisted_snapshot(tmp_path):
    out, ft_dir, disk, dump = (str(tmp_path / n) for n in ("out", "ft", "disk", "dump"))
    os.makedirs(out)
    env = {
        "FT_ENGINE": "fsdp2",
        "FT_OUT": out,
        "FT_DIR": ft_dir,
        "FT_PERSIST": disk,
        "FT_PERSIST_EVERY": "4",
        "FT_DUMP": dump,
        "FT_SHUTDOWN": "0",
    }

    def log(rank=0):
        return open(os.path.join(out, f"rank{rank}.out")).read()[-3000:]

    try:
        assert launch_ft_workers(4, {**env, "FT_STEPS": "8"}) == [0] * 4, log()
        assert sorted(os.listdir(os.path.join(disk, "snapshot-8", "dcp"))) == [
            f"shard-0000{r}-model-00001-of-00001.safetensors" for r in range(1, 5)
        ]  # each rank its own shards
        for node in (2, 3):  # two nodes lost for good
            kill_snapshot_process(ft_dir, node)

        # another model: refused on every rank, naming the difference; nothing is trained
        assert launch_ft_workers(2, {**env, "FT_STEPS": "12", "FT_HIDDEN": "32"}) == [3, 3], log()
        for r in range(2):
            error = open(os.path.join(out, f"rank{r}.error")).read()
            assert "SnapshotMismatch" in error and "model_config" in error, error
            os.unlink(os.path.join(out, f"rank{r}.error"))

        assert launch_ft_workers(2, {**env, "FT_STEPS": "12"}) == [0, 0], log()
        assert open(os.path.join(out, "rank1.restore")).read().split()[:2] == ["8", "resharded"]
        _equal(os.path.join(dump, "w4-step8.safetensors"), os.path.join(dump, "w2-step8.safetensors"))

        kill_snapshot_process(ft_dir, 1)
        assert launch_ft_workers(3, {**env, "FT_STEPS": "14"}) == [0, 0, 0], log()
        assert open(os.path.join(out, "rank2.restore")).read().split()[:2] == ["12", "resharded"]
        _equal(os.path.join(dump, "w2-step12.safetensors"), os.path.join(dump, "w3-step12.safetensors"))
        assert os.path.exists(os.path.join(dump, "w3-step14.safetensors"))  # and it trained on

        # on 4 ranks, the 3 nodes' snapshot processes all alive: step 14 (persisted last at 12) from their copies
        assert launch_ft_workers(4, {**env, "FT_STEPS": "15"}) == [0] * 4, log()
        assert open(os.path.join(out, "rank3.restore")).read().split()[:2] == ["14", "memory-resharded"]
        _equal(os.path.join(dump, "w3-step14.safetensors"), os.path.join(dump, "w4-step14.safetensors"))
        assert not any(n.startswith("memory-") for n in os.listdir(disk))  # the exchange copy is gone
    finally:
        stop_snapshot_processes(ft_dir)


def test_a_replicated_model_round_trips_and_a_mismatch_is_named(tmp_path):
    """One process, a plain (replicated, as under DDP) model: a snapshot's state written as the DCP copy loads into a
    fresh model and optimizer exactly; into a model of another shape, ``differences`` names every tensor that does
    not map."""
    import torch

    from hf_dtrain.fault import reshard
    from hf_dtrain.testing import random_batch, tiny_llama

    def build(hidden=64):
        model = tiny_llama(seed=1, hidden_size=hidden)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    model, opt = build()
    for s in range(2):
        model(**random_batch(seed=s)).loss.backward()
        opt.step()
        opt.zero_grad()
    state = {
        "model": {n: p.detach() for n, p in model.named_parameters()},
        "optimizer": opt.state_dict(),
        "rng": {"torch": torch.get_rng_state()},
        "extra": {"next_step": 3},
    }
    sharded, replicated = reshard.ShardMap(state["model"], model, opt).split(state)
    directory = str(tmp_path / "dcp")
    reshard.save(directory, sharded)
    assert oct(os.stat(directory).st_mode & 0o777) == "0o700"
    assert all(os.stat(os.path.join(directory, f)).st_mode & 0o077 == 0 for f in os.listdir(directory))

    fresh, fresh_opt = build()
    keys = sorted(sharded["model"])
    target, osd = reshard.template(fresh, fresh_opt, keys)
    assert reshard.differences(target, directory, keys) == []
    reshard.load(fresh, fresh_opt, directory, target, osd, replicated)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))
    mine, theirs = opt.state_dict(), fresh_opt.state_dict()
    assert all(torch.equal(v, theirs["state"][i][k]) for i, st in mine["state"].items() for k, v in st.items())
    assert mine["param_groups"] == theirs["param_groups"]

    other, other_opt = build(hidden=32)
    target, _ = reshard.template(other, other_opt, keys)
    problems = reshard.differences(target, directory, keys)
    assert any(
        "model.model.embed_tokens.weight: shape (128, 64) in the snapshot, (128, 32) here" in p for p in problems
    ), problems


@pytest.mark.resume_cell("full training", "DDP, plain loop", "another world size")
def test_a_ddp_run_restarted_on_more_ranks_reshards_the_snapshot_processes_copies_losing_no_step(tmp_path):
    """DDP replicas, 2 ranks, every 4th snapshot persisted, 10 steps; restarted on 3 ranks, the in-memory snapshots
    (taken on 2) cannot load rank by rank, but the snapshot processes hold both old ranks' snapshots of step 10: they
    are written once as a DCP checkpoint and resharded, so the run resumes at step 10, not at the persisted step 8.
    The gathered model and optimizer state equal the 2-rank run's at step 10 bit for bit, and training goes on."""
    out, ft_dir, disk, dump = (str(tmp_path / n) for n in ("out", "ft", "disk", "dump"))
    os.makedirs(out)
    env = {
        "FT_ENGINE": "ddp",
        "FT_OUT": out,
        "FT_DIR": ft_dir,
        "FT_PERSIST": disk,
        "FT_PERSIST_EVERY": "4",
        "FT_DUMP": dump,
        "FT_SHUTDOWN": "0",
    }
    try:
        assert launch_ft_workers(2, {**env, "FT_STEPS": "10"}) == [0, 0]  # its state at step 10 dumped at the end
        codes = launch_ft_workers(3, {**env, "FT_STEPS": "12"})
        assert codes == [0, 0, 0], open(os.path.join(out, "rank0.out")).read()[-3000:]
        for r in range(3):
            assert open(os.path.join(out, f"rank{r}.restore")).read().split()[:2] == ["10", "memory-resharded"]
        _equal(os.path.join(dump, "w2-step10.safetensors"), os.path.join(dump, "w3-step10.safetensors"))
        assert os.path.exists(os.path.join(dump, "w3-step12.safetensors"))  # and it trained on
    finally:
        stop_snapshot_processes(ft_dir)


def test_a_rank_that_cannot_write_the_survivors_copy_makes_every_rank_fall_back_to_the_persisted_one(tmp_path):
    """The survivors' snapshots are written as a DCP checkpoint by several ranks between two barriers: when one rank's
    write fails (here: a full disk on rank 1), that is its vote, not an exception that leaves the others waiting in
    the collective; every rank restores the persisted DCP copy of step 8 instead and names why."""
    out, ft_dir, disk = (str(tmp_path / n) for n in ("out", "ft", "disk"))
    os.makedirs(out)
    env = {
        "FT_ENGINE": "ddp",
        "FT_OUT": out,
        "FT_DIR": ft_dir,
        "FT_PERSIST": disk,
        "FT_PERSIST_EVERY": "4",
        "FT_SHUTDOWN": "0",
    }
    try:
        assert launch_ft_workers(2, {**env, "FT_STEPS": "10"}) == [0, 0]
        codes = launch_ft_workers(3, {**env, "FT_STEPS": "10", "FT_BREAK_CHUNKS": "1"})
        assert codes == [0, 0, 0], open(os.path.join(out, "rank0.out")).read()[-3000:]
        for r in range(3):
            assert open(os.path.join(out, f"rank{r}.restore")).read().split()[:2] == ["8", "resharded"]
        assert (
            "could not be written as a DCP file (OSError: [Errno 28] No space left on device (injected))"
            in open(os.path.join(out, "rank1.out")).read()
        )
    finally:
        stop_snapshot_processes(ft_dir)
