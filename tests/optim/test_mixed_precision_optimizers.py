"""The exchanging optimizers on a bf16 model (bf16 parameters and gradients), 2 gloo ranks: 1-bit LAMB keeps the
replicas identical, D-PSGD and DecentLaM gossip; every update is finite and moves the parameters."""

import pytest

from hf_dtrain.testing import run_distributed

pytestmark = pytest.mark.slow


def _worker(rank, world):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_dtrain.decentralized import DPSGD, DecentLaM
    from hf_dtrain.distributed.engines import keep_gradients_local
    from hf_dtrain.optim import OneBitLamb
    from hf_dtrain.testing import random_batch, tiny_llama

    makers = {
        "onebit_lamb": lambda ps: OneBitLamb(ps, lr=1e-3, freeze_step=2),
        "dpsgd": lambda ps: DPSGD(ps, topology="ring", base_optimizer="adamw", lr=1e-3),
        "decentlam": lambda ps: DecentLaM(ps, lr=1e-3, momentum=0.9, topology="ring"),
    }
    for name, make in makers.items():
        model = tiny_llama(seed=0, hidden_size=64).to(torch.bfloat16)
        start = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
        ddp = DDP(model)
        keep_gradients_local(ddp)
        opt = make(list(model.parameters()))
        for step in range(4):  # 1-bit LAMB compresses from step 3
            ddp(**random_batch(batch=2, seq=8, seed=step + 10 * rank)).loss.backward()
            opt.step()
            opt.zero_grad()
        flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
        assert torch.isfinite(flat).all() and not torch.equal(flat, start), name
        if name == "onebit_lamb":
            other = [torch.zeros_like(flat) for _ in range(world)]
            dist.all_gather(other, flat)
            assert torch.equal(other[0], other[1]), "1-bit LAMB replicas differ"
        del ddp


def test_exchanging_optimizers_train_a_bf16_model():
    run_distributed(_worker, world_size=2, timeout=240)
