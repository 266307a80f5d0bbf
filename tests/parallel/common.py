"""What the sharded-engine tests share: the methods, their models, the batches each rank sees, and the
single-process reference they are compared with."""

import json
import warnings

import torch
from peft import get_peft_model
from safetensors.torch import load_file

from hf_dtrain import LoraFAConfig, QAHiRAConfig, QBaRAConfig, SMTConfig, smt_warmup
from hf_dtrain.testing import random_batch, tiny_llama

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIGS = {
    "smt": lambda: SMTConfig(block_size=16, num_blocks=5, target_modules=TARGETS),
    "lorafa": lambda: LoraFAConfig(r=4, target_modules=TARGETS, init_seed=0),
    "qbara": lambda: QBaRAConfig(r=4, target_modules=TARGETS, require_quantized_base=False),
    "qahira": lambda: QAHiRAConfig(group_size=16, target_modules=TARGETS, require_quantized_base=False),
}
METHODS = ["full", *CONFIGS]
STEPS = 10
LR = 1e-2


def build_model(method, warmup, selection=None):
    """The tiny LLaMA, fully trainable or with ``method``'s adapter; SMT warms up on ``warmup`` (scores summed over
    ranks when distributed) unless an earlier ``selection`` is given."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_llama(seed=0)
        if method == "full":
            return model
        if selection is not None:
            return get_peft_model(model, SMTConfig(block_size=16, target_modules=TARGETS, block_indices=selection))
        model = get_peft_model(model, CONFIGS[method]())
    if method == "smt":
        smt_warmup(model, warmup, num_steps=len(warmup), progress=False)
    return model


# dims that 2 ranks do not divide: 129 embedding / lm_head rows, 75 rows of gate/up (and 75 columns of down)
UNEVEN = dict(vocab_size=129, intermediate_size=75)


def uneven_model(method):
    """The tiny LLaMA with ``UNEVEN`` dims, fully trainable or with LoRA-FA (whose B has 75 rows on gate/up)."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_llama(seed=0, **UNEVEN)
        return model if method == "full" else get_peft_model(model, CONFIGS[method]())


def uneven_reference(method):
    """One process on both ranks' batches, ``STEPS`` AdamW steps: the losses."""
    return reference(method, model=uneven_model(method))[1]


