"""A training step traced on fake tensors (``hf_dtrain.estimate``) predicts the peak of live tensor storage that the
same step measures on real tensors: full fine-tuning and peft LoRA, with and without activation checkpointing, within
1% (the issue asks 5%), each category (parameters, gradients, optimizer state, activations, temporaries) too; no
storage is allocated for the fake model. (The fake step keeps one more hidden-state-sized tensor at its peak than the
real one: 256 KiB of 69 MB here, 0.4%; on the 64-wide test preset that one tensor is 1.3% of its 2.6 MB peak, hence
the tiny preset.)"""

import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch._subclasses.fake_tensor import FakeTensor
from transformers import LlamaForCausalLM

from hf_dtrain.estimate import fake_tensors, materialize, trace_step
from hf_dtrain.models import llama_config

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(method: str, checkpointing: bool):
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config("tiny"))
    if method == "lora":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = get_peft_model(model, LoraConfig(r=8, target_modules=TARGETS))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return model


def _trace(model):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (2, 128))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return trace_step(model, optimizer, step)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "checkpointing"])
@pytest.mark.parametrize("method", ["full", "lora"])
def test_the_fake_step_predicts_the_measured_peak(method, checkpointing):
    measured = _trace(_model(method, checkpointing))
    with torch.device("meta"):
        meta = _model(method, checkpointing)
    with fake_tensors():
        model = materialize(meta)
        assert all(isinstance(t, FakeTensor) for t in [*model.parameters(), *model.buffers()])
        estimate = _trace(model)
    assert abs(estimate.peak - measured.peak) <= 0.01 * measured.peak, (estimate, measured)
    for name, nbytes in measured.split.items():
        assert abs(estimate.split.get(name, 0) - nbytes) <= 0.01 * measured.peak, (name, estimate, measured)
    assert measured.split["parameters"] == sum(p.numel() * p.element_size() for p in model.parameters())
    assert estimate.flops == measured.flops > 0
