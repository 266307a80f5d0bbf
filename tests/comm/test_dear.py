"""DeAR on 2 and 3 gloo ranks: reduce-scatter in backward, all-gather and the per-bucket update in the next forward.
The weights equal those of dense DDP with the same optimizer and LR schedule, the update really happens in forward
pre-hooks, the replicas stay identical and the bytes equal the formula."""

import pytest
import torch
from torch import nn

from hf_dtrain.testing import run_distributed


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 4))


def _train(model, optimizer, scheduler, gen, steps, dear_state=None, check_deferred=False):
    for step in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if check_deferred:  # nothing moves at step(): the update waits for the next forward
            assert dear_state.pending > 0
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def _dear_rank(rank, world):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hf_dtrain.comm as comm

    steps = 6
    ref = DDP(_model(), bucket_cap_mb=0.01)  # several buckets: 4 kB of gradients each at most
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    _train(ref, ref_opt, ref_sched, torch.Generator().manual_seed(100 + rank), steps)

    model = DDP(_model(), bucket_cap_mb=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    state = comm.register(model, "dear", optimizer=opt)
    gen = torch.Generator().manual_seed(100 + rank)
    _train(model, opt, sched, gen, 2)
    _train(model, opt, sched, gen, steps - 2, dear_state=state, check_deferred=True)
    assert state.applied > 0, "no bucket was applied in a forward pre-hook"
    state.flush()
    assert state.pending == 0 and state.iter == steps
    for p, q in zip(model.parameters(), ref.parameters()):
        if world == 2:
            assert torch.equal(p, q)  # a sum of two values does not depend on the order
        else:
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    # bytes: each of DDP's buckets (as DDP reports them) padded to a multiple of the world size
    sizes = [int(b) // 4 for b in model._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(",")]
    assert len(sizes) >= 3 and sum(sizes) == sum(p.numel() for p in model.parameters())
    assert state.stats.steps[-1] == comm.dear_step_bytes(sizes, world)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g) for g in gathered)


@pytest.mark.parametrize("world", [2, 3])
def test_dear_equals_dense_ddp_and_updates_in_forward(world):
    run_distributed(_dear_rank, world_size=world, timeout=180)


def _no_optimizer(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hf_dtrain.comm as comm

    with pytest.raises(ValueError, match=r"needs the optimizer: register\(model, 'dear', optimizer=optimizer\)"):
        comm.register(DDP(_model()), "dear")


def test_dear_without_optimizer_is_a_clear_error():
    run_distributed(_no_optimizer, world_size=2, timeout=120)
