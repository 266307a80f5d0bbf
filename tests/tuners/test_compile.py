"""Every hf_dtrain layer compiles under ``torch.compile``'s default backend (inductor, generated C++ on CPU) as one
graph: no graph break inside the layer (``torch._dynamo.explain`` counts none, and ``fullgraph=True`` would raise on
one), and the compiled forward and backward give the eager numbers. The tuners' layers (LoRA-FA, SMT's block-sparse
delta, Q-BaRA, QA-HiRA; the last two also on hf_dtrain's INT4 base) and the fused sweep's layers (low-rank adapters,
block-sparse adapters, full linear / embedding / RMSNorm copies). The Trainer's ``torch_compile=True`` with each
tuner: ``test_trainer_torch_compile``."""

import tempfile
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer

from hf_dtrain import LoraFAConfig, QAHiRAConfig, QBaRAConfig, SMTConfig
from hf_dtrain.testing import tiny_llama

HIDDEN = 64
SMT_BLOCKS = {"model.layers.0.self_attn.q_proj": [[0, 1], [2, 3], [2, 0]]}
TUNERS = {
    "lorafa": lambda: LoraFAConfig(r=4, target_modules=["q_proj"], init_seed=0),
    "smt": lambda: SMTConfig(block_size=16, target_modules=["q_proj"], block_indices=SMT_BLOCKS),
    "qbara": lambda: QBaRAConfig(r=4, target_modules=["q_proj"], require_quantized_base=False),
    "qahira": lambda: QAHiRAConfig(group_size=16, target_modules=["q_proj"], require_quantized_base=False),
}


def _peft(config, base=None, adapter_name="default"):
    config.init_weights = False  # a random non-zero adapter: its output and gradients are not trivially zero
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(
            base if base is not None else tiny_llama(seed=0, hidden_size=HIDDEN), config, adapter_name=adapter_name
        )


def _tuner_layer(model):
    return next(m for m in model.modules() if isinstance(m, BaseTunerLayer))


def _int4_base():
    from hf_dtrain.quantization.int4 import quantize_model_int4

    return quantize_model_int4(tiny_llama(seed=0, hidden_size=HIDDEN), group_size=16)


def _fused(kind):
    """One fused layer of a two-job sweep: ``lowrank`` (LoRA r=4 and r=8), ``blocksparse`` (two SMT selections) or
    a full copy's ``linear`` / ``embedding`` / ``rmsnorm``."""
    from hf_dtrain.fused.fuse import fuse_adapters, fuse_models

    if kind in ("lowrank", "blocksparse"):
        if kind == "lowrank":
            configs = [LoraConfig(r=r, target_modules=["q_proj"], init_lora_weights=False) for r in (4, 8)]
        else:
            configs = [
                SMTConfig(block_size=16, target_modules=["q_proj"], block_indices=SMT_BLOCKS),
                SMTConfig(
                    block_size=16,
                    target_modules=["q_proj"],
                    block_indices={
                        "model.layers.0.self_attn.q_proj": [[1, 1]],
                        "model.layers.1.self_attn.q_proj": [[0, 0], [3, 3]],
                    },
                ),
            ]
        torch.manual_seed(0)
        model = _peft(configs[0], adapter_name="a")
        configs[1].init_weights = False
        model.add_adapter("b", configs[1])
        fuse_adapters(model, ["a", "b"])
        return next(m for m in model.modules() if type(m).__name__.startswith("Fused"))
    fused = fuse_models([tiny_llama(seed=0, hidden_size=HIDDEN), tiny_llama(seed=1, hidden_size=HIDDEN)])
    name = {"linear": "FusedLinear", "embedding": "FusedEmbedding", "rmsnorm": "FusedRMSNorm"}[kind]
    return next(m for m in fused.model.modules() if type(m).__name__ == name)


CASES = {
    **{name: (lambda f=f: _tuner_layer(_peft(f()))) for name, f in TUNERS.items()},
    "qbara-int4": lambda: _tuner_layer(_peft(TUNERS["qbara"](), base=_int4_base())),
    "qahira-int4": lambda: _tuner_layer(_peft(TUNERS["qahira"](), base=_int4_base())),
    **{
        f"fused-{kind}": (lambda k=kind: _fused(k))
        for kind in ("lowrank", "blocksparse", "linear", "embedding", "rmsnorm")
    },
}


def _input(name, layer):
    gen = torch.Generator().manual_seed(0)
    if name == "fused-embedding":
        return torch.randint(0, layer.num_embeddings, (4, 8), generator=gen)
    # two jobs' rows stacked job-major for the fused layers; a batch of 2 x 8 tokens for the tuners
    return torch.randn(4, 8, HIDDEN, generator=gen).requires_grad_()


def _forward_backward(layer, x, call=None):
    layer.zero_grad(set_to_none=True)
    if x.is_floating_point():
        x.grad = None
    y = (call if call is not None else layer)(x)
    (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()  # a non-uniform upstream gradient
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.requires_grad}
    if x.is_floating_point():
        grads["input"] = x.grad.clone()
    return y.detach(), grads


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_layer_compiles_as_one_graph_and_gives_the_eager_numbers(name):
    torch._dynamo.reset()
    layer = CASES[name]()
    layer.train()
    x = _input(name, layer)
    want, want_grads = _forward_backward(layer, x)
    assert want_grads and all(g.abs().sum() > 0 for g in want_grads.values()), name
    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1
    compiled = torch.compile(layer, fullgraph=True)  # the default backend: inductor
    got, got_grads = _forward_backward(layer, x, call=compiled)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert set(got_grads) == set(want_grads)
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], rtol=1e-5, atol=1e-5, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("name", sorted(TUNERS))
def test_trainer_torch_compile(name):
    """``TrainingArguments(torch_compile=True)`` (inductor) trains each tuner: the logged losses equal an eager
    Trainer run's on the same data (both start from the same seeded model)."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from hf_dtrain.testing import random_batch

    batch = random_batch(batch=8, seq=16, seed=0)
    data = Dataset.from_dict({"input_ids": batch["input_ids"].tolist(), "labels": batch["input_ids"].tolist()})

    def losses(compile_):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        torch.manual_seed(0)
        # one decoder layer: the compiled graph (and its compile time) is half the two-layer model's
        model = _peft(TUNERS[name](), base=tiny_llama(seed=0, hidden_size=HIDDEN, num_hidden_layers=1))
        with tempfile.TemporaryDirectory() as out:
            args = TrainingArguments(
                out,
                max_steps=2,
                per_device_train_batch_size=4,
                learning_rate=1e-2,
                torch_compile=compile_,
                report_to=[],
                logging_steps=1,
                use_cpu=True,
                save_strategy="no",
                disable_tqdm=True,
                seed=0,
            )
            trainer = Trainer(model=model, args=args, train_dataset=data)
            trainer.train()
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert (graphs > 0) == compile_, f"torch_compile={compile_}: dynamo compiled {graphs} graphs"
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    eager, compiled = losses(False), losses(True)
    assert len(eager) == 2 and eager[-1] != eager[0]  # it trained
    assert compiled == pytest.approx(eager, rel=1e-4, abs=1e-5)
