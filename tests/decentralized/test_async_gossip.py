"""Asynchronous gossip (AD-PSGD style) on 2 gloo ranks, rank 1 slowed down: the fast ranks run ahead instead of
waiting for every round, the staleness of every value they mix stays within the bound (and the bound is really
exercised: they do wait when the straggler's value gets too old), close() drains every message so all ranks exit,
and DPSGD / DecentLaM train with it."""

import time

import pytest
import torch

from hf_dtrain.testing import run_distributed, tiny_llama, train_steps

STEPS, SLOW_S, BOUND, SLOW = 24, 0.06, 3, 1


def _engine_rank(rank, world):
    from hf_dtrain.decentralized import Topology
    from hf_dtrain.decentralized.gossip import AsyncGossip

    eng = AsyncGossip(1000, Topology.ring(world), max_staleness=BOUND)
    x = torch.full((1000,), float(rank))
    seen = []
    for _step in range(STEPS):
        if rank == SLOW:
            time.sleep(SLOW_S)
        x = eng.mix(x)
        # every running neighbour's newest value arrived at most BOUND of this rank's steps ago (one that finished
        # training keeps its last value)
        with eng._cond:
            seen.append(max([eng.step - eng.fresh_at[j] for j in eng.ins if not eng.done[j]], default=0))
        assert all(eng.latest[j] is not None for j in eng.ins)
    eng.close()
    assert max(seen) <= BOUND and eng.max_seen_staleness <= BOUND, seen
    if rank != SLOW:
        # the mechanism, not the clock: a fast rank ran ahead of the straggler on stale values (a synchronous round
        # never does) as far as the bound allows, and no further (checked above)
        assert max(seen) == BOUND, seen
    # the averages moved toward each other (gossip happened) and stayed finite
    assert torch.isfinite(x).all() and 0.0 < float(x[0]) < 1.0


def _optimizers_rank(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_dtrain.decentralized import DPSGD, DecentLaM

    for build in (
        lambda p: DPSGD(p, topology="ring", lr=0.05, momentum=0.9, asynchronous=True, max_staleness=2),
        lambda p: DecentLaM(p, lr=0.05, topology="ring", asynchronous=True, max_staleness=2),
    ):
        ddp = DDP(tiny_llama(seed=0), broadcast_buffers=False)
        DPSGD.attach_ddp(ddp)
        opt = build(ddp.parameters())
        losses = train_steps(ddp, 8, batch_seed=lambda s: 0, optimizer=opt)
        opt.finish()
        assert losses[-1] < losses[0], losses
        assert opt.stats.steps and max(opt.stats.steps) > 0


def _rank(rank, world):
    _engine_rank(rank, world)
    _optimizers_rank(rank, world)


def test_async_gossip_bounded_staleness_fast_rank_runs_ahead_and_optimizers_train():
    run_distributed(_rank, world_size=2, timeout=180)


def test_async_gossip_refuses_time_varying_graphs_and_bad_bounds():
    from hf_dtrain.decentralized import Topology
    from hf_dtrain.decentralized.gossip import AsyncGossip

    with pytest.raises(ValueError, match="max_staleness must be an integer >= 1"):
        AsyncGossip(10, Topology.ring(3), max_staleness=0)
    with pytest.raises(ValueError, match="needs a static topology"):
        AsyncGossip(10, Topology.named("matcha", 4, base="ring"), max_staleness=2)
