"""Decentralized optimizers on real gloo ranks: D-PSGD on a complete graph is all-reduce SGD; DecentLaM removes the
bias DmSGD has on a heterogeneous quadratic (measured); LSGD with coupling 0 is independent SGD and with coupling 1
copies the lowest-loss rank; AL-DSGD without its leader terms is D-PSGD on the same time-varying graph."""

import json

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_dtrain.testing import run_distributed, tiny_llama, train_steps


def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(ddp, opt, rank, steps):
    return train_steps(ddp, steps, batch_seed=lambda step: 10 * step + rank, optimizer=opt)


def _dpsgd_rank(rank, world):
    from hf_dtrain.decentralized import DPSGD, Topology

    reference = DDP(tiny_llama(seed=0))  # all-reduce SGD with momentum
    _train(reference, torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9), rank, 5)
    for name in ("fully_connected", "ring"):
        ddp = DDP(tiny_llama(seed=0))
        DPSGD.attach_ddp(ddp)  # gradients stay local
        opt = DPSGD(ddp.parameters(), topology=Topology.named(name, world), lr=0.05, momentum=0.9)
        _train(ddp, opt, rank, 5)
        if name == "fully_connected":
            torch.testing.assert_close(_params(ddp.module), _params(reference.module), atol=2e-6, rtol=1e-5)
            assert opt.consensus_distance() < 1e-6
            assert opt.stats.steps == [sum(p.numel() for p in ddp.parameters()) * 4] * 5  # one all-reduce payload
        else:  # a ring of 4 is not complete: close to all-reduce SGD, not equal, and the replicas differ
            assert not torch.allclose(_params(ddp.module), _params(reference.module), atol=1e-6)
            assert opt.consensus_distance() > 1e-6
            assert opt.stats.steps[-1] == 2 * sum(p.numel() for p in ddp.parameters()) * 4  # one message per neighbour


def test_dpsgd_on_a_complete_graph_equals_allreduce_sgd():
    run_distributed(_dpsgd_rank, world_size=4, timeout=300)


def _quadratic_rank(rank, world, out_dir, lr, beta, steps):
    """f_i(x) = 1/2 (x - b_i)ᵀ A_i (x - b_i) with b_i, A_i different per rank: the optimum of the sum is
    x* = (Σ A_i)⁻¹ Σ A_i b_i. Exact gradients, so what remains at the end is the method's bias."""
    from hf_dtrain.decentralized import DPSGD, DecentLaM

    d = 5
    gen = torch.Generator().manual_seed(0)  # the same draw on every rank: each takes its own row
    b = torch.randn(world, d, generator=gen, dtype=torch.float64) * 3
    a = torch.rand(world, d, generator=gen, dtype=torch.float64) + 0.5
    x_star = (a * b).sum(0) / a.sum(0)
    errors = {}
    for name in ("dmsgd", "decentlam"):
        x = torch.nn.Parameter(torch.zeros(d, dtype=torch.float64))
        if name == "dmsgd":  # D-PSGD with a local momentum, adapt then combine: DmSGD
            opt = DPSGD([x], topology="ring", lr=lr, momentum=beta)
        else:
            opt = DecentLaM([x], topology="ring", lr=lr, momentum=beta)
        for _ in range(steps):
            x.grad = a[rank] * (x.detach() - b[rank])
            opt.step()
        err = torch.tensor([float((x.detach() - x_star).norm())])
        torch.distributed.all_reduce(err, op=torch.distributed.ReduceOp.MAX)
        errors[name] = float(err)
    if rank == 0:
        json.dump(errors, open(f"{out_dir}/quadratic.json", "w"))


@pytest.mark.slow
def test_decentlam_removes_the_momentum_bias_of_dmsgd(tmp_path):
    run_distributed(_quadratic_rank, world_size=4, args=(str(tmp_path), 0.05, 0.9, 1500), timeout=300)
    errors = json.load(open(tmp_path / "quadratic.json"))
    print(errors)
    # measured: DmSGD ends 1.30 from the optimum (its bias), DecentLaM 0.145 (a 9x smaller bias)
    assert errors["dmsgd"] > 0.5
    assert errors["decentlam"] < errors["dmsgd"] / 5, errors


