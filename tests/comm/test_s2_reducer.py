"""S2 Reducer as a DDP communication hook on 2 and 3 gloo ranks: exact where the count sketch recovers a position,
zero outside the union of nonzeros, dense fallback exact, bytes equal to the formula."""

import math

import pytest
import torch
from torch import nn

from hf_dtrain.testing import run_distributed


class _Embedding(nn.Module):
    """Gradients nonzero only in the rows of the batch's ids: the sparsity S2 Reducer is for."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(2000, 8)

    def forward(self, ids):
        return self.emb(ids).pow(2).sum()


class _Dense(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        return self.lin(x).pow(2).sum()


def _s2_rank(rank, world, kind):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_dtrain.comm import S2ReducerState, s2_reducer_hook

    model = DDP(_Embedding() if kind == "sparse" else _Dense())
    state = S2ReducerState(rows=3, width_factor=4.0)
    checked = {"exact": 0, "union": 0, "buckets": 0, "max_err": 0.0, "expected_bytes": []}

    def checking_hook(st, bucket):
        local = bucket.buffer().clone()
        reference = local.clone()
        dist.all_reduce(reference)
        reference /= world
        fut = s2_reducer_hook(st, bucket)
        n = local.numel()

        def check(f):
            out = f.value()
            checked["buckets"] += 1
            if bucket.index() in st.last_decode and kind == "sparse":
                union, exact = st.last_decode.pop(bucket.index())
                outside = torch.ones(n, dtype=torch.bool)
                outside[union] = False
                assert torch.all(out[outside] == 0) and torch.all(reference[outside] == 0)
                torch.testing.assert_close(out[union[exact]], reference[union[exact]], atol=1e-6, rtol=1e-6)
                checked["exact"] += int(exact.sum())
                checked["union"] += union.numel()
                checked["max_err"] = max(checked["max_err"], float((out - reference).abs().max()))
                width = math.ceil(st.width_factor * union.numel())
                checked["expected_bytes"].append((n + 7) // 8 + st.rows * width * 4)
            else:
                torch.testing.assert_close(out, reference, atol=1e-6, rtol=1e-6)  # dense fallback: exact
                checked["expected_bytes"].append((n + 7) // 8 + n * 4)
            return out

        return fut.then(check)

    model.register_comm_hook(state, checking_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for _step in range(4):
        if kind == "sparse":
            loss = model(torch.randint(0, 2000, (12,), generator=gen))
        else:
            loss = model(torch.randn(4, 32, generator=gen))
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert checked["buckets"] == 4 and state.iter == 4
    assert state.stats.steps == checked["expected_bytes"]
    if kind == "sparse":
        assert state.sketched == 4 and state.dense == 0
        assert checked["exact"] >= 0.8 * checked["union"]  # with c = 4, d = 3 most positions decode exactly
        assert max(state.stats.steps) < 2000 * 8 * 4 / 2  # under half of the dense all-reduce
    else:
        assert state.dense == 4 and state.sketched == 0
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g) for g in gathered)  # replicas identical


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["sparse", "dense"])
def test_s2_reducer_exact_where_recovered_and_dense_fallback(world, kind):
    run_distributed(_s2_rank, world_size=world, args=(kind,), timeout=180)


def test_bitmap_packing_roundtrip():
    from hf_dtrain.distributed.collectives import pack_bits, unpack_bits

    gen = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 9, 1000):
        a = torch.rand(n, generator=gen) < 0.3
        b = torch.rand(n, generator=gen) < 0.3
        pa, pb = pack_bits(a), pack_bits(b)
        assert pa.dtype == torch.uint8 and pa.numel() == (n + 7) // 8
        assert torch.equal(unpack_bits(pa, n), a)
        assert torch.equal(unpack_bits(pa | pb, n), a | b)  # what the BOR all-reduce computes


def test_bad_state():
    from hf_dtrain.comm import S2ReducerState

    with pytest.raises(ValueError, match="rows must be an odd positive integer"):
        S2ReducerState(rows=2)
    with pytest.raises(ValueError, match="width_factor must be >= 1"):
        S2ReducerState(width_factor=0.5)


def _ef_rank(rank, world):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_dtrain.comm import S2ReducerState, s2_reducer_hook

    steps = 60
    ids = torch.randint(0, 2000, (64,), generator=torch.Generator().manual_seed(rank))
    errors = {}
    for feedback in (True, False):
        model = DDP(_Embedding())
        # one row, one counter per union position: many collisions, and a linear decode
        state = S2ReducerState(rows=1, width_factor=2.0, error_feedback=feedback)
        model.register_comm_hook(state, s2_reducer_hook)
        grad = None
        total = torch.zeros(2000 * 8)
        for _ in range(steps):  # the same gradient every step (no update)
            model.zero_grad()
            model(ids).backward()
            total += model.module.emb.weight.grad.reshape(-1)
            if grad is None:
                local = torch.zeros(2000, 8)
                local.index_add_(0, ids, 2 * model.module.emb.weight.detach()[ids])
                grad = local.reshape(-1)
                exact = grad.clone()
                dist.all_reduce(exact)
                exact /= world
        assert state.sketched == steps and state.dense == 0
        errors[feedback] = float((total / steps - exact).norm() / exact.norm())
        if feedback:  # conservation: what arrived (x world) plus every rank's residual = everything produced
            residual = state.residuals[0].clone()
            dist.all_reduce(residual)
            torch.testing.assert_close(total * world + residual, steps * exact * world, atol=2e-3, rtol=1e-4)
    # without feedback the collisions' error stays; with it, the running average tends to the exact one
    assert errors[False] > 0.05 and errors[True] < errors[False] / 5, errors


def test_s2_error_feedback_loses_nothing():
    run_distributed(_ef_rank, world_size=2, timeout=120)


class _Mixed(nn.Module):
    """An embedding and a dense layer in one DDP bucket, as DDP buckets a model's first layers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(2000, 8)
        self.lin = nn.Linear(8, 8)

    def forward(self, ids):
        return self.lin(self.emb(ids)).pow(2).sum()


