"""Optimus-style 2D tensor parallelism (a 2 x 2 mesh of gloo ranks: batch over rows, hidden over columns, weights in
2 x 2 blocks) against one process on the same batch: every step's loss within 1e-5 relative and the first step's
gradient of every parameter likewise; bad shapes are refused naming the dim."""

import json

import pytest
import torch

from hf_dtrain.testing import random_batch

from .common import assert_grads_match, float64_grads, one_process_run

pytestmark = pytest.mark.slow
STEPS, LR, BATCH = 8, 1e-2, 4


def _batch(step):
    return random_batch(batch=BATCH, seq=16, seed=700 + step)


def _reference():
    from hf_dtrain.testing import tiny_llama

    return one_process_run(
        tiny_llama(seed=0),
        lambda m, step: m(input_ids=_batch(step)["input_ids"], labels=_batch(step)["labels"]).loss,
        STEPS,
        LR,
    )


def _rank(rank, world, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from hf_dtrain.parallel.optimus import apply_2d_tensor_parallel, optimus_loss_scale
    from hf_dtrain.testing import tiny_llama

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("row", "col"))
    model = apply_2d_tensor_parallel(tiny_llama(seed=0), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    row = mesh["row"].get_local_rank()
    part = slice(row * BATCH // 2, (row + 1) * BATCH // 2)
    losses, grads = [], None
    for step in range(STEPS):
        b = _batch(step)
        loss = model(input_ids=b["input_ids"][part], labels=b["labels"][part]).loss
        (loss * optimus_loss_scale(model)).backward()
        if step == 0:
            grads = {
                n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).tolist()
                for n, p in model.named_parameters()
            }
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value, group=mesh["row"].get_group())
        losses.append(value.item() / 2)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "grads": grads}, f)


def test_2d_tensor_parallelism_trains_like_one_process(mesh_runs):  # the shared 4-rank run (conftest.py)
    import os

    got = json.loads(open(os.path.join(mesh_runs, "optimus.json")).read())
    want_losses, want_grads = _reference()
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want_losses), rtol=1e-5, atol=0)
    from hf_dtrain.testing import tiny_llama

    b = _batch(0)
    exact = float64_grads(tiny_llama(seed=0), lambda m: m(input_ids=b["input_ids"], labels=b["labels"]).loss)
    assert_grads_match(got["grads"], want_grads, exact)


@pytest.mark.parametrize("q, batch, match", [(3, 6, "num_attention_heads"), (2, 3, "batch size")])
def test_shapes_the_mesh_cannot_split_are_refused(q, batch, match):
    from hf_dtrain.models import llama_config
    from hf_dtrain.parallel.optimus import check_2d

    with pytest.raises(ValueError, match=match):
        check_2d(llama_config("test"), q, batch)