def _lsgd_rank(rank, world):
    from hf_dtrain.decentralized import LSGD

    ref = tiny_llama(seed=0)  # independent SGD on this rank's own batches, no communication at all
    ref_losses = _train(ref, torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9), rank, 6)
    ddp = DDP(tiny_llama(seed=0))
    LSGD.attach_ddp(ddp)
    opt = LSGD(
        ddp.parameters(),
        model=ddp,
        c_local=0.0,
        c_global=0.0,
        local_period=2,
        global_period=3,
        ranks_per_node=2,
        lr=0.05,
        momentum=0.9,
    )
    assert _train(ddp, opt, rank, 6) == ref_losses
    assert torch.equal(_params(ddp.module), _params(ref))  # coupling 0: bit-for-bit independent SGD
    assert [kind for _, _, kind in opt.leaders] == ["local", "global", "local", "local", "global"]

    # coupling 1 at the global step: every rank takes the parameters of the rank with the lowest loss
    ddp = DDP(tiny_llama(seed=0))
    LSGD.attach_ddp(ddp)
    opt = LSGD(ddp.parameters(), model=ddp, c_local=0.0, c_global=1.0, local_period=100, global_period=3, lr=0.05)
    losses = _train(ddp, opt, rank, 3)
    gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    torch.distributed.all_gather(gathered, torch.tensor([losses[-1]], dtype=torch.float64))
    leader = min(range(world), key=lambda r: (float(gathered[r]), r))
    assert opt.leaders == [(3, leader, "global")]
    everyone = [torch.empty_like(_params(ddp.module)) for _ in range(world)]
    torch.distributed.all_gather(everyone, _params(ddp.module))
    assert all(torch.equal(everyone[0], e) for e in everyone)


def test_lsgd_coupling_zero_is_independent_sgd_and_one_copies_the_leader():
    run_distributed(_lsgd_rank, world_size=4, timeout=300)


def _aldsgd_rank(rank, world):
    from hf_dtrain.decentralized import ALDSGD, DPSGD, MatchaTopology, Topology

    topo = MatchaTopology(Topology.ring(world), budget=0.5, seed=1)
    results = {}
    for name in ("dpsgd", "aldsgd0", "aldsgd"):
        ddp = DDP(tiny_llama(seed=0))
        DPSGD.attach_ddp(ddp)
        if name == "dpsgd":
            opt = DPSGD(ddp.parameters(), topology=topo, lr=0.05, momentum=0.9)
        else:
            coupling = {} if name == "aldsgd" else {"c1": 0.0, "c2": 0.0, "p1": 0.0, "p2": 0.0}
            opt = ALDSGD(ddp.parameters(), model=ddp, topology=topo, lr=0.05, momentum=0.9, **coupling)
        _train(ddp, opt, rank, 6)
        results[name] = (_params(ddp.module), opt.consensus_distance())
        if name == "aldsgd":
            leaders = opt.leaders
    # without the leader terms AL-DSGD is D-PSGD on the same graph (its messages also carry loss and degree)
    torch.testing.assert_close(results["aldsgd0"][0], results["dpsgd"][0], atol=1e-7, rtol=1e-6)
    # with them (the authors' defaults) the update differs, and the leaders are this rank or an active neighbour
    assert not torch.allclose(results["aldsgd"][0], results["dpsgd"][0], atol=1e-6)
    for step, best, maxdeg in leaders:
        allowed = {rank, *topo.in_neighbors(rank, step)}
        assert best in allowed and maxdeg in allowed


def test_aldsgd_without_leader_terms_is_dpsgd():
    run_distributed(_aldsgd_rank, world_size=4, timeout=300)


def test_aldsgd_combination_matches_the_authors_formula():
    from hf_dtrain.decentralized.aldsgd import aldsgd_combine

    x = torch.tensor([1.0, 0.0])
    neighbours = {1: (torch.tensor([0.0, 2.0]), 0.5, 1), 3: (torch.tensor([4.0, 4.0]), 0.9, 2)}
    w_row = torch.tensor([0.5, 0.25, 0.0, 0.25], dtype=torch.float64)
    y, best, maxdeg = aldsgd_combine(0, x, 0.7, 2, neighbours, w_row, c1=0.3, c2=0.1, p1=0.2, p2=0.2)
    assert (best, maxdeg) == (1, 0)  # lowest loss: rank 1; highest degree: ranks 0 and 3 tie, the lower wins
    avg = 0.5 * x + 0.25 * torch.tensor([0.0, 2.0]) + 0.25 * torch.tensor([4.0, 4.0])  # (1.5, 1.5)
    y_ref = 0.6 * avg + 0.3 * torch.tensor([0.0, 2.0]) + 0.1 * x
    y_ref = y_ref - 0.2 * (y_ref - torch.tensor([0.0, 2.0])) - 0.2 * (y_ref - x)
    torch.testing.assert_close(y, y_ref)


def _loss_needed_rank(rank, world):
    from hf_dtrain.decentralized import LSGD

    opt = LSGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1, global_period=1)
    opt.param_groups[0]["params"][0].grad = torch.ones(3)
    with pytest.raises(ValueError, match=r"pass model= .* or call optimizer.set_loss\(loss\)"):
        opt.step()


def test_leader_methods_need_the_loss():
    run_distributed(_loss_needed_rank, world_size=2, timeout=120)