def _mixed_rank(rank, world):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_dtrain.comm import S2ReducerState, s2_reducer_hook

    model = DDP(_Mixed())
    state = S2ReducerState(rows=3, width_factor=4.0)
    seen = []

    def checking_hook(st, bucket):
        local = bucket.buffer().clone()
        reference = local.clone()
        dist.all_reduce(reference)
        reference /= world
        sizes = [p.numel() for p in bucket.parameters()]
        fut = s2_reducer_hook(st, bucket)

        def check(f):
            out = f.value()
            union, exact = st.last_decode.pop(bucket.index())
            emb_at = next(i for i, p in enumerate(bucket.parameters()) if p.shape == (2000, 8))
            lo = sum(sizes[:emb_at])
            dense = torch.ones(out.numel(), dtype=torch.bool)
            dense[lo : lo + 2000 * 8] = False
            torch.testing.assert_close(out[dense], reference[dense], atol=1e-6, rtol=1e-6)  # the dense layer: exact
            assert bool(((union >= lo) & (union < lo + 16000)).all())  # only the embedding is sketched
            torch.testing.assert_close(out[union[exact]], reference[union[exact]], atol=1e-6, rtol=1e-6)
            width = math.ceil(st.width_factor * union.numel())
            seen.append((out.numel() + 7) // 8 + int(dense.sum()) * 4 + st.rows * width * 4)
            return out

        return fut.then(check)

    model.register_comm_hook(state, checking_hook)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        model(torch.randint(0, 2000, (12,), generator=gen)).backward()
        model.zero_grad()
    assert state.sketched == 3 and state.dense == 0 and state.stats.steps == seen
    assert max(seen) < 2000 * 8 * 4 / 2  # the bucket costs under half of its dense all-reduce


def test_s2_sketches_the_sparse_tensor_of_a_mixed_bucket_and_sends_the_rest_dense():
    run_distributed(_mixed_rank, world_size=2, timeout=120)
