"""EmbRace on 2 and 3 gloo ranks: embedding gradients as (index, row) pairs by all-gather or all-to-all, the rest by
DDP. Gradients equal DDP's dense average (with a no_sync micro-step too), the dense fallback is exact, bytes equal the
formula, and a model whose embeddings were left in DDP is refused."""

import pytest
import torch
from torch import nn

from hf_dtrain.testing import run_distributed


class _EmbModel(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, 8)
        self.lin = nn.Linear(8, 4)

    def forward(self, ids):
        return self.lin(self.emb(ids).mean(1)).pow(2).sum()


def _embrace_rank(rank, world, exchange, kind):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hf_dtrain.comm as comm

    vocab = 500 if kind == "sparse" else 6
    ref = DDP(_EmbModel(vocab))
    plain = _EmbModel(vocab)
    assert comm.exclude_embeddings(plain) == ["emb.weight"]
    model = DDP(plain)
    state = comm.register(model, {"method": "embrace", "exchange": exchange})
    gen = torch.Generator().manual_seed(rank)
    for step in range(3):
        batches = [torch.randint(0, vocab, (4, 6), generator=gen) for _ in range(2 if step == 1 else 1)]
        for m in (ref, model):
            for i, ids in enumerate(batches):
                if i < len(batches) - 1:
                    with m.no_sync():  # gradient accumulation: local, exchanged on the synchronising micro-step
                        m(ids).backward()
                else:
                    m(ids).backward()
        touched = torch.tensor([torch.cat([b.flatten() for b in batches]).unique().numel()])
        all_touched = [torch.zeros_like(touched) for _ in range(world)]
        dist.all_gather(all_touched, touched)
        for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
            if world == 2:
                assert torch.equal(p.grad, q.grad), name  # sums of two values: order-free
            else:
                torch.testing.assert_close(p.grad, q.grad, atol=1e-7, rtol=1e-6)
        if kind == "sparse" and exchange == "allgather":
            max_k = int(torch.stack(all_touched).max())
            assert state.stats.steps[-1] == comm.embrace_step_bytes([8 * 4 + 4], max_k, 8, world)
        if kind == "sparse" and exchange == "alltoall":
            # the row count (every path starts with it), counts to each owner, this rank's pairs, the owned count,
            # the owners' summed rows (padded to the most)
            ids = [None] * world
            dist.all_gather_object(ids, torch.cat([b.flatten() for b in batches]).unique().tolist())
            union = set().union(*map(set, ids))
            max_owned = max(sum(1 for i in union if i % world == r) for r in range(world))
            local = len(ids[rank])
            expected = (8 * 4 + 4) * 4 + 8 + 8 * world + local * (8 + 8 * 4) + 8 + max_owned * (8 + 8 * 4)
            assert state.stats.steps[-1] == expected, (state.stats.steps[-1], expected)
        for m in (ref, model):
            m.zero_grad(set_to_none=True)
    assert state.iter == 3
    if kind == "sparse":
        assert state.sparse_steps == 3 and state.dense_steps == 0
        assert max(state.stats.steps) < (500 * 8 + 36) * 4 / 2  # well under the dense all-reduce
    else:
        assert state.dense_steps == 3 and state.sparse_steps == 0
        assert state.stats.steps[-1] == (36 + 6 * 8) * 4 + 8


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("exchange", ["allgather", "alltoall"])
def test_embrace_equals_dense_average(world, exchange):
    run_distributed(_embrace_rank, world_size=world, args=(exchange, "sparse"), timeout=180)


def test_embrace_dense_fallback_is_exact():
    run_distributed(_embrace_rank, world_size=2, args=("allgather", "dense"), timeout=180)


def _not_excluded(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hf_dtrain.comm as comm

    model = DDP(_EmbModel(50))
    with pytest.raises(
        ValueError, match=r"still inside DDP\. Call hf_dtrain\.comm\.exclude_embeddings\(model\) before"
    ):
        comm.register(model, "embrace")
    with pytest.raises(ValueError, match=r"must run before the model is wrapped"):
        comm.exclude_embeddings(model)


def test_embrace_needs_embeddings_excluded_before_wrapping():
    run_distributed(_not_excluded, world_size=2, timeout=120)


def test_embrace_bad_config():
    from hf_dtrain.comm import CommHookConfig, exclude_embeddings

    with pytest.raises(
        ValueError,
        match=r"exchange='ring' is unknown; set comm_hook.exchange to one of allgather, "
        r"alltoall",
    ):
        CommHookConfig(method="embrace", exchange="ring")
    with pytest.raises(ValueError, match=r"found no trainable nn.Embedding"):
        exclude_embeddings(nn.Linear(3, 3))


def _sharded_rank(rank, world):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hf_dtrain.comm as comm

    vocab = 500
    ref = DDP(_EmbModel(vocab))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    plain = _EmbModel(vocab)
    assert comm.shard_embeddings(plain) == ["emb"]
    shard = plain.emb
    assert shard.weight.shape == (vocab, [3, 3, 2][rank])  # 8 columns over 3 ranks
    model = DDP(plain)
    state = comm.register(model, {"method": "embrace", "exchange": "sharded"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    for step in range(3):
        ids = torch.randint(0, vocab, (2 + rank, 5), generator=gen)  # a different batch size on every rank
        # the lookup equals the dense table's (bitwise before any update; the clipping factors are computed in
        # different orders, so after it to float rounding)
        with torch.no_grad():
            tol = dict(atol=0, rtol=0) if step == 0 else dict(atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(shard(ids), ref.module.emb(ids), **tol)
        ref(ids).backward()
        model(ids).backward()
        # clipping (active: the norms are above 0.05) by the whole gradient's norm, the same on every rank
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        got = comm.clip_sharded_grad_norm_(model.parameters(), 0.05, plain)
        assert want > 0.05
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
        tokens = [2 * 5, 3 * 5, 4 * 5]
        # bytes: the padded ids, every rank's tokens in my columns (forward), my tokens' gradient (backward)
        expected_sparse = 8 * max(tokens) + 4 * sum(tokens) * shard.weight.shape[1] + 4 * tokens[rank] * 8
        dense = 4 * sum(p.numel() for p in ref.module.lin.parameters())
        assert state.stats.steps[-1] == expected_sparse + dense, (state.stats.steps, expected_sparse + dense)
    torch.testing.assert_close(shard.full_weight(), ref.module.emb.weight.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(model.module.lin.weight, ref.module.lin.weight, atol=1e-6, rtol=1e-5)
    assert comm.unshard_embeddings(plain) == ["emb"] and isinstance(plain.emb, nn.Embedding)
    torch.testing.assert_close(plain.emb.weight, ref.module.emb.weight.detach(), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="norm_type=2 only"):
        comm.clip_sharded_grad_norm_(model.parameters(), 1.0, plain, norm_type=1)
    # a table tied to the output projection has a dense gradient: refused, naming the fix
    tied = _EmbModel(vocab)
    tied.out = nn.Linear(8, vocab, bias=False)
    tied.out.weight = tied.emb.weight
    with pytest.raises(ValueError, match=r"tied to another module.*Untie it, or use exchange='allgather'"):
        comm.shard_embeddings(tied)
    dist.barrier()


def test_sharded_embrace_lookups_and_training_equal_the_dense_table():
    run_distributed(_sharded_rank, world_size=3, timeout=180)