def batch(step, rank):
    """Two batches per rank, alternating: the loss falls as they are learnt."""
    return random_batch(batch=2, seq=16, seed=1000 + 10 * (step % 2) + rank)


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def reference(method, save_dir=None, optimizer=None, model=None):
    """One process, the same warm-up data, the mean of both ranks' losses per step; saves the adapter.
    ``optimizer(model)``: another optimizer than AdamW; ``model``: another model than ``build_model(method)``."""
    if model is None:
        model = build_model(method, [random_batch(seed=0), random_batch(seed=1)])
    opt = optimizer(model) if optimizer is not None else torch.optim.AdamW(trainable(model), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = (model(**batch(step, 0)).loss + model(**batch(step, 1)).loss) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if method != "full" and save_dir is not None:
        model.save_pretrained(str(save_dir))
    return model, losses


def assert_same_adapter(saved_dir, want_dir):
    """The adapter files of a sharded run equal the single-process run's (float rounding of the summed gradients
    aside), config included."""
    saved = load_file(saved_dir / "adapter_model.safetensors")
    want = load_file(want_dir / "adapter_model.safetensors")
    assert saved.keys() == want.keys() and saved
    for k, v in want.items():
        torch.testing.assert_close(saved[k], v, rtol=1e-4, atol=2e-5, msg=k)
    cfg_saved, cfg_want = (json.loads((d / "adapter_config.json").read_text()) for d in (saved_dir, want_dir))
    for cfg in (cfg_saved, cfg_want):  # peft keeps target_modules as a set: its order varies between processes
        cfg["target_modules"] = sorted(cfg["target_modules"])
    assert cfg_saved == cfg_want


def assert_reloads_and_merges(adapter_dir):
    """The saved adapter loads with peft onto a fresh base, changes its output, and merges exactly."""
    from peft import PeftModel

    data = random_batch(batch=2, seq=16, seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = PeftModel.from_pretrained(tiny_llama(seed=0), str(adapter_dir)).eval()
    base_logits = tiny_llama(seed=0).eval()(**data).logits
    with torch.no_grad():
        logits = model(**data).logits
        assert (logits - base_logits).abs().max() > 1e-3  # the trained adapter changes the model
        merged = model.merge_and_unload()(**data).logits
    torch.testing.assert_close(merged, logits, rtol=1e-4, atol=1e-4)


def assert_trains_like_reference(method, got, ref, saved, ref_dir):
    """A sharded run's losses, selection and saved state (``saved``: the adapter directory, or the full state's
    file) equal the single-process ``ref = (model, losses)`` (``ref_dir``: its saved adapter)."""
    model, losses = ref
    # sums of two ranks' gradients in another order, activation checkpointing in the sharded run: float rounding
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol=2e-5, atol=0)
    assert losses[-2] < losses[0] - 0.01  # it trained (steps 0 and 8 see the same batches)
    if method == "full":
        state = torch.load(saved, weights_only=True)
        want = model.state_dict()
        assert state.keys() == want.keys()
        for k, v in want.items():
            torch.testing.assert_close(state[k], v, rtol=1e-4, atol=2e-5, msg=k)
        return
    if method == "smt":  # the ranks' summed warm-up gradients select exactly the single process's blocks
        assert got["selection"] == model.peft_config["default"].block_indices
    assert_same_adapter(saved, ref_dir)


def run_ranks(fn, tmp_path_factory, name, world=2, timeout=400):
    """``fn(rank, world, out)`` on ``world`` gloo ranks; returns ``out`` (a fresh folder) and the ``results.json``
    rank 0 wrote there."""
    from hf_dtrain.testing import run_distributed

    out = tmp_path_factory.mktemp(name)
    run_distributed(fn, world_size=world, args=(str(out),), timeout=timeout)
    return out, json.loads((out / "results.json").read_text())


# The heterogeneity-aware partitioner under a sharded engine: rank 1 is three times as fast as rank 0, so of a
# global batch of 8 it takes 6 and rank 0 takes 2; each rank's mean loss is scaled by the sampler's loss_scale, so
# the engine's equal-weight average of the ranks' gradients weighs every sample alike.
HETERO_SPEEDS, HETERO_BATCH, HETERO_STEPS = [1.0, 3.0], 8, 10
_HETERO_POOL = random_batch(batch=HETERO_BATCH * HETERO_STEPS, seq=16, seed=77)


def hetero_batches(rank):
    """This rank's ``(batch, loss_scale)`` per step, from ``HeterogeneityAwareSampler``."""
    from hf_dtrain.data import HeterogeneityAwareSampler

    sampler = HeterogeneityAwareSampler(
        None, HETERO_SPEEDS, rank=rank, num_samples=HETERO_BATCH * HETERO_STEPS, seed=0, global_batch_size=HETERO_BATCH
    )
    size, order = sampler.batch_size_for(HETERO_BATCH), list(sampler)
    scale = sampler.loss_scale(HETERO_BATCH)
    return [
        ({k: v[order[i * size : (i + 1) * size]] for k, v in _HETERO_POOL.items()}, scale) for i in range(HETERO_STEPS)
    ]


def hetero_reference():
    """One process, each step on the union of both ranks' samples (the mean over all 8): the losses and the sizes
    of the ranks' batches."""
    model = build_model("full", [])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    per_rank = [hetero_batches(r) for r in range(2)]
    losses = []
    for step in range(HETERO_STEPS):
        union = {k: torch.cat([per_rank[r][step][0][k] for r in range(2)]) for k in _HETERO_POOL}
        loss = model(**union).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [len(per_rank[r][0][0]["input_ids"]) for r in range(2)]


def full_grads(named) -> dict:
    """Every gradient of ``named`` (``model.named_parameters()``) as a whole tensor (DTensor shards gathered), under
    the parameter's name without FSDP's wrapper prefix."""
    from torch.distributed.tensor import DTensor

    out = {}
    for n, p in named:
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[n.replace("_fsdp_wrapped_module.", "")] = g.detach().clone()
    return out


def one_process_run(model, loss_of, steps: int, lr: float):
    """The single-process reference of the layout tests: ``steps`` AdamW steps on ``loss_of(model, step)``; every
    step's loss and the first step's gradients."""
    opt = torch.optim.AdamW(trainable(model), lr=lr)
    losses, grads = [], None
    for step in range(steps):
        loss = loss_of(model, step)
        loss.backward()
        if step == 0:
            grads = full_grads(model.named_parameters())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


def float64_grads(model, loss_of) -> dict:
    """The first step's gradients of ``model`` computed in float64 (``loss_of(model)``, the reference's step 0): the
    exact values, against which float32 rounding is measured."""
    model = model.double()
    loss_of(model).backward()
    return full_grads(model.named_parameters())


def assert_grads_match(got: dict, want: dict, exact: dict) -> None:
    """A layout's first-step gradients (``got``, plain lists per parameter) against the one-process float32 run's
    (``want``), on the scale of float32's own rounding measured here: for each parameter, the layout's distance from
    the float64 gradient (``exact``) is at most 4 times the one-process float32 gradient's own distance from it.

    A split matmul or another summation order moves float32 results by about that much whatever the CPU's kernels
    (an element-wise rtol does not: ``pp 2 x tp 2``'s o_proj sat at 0.99 of a 1e-5 bound on one CPU and passed it on
    an AVX2-only one); a layout bug (a missing reduction, a shard in the wrong place, a scale of 1 + 1e-5) moves them
    by hundreds to millions of times more. Measured on an AVX-512 CPU: every pipeline, TP and 2D case within 1.13."""
    assert set(got) == set(want) == set(exact), (sorted(set(got) ^ set(want)), sorted(set(want) ^ set(exact)))
    for name, g in got.items():
        truth = exact[name]
        error = (torch.tensor(g, dtype=torch.float64) - truth).norm().item()
        rounding = (want[name].double() - truth).norm().item()
        bound = 4 * rounding + 1e-12 * truth.norm().item()
        assert error <= bound, (
            f"{name}: {error:.3e} from the float64 gradient, {error / max(rounding, 1e-300):.1f} times the "
            f"one-process float32 gradient's own {rounding:.3e}"
        )
