"""Topologies: doubly stochastic mixing matrices, connectivity, gossip that keeps the average and reaches consensus
on real gloo ranks, and clear errors for bad graphs, bad weights and a world of one."""

import networkx as nx
import pytest
import torch

from hf_dtrain.decentralized import MatchaTopology, Topology
from hf_dtrain.testing import run_distributed

NAMES = ["ring", "torus", "exponential", "fully_connected"]


@pytest.mark.parametrize("n", [2, 3, 4, 6, 8, 9])
@pytest.mark.parametrize("name", NAMES + ["matcha"])
def test_mixing_matrices_are_doubly_stochastic_and_connected(name, n):
    topo = Topology.named(name, n)
    for step in range(6 if name == "matcha" else 1):
        w = topo.mixing(step)
        assert (w >= 0).all()
        torch.testing.assert_close(w.sum(0), torch.ones(n, dtype=torch.float64), atol=1e-12, rtol=0)
        torch.testing.assert_close(w.sum(1), torch.ones(n, dtype=torch.float64), atol=1e-12, rtol=0)
        # neighbour lists agree with the matrix
        for i in range(n):
            assert topo.in_neighbors(i, step) == [j for j in range(n) if j != i and w[i, j] > 0]
    # gossip contracts towards the average: the static graph is connected (MATCHA: its expected graph is, although a
    # single step's matchings may not be)
    assert topo.spectral_gap() > 1e-3


def test_matcha_matchings_cover_the_base_graph_and_follow_the_budget():
    base = Topology.torus(8)
    topo = MatchaTopology(base, budget=0.5, seed=3)
    edges = {e for m in topo.matchings for e in m}
    base_edges = {(i, j) for i in range(8) for j in range(i + 1, 8) if base.weights[i, j] > 0}
    assert edges == base_edges
    for m in topo.matchings:  # a matching: no rank twice
        ranks = [r for e in m for r in e]
        assert len(ranks) == len(set(ranks))
    active = [len(topo.active_matchings(t)) / len(topo.matchings) for t in range(400)]
    assert abs(sum(active) / len(active) - 0.5) < 0.06  # the expected share of matchings per step is the budget
    assert topo.active_matchings(7) == MatchaTopology(base, budget=0.5, seed=3).active_matchings(7)  # same on all


def test_bad_graphs_and_weights_are_clear_errors():
    two_parts = nx.Graph([(0, 1), (2, 3)])
    with pytest.raises(ValueError, match=r"not connected \(components \[\[0, 1\], \[2, 3\]\]\)"):
        Topology.from_graph(two_parts)
    with pytest.raises(ValueError, match=r"must be doubly stochastic .*; rows \[0, 1\] sum to \[1.2, 0.8\]\. Use"):
        Topology(torch.tensor([[0.7, 0.5], [0.3, 0.5]]))
    with pytest.raises(ValueError, match=r"; columns \[0, 1\] sum to \[0.9, 1.1\]\. Use"):
        Topology(torch.tensor([[0.5, 0.5], [0.4, 0.6]]))
    with pytest.raises(ValueError, match=r"not connected"):
        Topology(torch.eye(3))
    with pytest.raises(ValueError, match=r">= 0"):
        Topology(torch.tensor([[1.5, -0.5], [-0.5, 1.5]]))
    with pytest.raises(ValueError, match=r"n >= 2 ranks .*world size 1"):
        Topology.ring(1)
    with pytest.raises(ValueError, match=r"budget must be in \(0, 1\]"):
        MatchaTopology(Topology.ring(4), budget=0)
    with pytest.raises(ValueError, match=r"Unknown topology 'star'"):
        Topology.named("star", 4)


def test_world_size_one_is_a_clear_error():
    from hf_dtrain.decentralized import DPSGD

    with pytest.raises(ValueError, match=r"world size 1 has nobody to gossip with"):
        DPSGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)


def _gossip_rank(rank, world):
    from hf_dtrain.decentralized.gossip import consensus_distance, gossip
    from hf_dtrain.distributed.counters import WireStats

    gen = torch.Generator().manual_seed(rank)
    for name in NAMES + ["matcha"]:
        topo = Topology.named(name, world)
        x = torch.randn(50, generator=gen, dtype=torch.float64)
        total = x.clone()
        torch.distributed.all_reduce(total)
        stats = WireStats()
        dist0 = consensus_distance([x])
        for step in range(60):
            x = gossip(x, topo, step, stats=stats)
            s = x.clone()
            torch.distributed.all_reduce(s)
            torch.testing.assert_close(s, total, atol=1e-10, rtol=0)  # the average is kept, every round
            stats.end_step()
        assert consensus_distance([x]) < 1e-3 * dist0, name  # and the ranks reach it
        # bytes: one message per out-edge (or the all-reduce payload on the complete graph)
        sent = stats.steps[0]
        expected = 50 * 8 * (1 if topo.is_uniform_complete(0) else len(topo.out_neighbors(rank, 0)))
        assert sent == expected, (name, sent, expected)


@pytest.mark.parametrize("world", [3, 4])
def test_gossip_keeps_the_average_and_reaches_consensus(world):
    run_distributed(_gossip_rank, world_size=world, timeout=180)


def _mismatch_rank(rank, world):
    from hf_dtrain.decentralized import DPSGD

    with pytest.raises(ValueError, match=r"topology has 4 nodes but the process group has 2 ranks"):
        DPSGD([torch.nn.Parameter(torch.zeros(3))], topology=Topology.ring(4), lr=0.1)


def test_topology_size_must_match_the_world():
    run_distributed(_mismatch_rank, world_size=2, timeout=120)
