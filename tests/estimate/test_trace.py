"""A training step traced on fake tensors (``hf_dtrain.estimate``) predicts the peak of live tensor storage that the
same step measures on real tensors: full fine-tuning and peft LoRA, with and without activation checkpointing, within
1% (the issue asks 5%), each category (parameters, gradients, optimizer state, activations, temporaries) too; no
storage is allocated for the fake model. (The fake step keeps one more hidden-state-sized tensor at its peak than the
real one: 256 KiB of 69 MB here, 0.4%; on the 64-wide test preset that one tensor is 1.3% of its 2.6 MB peak, hence
the tiny preset.)"""

import json
import pathlib
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch._subclasses.fake_tensor import FakeTensor
from transformers import LlamaForCausalLM

from hf_dtrain.estimate import fake_tensors, trace_step
from hf_dtrain.models import llama_config

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(method: str, checkpointing: bool):
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config("tiny"))
    if method in ("lora", "dora"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = get_peft_model(model, LoraConfig(r=8, target_modules=TARGETS, use_dora=method == "dora"))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return model


def _step(model):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (2, 128))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return optimizer, step


def _trace(model):
    return trace_step(model, *_step(model))


def test_the_tracked_step_is_the_allocators_own_peak():
    """The tracker on real tensors against the CPU allocator's own events of the same step (the profiler's memory
    events: ``StepPeak``, which shares no code with it), on peft DoRA. It found torch's module tracker keeping a
    reference cycle through the autograd nodes of every module's inputs, so a branch that never runs backward stayed
    alive in the trace until a cyclic collection: DoRA's ``lora_B(lora_A(eye))`` before its ``detach()``, an identity
    matrix per layer (traced 12.6% above the job on SmolLM2; 11.6% here)."""
    from hf_dtrain.estimate.measure import StepPeak

    model = _model("dora", False)
    optimizer, step = _step(model)
    step()  # the optimizer's state, held from here on
    peak = StepPeak("cpu")
    peak.start(model, optimizer)
    step()
    measured = peak.stop()
    traced = trace_step(model, optimizer, step, steps=1, flops=False)
    assert abs(traced.peak - measured) <= 0.01 * measured, (traced, measured)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "checkpointing"])
@pytest.mark.parametrize("method", ["full", "lora"])
def test_the_fake_step_predicts_the_measured_peak(method, checkpointing):
    measured = _trace(_model(method, checkpointing))
    with torch.device("meta"):
        meta = _model(method, checkpointing)
    with fake_tensors():
        model = meta.to_empty(device="cpu")
        assert all(isinstance(t, FakeTensor) for t in [*model.parameters(), *model.buffers()])
        estimate = _trace(model)
    assert abs(estimate.peak - measured.peak) <= 0.01 * measured.peak, (estimate, measured)
    # the split at the peak, when both peaks fall in the same phase: full fine-tuning with checkpointing has two
    # moments within 0.1% of each other (late in backward, and in the optimizer's step), and fake and real may peak
    # at either
    in_backward = [m.split.get("activations", 0) > 0.01 * m.peak for m in (estimate, measured)]
    for name, nbytes in measured.split.items():
        if in_backward[0] == in_backward[1] or name in ("parameters", "buffers"):
            assert abs(estimate.split.get(name, 0) - nbytes) <= 0.01 * measured.peak, (name, estimate, measured)
    # independent of the fake path: the real step's categories add up to its peak, its parameters are the model's
    # bytes, and the step ran under the tracker (its activations, or the optimizer's two moments, at the peak: a
    # tracker that saw nothing would make fake and real agree at zero)
    assert measured.peak == sum(measured.split.values())
    assert measured.split["parameters"] == sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert (
        measured.split["activations"] > measured.split["parameters"] / 10
        or measured.split["optimizer state"] >= 2 * trainable
    )
    assert estimate.flops == measured.flops > 0


def _fsdp_step(world_size: int, fake: bool) -> dict:
    """Rank 0's traced step of peft LoRA on the tiny preset under FSDP2 (each decoder layer and the root sharded over
    ``world_size`` ranks): on fake tensors over torch's fake process group, or on real tensors over the gloo group the
    caller made."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_dtrain.estimate import fake_world

    def shard_and_trace(model, mesh):
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return _trace(model).to_dict()

    if not fake:
        return shard_and_trace(_model("lora", False), init_device_mesh("cpu", (world_size,)))
    with torch.device("meta"):
        meta = _model("lora", False)
    with fake_world(world_size) as mesh, fake_tensors():
        return shard_and_trace(meta.to_empty(device="cpu"), mesh)


def _measure_fsdp_rank(rank, world_size, out):
    result = _fsdp_step(world_size, fake=False)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def test_fsdp2_over_a_fake_world_predicts_rank_0_of_a_real_one(tmp_path):
    """FSDP2 over 2 ranks: rank 0's step traced over torch's fake process group (one process) against the same step
    measured on rank 0 of 2 real gloo ranks: the peak within 2% (the issue asks 5%; measured equal to the byte, 34.1
    MB), the FLOPs equal. The fake world runs in a fresh process (it makes the default process group)."""
    from hf_dtrain.testing.launch import run_distributed, run_python

    out = tmp_path / "measured.json"
    run_distributed(_measure_fsdp_rank, world_size=2, args=(str(out),), timeout=300)
    measured = json.loads(out.read_text())
    code = (
        "import json, sys; sys.path.insert(0, 'tests'); from estimate.test_trace import _fsdp_step; "
        "print(json.dumps(_fsdp_step(2, fake=True)))"
    )
    root = pathlib.Path(__file__).resolve().parents[2]
    estimate = json.loads(run_python(code, timeout=300, cwd=str(root)).strip().splitlines()[-1])
    assert abs(estimate["peak_bytes"] - measured["peak_bytes"]) <= 0.02 * measured["peak_bytes"], (estimate, measured)
    assert estimate["flops"] == measured["flops"] > 0
