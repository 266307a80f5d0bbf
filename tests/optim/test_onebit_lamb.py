"""1-bit LAMB on 2 and 3 gloo ranks: packed 1-bit messages (bytes counted), identical results on every rank, error
feedback that makes the compressed average converge, training within 5% of LAMB's loss, exact resume from a
checkpoint, and clear errors."""

import json

import pytest
import torch

from hf_dtrain.testing import random_batch, run_distributed, tiny_llama, train_on_loader


def _allreduce_rank(rank, world, out_dir, scale_block):
    import torch.distributed as dist

    from hf_dtrain.optim.onebit_lamb import OneBitLamb

    n = 1000
    param = torch.nn.Parameter(torch.zeros(n))
    opt = OneBitLamb([param], freeze_step=1, scale_block=scale_block)
    gen = torch.Generator().manual_seed(rank)
    x = torch.zeros(opt.padded)
    x[:n] = torch.randn(n, generator=gen) + 0.3
    exact = x.clone()
    dist.all_reduce(exact)
    exact /= world
    outputs = []
    for _ in range(60):
        out = opt.compressed_allreduce(x)
        opt.stats.end_step()
        outputs.append(out)
    for out in (outputs[0], outputs[-1]):  # the same on every rank
        gathered = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(gathered, out)
        assert all(torch.equal(gathered[0], g) for g in gathered)
    # error feedback: the running mean of the 1-bit averages converges to the exact average (errors stay bounded)
    err_first = float((outputs[0] - exact).norm() / exact.norm())
    err_mean = float((torch.stack(outputs).mean(0) - exact).norm() / exact.norm())
    assert err_mean < 0.1 < err_first and err_mean < err_first / 5, (err_first, err_mean)
    if rank == 0:
        json.dump({"bytes": opt.stats.steps[-1], "padded": opt.padded}, open(f"{out_dir}/bytes.json", "w"))


@pytest.mark.smoke
@pytest.mark.parametrize("world, scale_block", [(2, None), (3, None), (2, 96)])
def test_compressed_allreduce_bytes_identity_and_error_feedback(tmp_path, world, scale_block):
    """96 does not divide the chunk (504 on 2 ranks): 6 blocks per chunk, the last one shorter."""
    from hf_dtrain.optim.onebit_lamb import onebit_lamb_step_bytes

    run_distributed(_allreduce_rank, world_size=world, args=(str(tmp_path), scale_block), timeout=180)
    r = json.load(open(tmp_path / "bytes.json"))
    padded = r["padded"]
    assert padded % (8 * world) == 0
    blocks = 1 if scale_block is None else -(-(padded // world) // scale_block)
    assert blocks == (1 if scale_block is None else 6)
    # signs of both phases, 8 per byte, plus a 4-byte scale per block: phase 1 of every chunk, phase 2 of its own
    expected = padded // 8 + 4 * world * blocks + padded // world // 8 + 4 * blocks
    assert r["bytes"] == onebit_lamb_step_bytes(1000, world, scale_block) == expected
    assert padded // 8 == 4 * padded / 32  # phase 1: 1/32 of the fp32 payload, plus the scales


def test_block_compression_keeps_each_block_norm():
    """sign x per-block RMS keeps each block's L2 norm, and the returned error is exactly what is not sent."""
    from hf_dtrain.distributed.collectives import onebit_compress, onebit_decompress

    x = torch.randn(2, 10, generator=torch.Generator().manual_seed(0))
    sign, scales, err = onebit_compress(x, 4)
    assert scales.shape == (2, 3)
    approx = onebit_decompress(sign, scales, 4)
    torch.testing.assert_close(approx + err, x)
    for lo, hi in ((0, 4), (4, 8), (8, 10)):
        torch.testing.assert_close(approx[:, lo:hi].norm(dim=1), x[:, lo:hi].norm(dim=1))


FREEZE = 20  # LAMB warm-up steps before compression
LR = 2e-3


def _train_rank(rank, world, base, out_dir, steps, freeze):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    from hf_dtrain import tasks
    from hf_dtrain.models import load_model_and_tokenizer
    from hf_dtrain.optim.onebit_lamb import OneBitLamb

    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(base, progress=False)
    ddp = DDP(model)
    OneBitLamb.attach_ddp(ddp)  # DDP must not average: the optimizer exchanges (compressed) itself
    opt = OneBitLamb(ddp.parameters(), lr=LR, freeze_step=freeze)
    data = tasks.make_task_dataset(tok, steps * 16, seed=100 + rank, split="train", digits=2)
    train_on_loader(ddp, opt, DataLoader(data, batch_size=16, collate_fn=tasks.task_collator(tok)))
    # the loss on 256 held-out problems (the same on both ranks: the replicas are identical)
    held_out = tasks.make_task_dataset(tok, 256, seed=7, split="eval", digits=2)
    model.eval()
    with torch.no_grad():
        loss = (
            sum(
                model(**b).loss.item() for b in DataLoader(held_out, batch_size=64, collate_fn=tasks.task_collator(tok))
            )
            / 4
        )
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    torch.distributed.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g) for g in gathered)  # replicas identical
    if rank == 0:
        json.dump({"loss": loss, "bytes": opt.stats.steps}, open(f"{out_dir}/{freeze}.json", "w"))
    del ddp


