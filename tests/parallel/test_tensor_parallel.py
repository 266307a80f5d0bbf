"""Tensor + sequence parallelism (DTensor, 4 gloo ranks) against one process on the same global batch: every step's
loss within 1e-5 relative and the first step's gradient of every parameter within float32's rounding
(common.assert_grads_match), for full training and LoRA-FA,
and peft's LoRA, with TP alone (tp=4), TP without SP or loss parallelism, and FSDP2 over TP on a 2x2 mesh
(dp_shard x tp). A frozen parameter stays frozen (torch's SequenceParallel re-creates norm weights trainable: the
LoRA-FA case with SP caught it)."""

import json
import warnings

import pytest
import torch

from .common import (
    LR,
    STEPS,
    assert_grads_match,
    batch,
    build_model,
    float64_grads,
    full_grads,
    one_process_run,
    trainable,
)

pytestmark = pytest.mark.slow

# (dp_shard, tp, sequence_parallel, loss_parallel, method)
CASES = [
    (1, 4, True, True, "full"),
    (1, 4, False, False, "lorafa"),
    (1, 4, True, True, "lora"),
    (2, 2, True, True, "full"),
    (2, 2, True, True, "lorafa"),
    (2, 2, False, True, "lora"),
]


def _model(method):
    if method != "lora":
        return build_model(method, None)
    from peft import LoraConfig, get_peft_model

    from hf_dtrain.testing import tiny_llama

    from .common import TARGETS

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(tiny_llama(seed=0), LoraConfig(r=4, target_modules=TARGETS, lora_dropout=0.0))
    for n, p in model.named_parameters():  # B is zero at init: give it values so every gradient path is exercised
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(len(n)))
    return model


def _reference(method, dp):
    return one_process_run(
        _model(method), lambda m, step: sum(m(**batch(step, d)).loss for d in range(dp)) / dp, STEPS, LR
    )


def _tp_rank(rank, world, cases, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hf_dtrain.parallel import FSDPConfig, TensorParallelConfig, apply_fsdp, apply_tensor_parallel
    from hf_dtrain.parallel.tensor import local_loss, tensor_parallel_loss

    results = []
    for dp, tp, sp, lp, method in cases:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))
        model = _model(method)
        apply_tensor_parallel(model, mesh["tp"], TensorParallelConfig(sequence_parallel=sp, loss_parallel=lp))
        if dp > 1:
            apply_fsdp(model, FSDPConfig(), mesh=mesh["dp_shard"])
        opt = torch.optim.AdamW(trainable(model), lr=LR)
        d = mesh["dp_shard"].get_local_rank()
        losses, grads = [], None
        for step in range(STEPS):
            with tensor_parallel_loss(model):
                loss = model(**batch(step, d)).loss
                loss.backward()
            value = local_loss(loss).detach().clone()
            dist.all_reduce(value, group=mesh["dp_shard"].get_group())
            if step == 0:
                grads = {k: v.tolist() for k, v in full_grads(model.named_parameters()).items()}
            opt.step()
            opt.zero_grad()
            losses.append(value.item() / dp)
        results.append({"losses": losses, "grads": grads})
        del model, opt
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


@pytest.fixture(scope="module")
def tp_run(mesh_runs):  # the shared 4-rank run (conftest.py)
    import os

    return json.loads(open(os.path.join(mesh_runs, "tp.json")).read())


@pytest.mark.smoke
@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
def test_tensor_parallel_trains_like_one_process(tp_run, case):
    dp, _, _, _, method = CASES[case]
    want_losses, want_grads = _reference(method, dp)
    got = tp_run[case]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want_losses), rtol=1e-5, atol=0)
    exact = float64_grads(_model(method), lambda m: sum(m(**batch(0, d)).loss for d in range(dp)) / dp)
    assert_grads_match(got["grads"], want_grads, exact)


class _Mesh:  # what apply_tensor_parallel reads of a 1D mesh before it shards anything
    ndim = 1

    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


@pytest.mark.parametrize("method", ["smt", "qbara", "qahira"])
def test_tuners_tp_cannot_shard_are_refused_with_the_reason(method):
    from hf_dtrain.parallel import apply_tensor_parallel
    from hf_dtrain.testing import random_batch

    from .common import build_model as build

    model = build(method, [random_batch(seed=0)])
    with pytest.raises(ValueError, match=r"cannot shard the .* adapter .* FSDP2 or ZeRO-3"):
        apply_tensor_parallel(model, _Mesh(2))


@pytest.mark.parametrize("tp, dim", [(3, "num_attention_heads"), (8, "num_attention_heads")])
def test_a_tp_that_does_not_divide_the_model_is_refused(tp, dim):
    from hf_dtrain.models import llama_config
    from hf_dtrain.parallel.tensor import check_tensor_parallel

    with pytest.raises(ValueError, match=rf"--tp {tp} does not divide the model's {dim}"):
        check_tensor_parallel(llama_config("test"), tp)
