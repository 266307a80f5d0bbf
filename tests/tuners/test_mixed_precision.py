"""Every tuner under mixed precision, as users train: ``torch.autocast`` in bf16 (what ``TrainingArguments(bf16=True)``
and TRL's defaults do), fp16 autocast with a ``GradScaler``, and a bf16 base model. The adapter's gradients must be
fp32 (master weights), finite, and point where the fp32 run's do; a Trainer with ``bf16=True`` must train."""

import warnings

import pytest
import torch
from peft import get_peft_model

from hf_dtrain.testing import random_batch, tiny_llama
from hf_dtrain.tuners import LoraFAConfig, QAHiRAConfig, QBaRAConfig, SMTConfig

TARGETS = ["q_proj", "v_proj"]
CONFIGS = {
    "smt": lambda: SMTConfig(
        block_size=16,
        target_modules=TARGETS,
        block_indices={
            "model.layers.0.self_attn.q_proj": [[0, 1], [2, 3]],
            "model.layers.1.self_attn.v_proj": [[1, 0]],
        },
    ),
    "lorafa": lambda: LoraFAConfig(r=4, target_modules=TARGETS),
    "qbara": lambda: QBaRAConfig(r=4, target_modules=TARGETS, require_quantized_base=False),
    "qahira": lambda: QAHiRAConfig(group_size=16, target_modules=TARGETS, require_quantized_base=False),
}


def _model(name, dtype=torch.float32):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(tiny_llama(seed=0, hidden_size=64).to(dtype), CONFIGS[name]())


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_matches_fp32(name, dtype):
    batch = random_batch(batch=2, seq=8, seed=0)
    ref = _model(name)
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    model = _model(name)
    with torch.autocast("cpu", dtype=dtype):
        loss = model(**batch).loss
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 2e-2 * ref_loss.item()
    want, got = _grads(ref), _grads(model)
    for n, g in got.items():
        assert g is not None and g.dtype == torch.float32 and torch.isfinite(g).all(), n
        if want[n].norm() > 0:
            cos = torch.nn.functional.cosine_similarity(g.flatten(), want[n].flatten(), dim=0)
            assert cos > 0.98, (n, float(cos))
    assert any(g.norm() > 0 for g in got.values())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fp16_with_a_grad_scaler_trains(name):
    model = _model(name)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    losses = []
    for _step in range(4):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**random_batch(batch=2, seq=8, seed=0)).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(p).all() for p in params)
    assert any(not torch.equal(a, p) for a, p in zip(before, params))  # the scaler did not skip every step
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_bf16_base_model_keeps_fp32_adapters(name):
    model = _model(name, torch.bfloat16)
    model(**random_batch(batch=2, seq=8, seed=0)).loss.backward()
    for n, g in _grads(model).items():
        assert g is not None and g.dtype == torch.float32 and torch.isfinite(g).all(), n


def test_trainer_with_bf16_trains_smt(tmp_path):
    """The case that crashed: SMT under ``TrainingArguments(bf16=True)`` (TRL's ``SFTConfig`` default)."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    rows = [{k: v[0].tolist() for k, v in random_batch(batch=1, seq=16, seed=s).items()} for s in range(16)]
    model = _model("smt")
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=4,
        bf16=True,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        learning_rate=1e-2,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_list(rows))
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    out = trainer.train()
    after = [p for p in model.parameters() if p.requires_grad]
    assert torch.isfinite(torch.tensor(out.training_loss))
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