@pytest.mark.slow
def test_onebit_lamb_trains_close_to_lamb(tmp_path, tiny_base):
    """150 steps on the test-size default model, 2 ranks, 20 LAMB warm-up steps, then 130 compressed steps: the
    held-out loss within 5% of LAMB's after the same steps (measured: 2.4% above with scale blocks of 2048, 4.1% with
    one scale per chunk, 5.1% with DeepSpeed's one scale per buffer)."""

    base = tiny_base(200)
    steps = 150
    for freeze in (FREEZE, steps + 1):  # steps + 1: never compresses, i.e. LAMB with the same code
        run_distributed(
            _train_rank, world_size=2, args=(base, str(tmp_path), steps, freeze), timeout=600, pg_timeout_s=300
        )
    onebit, lamb = (json.load(open(tmp_path / f"{f}.json")) for f in (FREEZE, steps + 1))
    print(
        f"1-bit LAMB loss {onebit['loss']:.4f} vs LAMB {lamb['loss']:.4f}; bytes per step "
        f"{onebit['bytes'][-1]} vs {lamb['bytes'][-1]}"
    )
    assert onebit["loss"] <= 1.05 * lamb["loss"], (onebit["loss"], lamb["loss"])
    assert max(onebit["bytes"][FREEZE:]) * 16 <= lamb["bytes"][-1]  # at most 1/16 of LAMB's bytes after warm-up


def _resume_rank(rank, world, out_dir):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_dtrain.optim.onebit_lamb import OneBitLamb

    def make():
        ddp = DDP(tiny_llama(seed=0))
        OneBitLamb.attach_ddp(ddp)
        return ddp, OneBitLamb(ddp.parameters(), lr=1e-3, freeze_step=2)

    def run(ddp, opt, steps):
        out = []
        for step in steps:
            loss = ddp(**random_batch(seed=10 * step + rank)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    ddp, opt = make()
    ddp(**random_batch(seed=rank)).loss.backward()  # DDP sends nothing (noop hook): the gradients stay local
    grad = ddp.module.lm_head.weight.grad.clone()
    others = [torch.empty_like(grad) for _ in range(world)]
    torch.distributed.all_gather(others, grad)
    assert not torch.equal(others[0], others[1])
    opt.zero_grad()
    run(ddp, opt, range(4))
    torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict()}, f"{out_dir}/ckpt{rank}.pt")
    straight = run(ddp, opt, range(4, 8))
    ddp2, opt2 = make()
    ckpt = torch.load(f"{out_dir}/ckpt{rank}.pt", weights_only=True)
    ddp2.module.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    assert run(ddp2, opt2, range(4, 8)) == straight
    # rank 0's state alone (what the Trainer / Accelerate write) lacks the other ranks' error feedback: a warning
    # that says what to do, not a silent inexact resume; after consolidate_state_dict() it carries every rank's
    _, opt3 = make()
    rank0 = torch.load(f"{out_dir}/ckpt0.pt", weights_only=True)["opt"]
    if rank == 1:
        with pytest.warns(UserWarning, match=r"consolidate_state_dict"):
            opt3.load_state_dict(rank0)
    opt2.consolidate_state_dict(to=0)
    if rank == 0:
        sd = opt2.state_dict()
        per_rank = sd["onebit"]["per_rank"]["worker_error"]
        assert per_rank.shape[0] == world and not torch.equal(per_rank[0], per_rank[1])  # the ranks' errors differ
        torch.save(sd, f"{out_dir}/consolidated.pt")
    torch.distributed.barrier()
    opt3.load_state_dict(torch.load(f"{out_dir}/consolidated.pt", weights_only=True))
    assert torch.equal(opt3.global_state["worker_error"], opt2.global_state["worker_error"])
    assert torch.equal(opt3.global_state["server_error"], opt2.global_state["server_error"])


def test_checkpoint_resume_is_exact(tmp_path):
    run_distributed(_resume_rank, world_size=2, args=(str(tmp_path),), timeout=180)


def _differing_params(rank, world):
    from hf_dtrain.optim.onebit_lamb import OneBitLamb

    with pytest.raises(ValueError, match=r"OneBitLamb parameters .* differs across ranks"):
        OneBitLamb(tiny_llama(seed=rank).parameters())


def test_bad_input():
    from hf_dtrain.optim.onebit_lamb import OneBitLamb

    with pytest.raises(ValueError, match=r"needs a world of >= 2"):
        OneBitLamb(tiny_llama().parameters())
    with pytest.raises(ValueError, match=r"freeze_step must be an integer >= 1 \(plain LAMB warm-up"):
        OneBitLamb(tiny_llama().parameters(), freeze_step=0)
    run_distributed(_differing_params, world_size=2, timeout=120)
