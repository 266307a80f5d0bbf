"""DiLoCo on 2 gloo ranks: with one inner SGD step per sync, outer lr 1 and no momentum it is all-reduce SGD; with H
inner AdamW steps the replicas meet at each sync and match the outer Nesterov step computed from the gathered local
models; only sync steps send bytes; the 1-bit outer exchange sends its counted bytes and its error feedback loses
nothing over repeated syncs."""

import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_dtrain.testing import run_distributed, tiny_llama, train_steps


def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _diloco_rank(rank, world):
    from hf_dtrain.decentralized import DiLoCo
    from hf_dtrain.distributed.collectives import onebit_allreduce
    from hf_dtrain.optim import onebit_lamb_step_bytes

    batch = lambda step: 10 * step + rank  # noqa: E731
    # H = 1, outer lr 1, no outer momentum, inner SGD: the mean of the local steps = SGD on the mean gradient
    reference = DDP(tiny_llama(seed=0))
    train_steps(reference, 4, batch_seed=batch, optimizer=torch.optim.SGD(reference.parameters(), lr=0.05))
    ddp = DDP(tiny_llama(seed=0))
    DiLoCo.attach_ddp(ddp)
    opt = DiLoCo(ddp.parameters(), base_optimizer="sgd", sync_every=1, outer_lr=1.0, outer_momentum=0.0, lr=0.05)
    train_steps(ddp, 4, batch_seed=batch, optimizer=opt)
    torch.testing.assert_close(_params(ddp.module), _params(reference.module), atol=2e-6, rtol=1e-5)

    # H = 3 inner AdamW steps, Nesterov outer step: check the sync against the formula on the gathered models
    ddp = DDP(tiny_llama(seed=0))
    DiLoCo.attach_ddp(ddp)
    opt = DiLoCo(ddp.parameters(), sync_every=3, outer_lr=0.7, outer_momentum=0.9, lr=1e-3)
    start = _params(ddp.module)
    numel = start.numel()
    train_steps(ddp, 2, batch_seed=batch, optimizer=opt)
    gathered = [torch.empty(numel) for _ in range(world)]
    dist.all_gather(gathered, _params(ddp.module))
    assert not torch.equal(gathered[0], gathered[1])  # inner steps are local
    opt.base.step = _capture(opt.base.step, ddp.module, gathered, world)  # the models just before the 3rd sync
    train_steps(ddp, 1, batch_seed=lambda s: batch(s + 2), optimizer=opt)
    delta = start - torch.stack(gathered).mean(0)
    expected = start - 0.7 * (delta + 0.9 * delta)  # SGD Nesterov, first step: buf = g, update g + momentum * buf
    torch.testing.assert_close(_params(ddp.module), expected, atol=1e-6, rtol=1e-5)
    dist.all_gather(gathered, _params(ddp.module))
    assert torch.equal(gathered[0], gathered[1])
    assert opt.stats.steps == [0, 0, numel * 4] and opt.syncs == 1

    # the 1-bit outer exchange: counted bytes, and the replicas still meet
    ddp = DDP(tiny_llama(seed=0))
    DiLoCo.attach_ddp(ddp)
    opt = DiLoCo(ddp.parameters(), sync_every=2, outer_exchange="1bit", lr=1e-3)
    losses = train_steps(ddp, 6, batch_seed=batch, optimizer=opt)
    assert opt.stats.steps[0] == 0 and opt.stats.steps[1] == onebit_lamb_step_bytes(numel, world, 2048)
    assert opt.stats.steps[1] * 20 < numel * 4  # n/8 + n/16 bytes on 2 ranks, plus scales, against 4n
    dist.all_gather(gathered, _params(ddp.module))
    assert torch.equal(gathered[0], gathered[1]) and all(map(math.isfinite, losses))

    # error feedback: the same vectors averaged over and over; the running mean of what arrives tends to the true
    # average (without feedback a 1-bit message keeps its bias for good)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(8 * world * 64, generator=gen)
    truth = x.clone()
    dist.all_reduce(truth)
    truth /= world
    for feedback in (True, False):
        errors = {"worker_error": torch.zeros_like(x), "server_error": torch.zeros(x.numel() // world)}
        total = torch.zeros_like(x)
        for _t in range(1, 201):
            if not feedback:
                errors = {k: torch.zeros_like(v) for k, v in errors.items()}
            total += onebit_allreduce(x.clone(), errors, scale_block=64)
        err = (total / 200 - truth).norm() / truth.norm()
        if feedback:
            assert err < 0.02, err
        else:
            assert err > 0.2, err


def _capture(step, model, gathered, world):
    def wrapped(*a, **k):
        out = step(*a, **k)
        dist.all_gather(gathered, _params(model))  # after the inner step, before the outer one
        return out

    return wrapped


def test_diloco_sync_outer_step_and_1bit_exchange():
    run_distributed(_diloco_rank, world_size=2, timeout=180)


def test_diloco_bad_settings_are_clear_errors():
    from hf_dtrain.decentralized import DiLoCo

    with pytest.raises(ValueError, match="sync_every must be an integer >= 1"):
        DiLoCo(tiny_llama(seed=0).parameters(), sync_every=0)
    with pytest.raises(ValueError, match="outer_exchange must be one of none, int8, 1bit"):
        DiLoCo(tiny_llama(seed=0).parameters(), outer_exchange="int3")


def test_diloco_and_async_gossip_settings_from_yaml_and_flags():
    from hf_dtrain.jobs.pretrain import PretrainConfig

    opts = PretrainConfig.from_dict({"optimizer": "diloco", "diloco": {"sync_every": 8, "outer_exchange": "1bit"}})
    assert opts.diloco.sync_every == 8 and opts.diloco.outer_exchange == "1bit"
    with pytest.raises(ValueError, match=r"diloco.\* settings are given but optimizer=adamw; set --optimizer diloco"):
        PretrainConfig.from_dict({"diloco": {"sync_every": 8}})
    with pytest.raises(ValueError, match=r"set diloco.outer_exchange to one of none, int8, 1bit"):
        PretrainConfig.from_dict({"optimizer": "diloco", "diloco": {"outer_exchange": "2bit"}})
    opts = PretrainConfig.from_dict({"optimizer": "decentlam", "gossip": {"asynchronous": True, "max_staleness": 2}})
    assert opts.gossip.asynchronous and opts.gossip.max_staleness == 2
    with pytest.raises(ValueError, match="max_staleness"):
        PretrainConfig.from_dict({"optimizer": "dpsgd", "gossip": {"max_staleness": 0}})
