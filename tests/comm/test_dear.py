"""DeAR on 2 and 3 gloo ranks: per-layer reduce-scatter in backward, all-gather and the per-layer update in the next
forward. The weights equal those of dense DDP with the same optimizer and LR schedule, the update really happens in
forward pre-hooks, the replicas stay identical, the bytes equal the formula, and the schedule is the paper's: each
layer's reduce-scatter starts while backward still has earlier layers to go, each all-gather one layer ahead of the
forward. Under a GradScaler with plain SGD (an update proportional to the gradient), an overflowing step is skipped
and the unscale reaches the deferred updates: the weights equal DDP's."""

import pytest
import torch
from torch import nn

from hf_dtrain.testing import run_distributed


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )


def _train(model, optimizer, scheduler, gen, steps, dear_state=None, check_deferred=False):
    for _step in range(steps):
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

    model = DDP(_model())  # DDP's own buckets do not matter: DeAR groups per layer
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    state = comm.register(model, {"method": "dear", "fusion_mb": 0}, optimizer=opt)  # one group per Linear
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
    # bytes: each layer's gradients (weight + bias) padded to a multiple of the world size
    sizes = [m.weight.numel() + m.bias.numel() for m in model.module if isinstance(m, nn.Linear)]
    assert [g.numel for g in state.groups] == sizes
    assert state.stats.steps[-1] == comm.dear_step_bytes(sizes, world)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g) for g in gathered)
    state.detach()
    _scaled_sgd(rank)


def _scaled_sgd(rank):
    """A GradScaler in front of plain SGD, whose update is proportional to the gradient (AdamW's is not, and would hide
    a lost unscale): the first step overflows and is skipped, then DeAR's deferred updates equal DDP's."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hf_dtrain.comm as comm

    def run(dear):
        model = DDP(_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        state = comm.register(model, {"method": "dear", "fusion_mb": 0}, optimizer=opt) if dear else None
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1000)
        gen, scales = torch.Generator().manual_seed(7 + rank), []
        for step in range(5):
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
            loss = (model(x) - y).pow(2).mean() * (float("inf") if step == 0 else 1.0)  # step 0 overflows
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
        if dear:
            state.flush()
            state.detach()
        return [p.detach().clone() for p in model.parameters()], scales

    (want, ref_scales), (got, scales) = run(False), run(True)
    assert scales == ref_scales and scales[0] < 2.0**16, f"the first step did not overflow: {scales}"
    assert max((a - b).abs().max().item() for a, b in zip(want, _model().parameters())) > 1e-3  # SGD moved
    for p, q in zip(got, want):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


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


def _ordering_rank(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hf_dtrain.comm as comm

    model = DDP(_model())
    linears = [m for m in model.module if isinstance(m, nn.Linear)]
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    state = comm.register(model, {"method": "dear", "fusion_mb": 0}, optimizer=opt)  # one group per Linear
    assert len(state.groups) == len(linears) == 4
    trace = state.trace = []
    for i, m in enumerate(linears):  # registered after DeAR's hooks, so they run after them
        m.register_forward_pre_hook(lambda mod, args, i=i: trace.append(("fwd", i)))
        for p in m.parameters():
            p.register_post_accumulate_grad_hook(lambda p, i=i: trace.append(("grad", i)))
    gen = torch.Generator().manual_seed(7 + rank)
    for step in range(3):
        trace.append(("step", step))
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    state.flush()
    last = len(trace) - 1 - trace[::-1].index(("step", 2))
    first_fwd = trace.index(("fwd", 0), last)
    steady = trace[last + 1 : first_fwd + 9]  # the forward of step 2: updates of step 1, one layer at a time
    assert steady == [
        ("ag", 1),
        ("apply", 0),
        ("fwd", 0),
        ("ag", 2),
        ("apply", 1),
        ("fwd", 1),
        ("ag", 3),
        ("apply", 2),
        ("fwd", 2),
        ("apply", 3),
        ("fwd", 3),
    ], steady
    backward = trace[first_fwd + 9 :]
    for i in range(1, 4):  # layer i's reduce-scatter is on the wire before layer i-1 has its gradients
        assert backward.index(("rs", i)) < backward.index(("grad", i - 1)), backward
    last_grad = max(i for i, e in enumerate(backward) if e[0] == "grad")
    assert backward.index(("ag", 0)) > last_grad  # step(): the first layer's all-gather, after backward


def test_dear_pipelines_per_layer():
    run_distributed(_ordering_rank, world_size=2, timeout=120)
