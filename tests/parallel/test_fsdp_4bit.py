"""4-bit bases under FSDP2 and DeepSpeed ZeRO-3 / ZeRO-2 (2 gloo ranks), the way peft documents FSDP-QLoRA and
DeepSpeed-QLoRA: bitsandbytes NF4 (packed codes in uint8, and in bf16 as ``bnb_4bit_quant_storage`` sets them), HQQ
and hf_dtrain's INT4, each with the adapters that train on it. Under FSDP2 and ZeRO-3 the 4-bit weights are really
sharded (each rank holds about half the parameter bytes), and every step's loss equals one process training on both
ranks' batches."""

import functools
import json
import warnings

import pytest
import torch

pytest.importorskip("bitsandbytes", reason="bitsandbytes is in the test extra; install hf-dtrain[test]")
pytest.importorskip("hqq", reason="hqq is in the test extra; install hf-dtrain[test]")

from peft import get_peft_model

from hf_dtrain import QAHiRAConfig, QBaRAConfig
from hf_dtrain.testing import mean_over_ranks, run_distributed, tiny_llama

CASES = [
    ("nf4", None, "qbara"),
    ("nf4", "bf16", "qbara"),
    ("hqq4", None, "qbara"),
    ("hqq4", None, "qahira"),
    ("int4", None, "qahira"),
]
STEPS = 10


def _model(base, quant, storage, method):
    from hf_dtrain.quantization import load_quantized_model

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_quantized_model(
            base, quant, group_size=16, quant_storage=torch.bfloat16 if storage == "bf16" else None
        )
        config = (
            QBaRAConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"])
            if method == "qbara"
            else QAHiRAConfig(group_size=16, target_modules=["q_proj", "v_proj", "down_proj"])
        )
        return get_peft_model(model, config)


def _batch(step, rank):
    ids = torch.randint(1, 100, (2, 16), generator=torch.Generator().manual_seed(1000 + 10 * (step % 2) + rank))
    return {"input_ids": ids, "labels": ids}


def _held_bytes(model) -> int:
    """Bytes this rank holds: parameters (their local shards) and buffers (never sharded)."""
    from hf_dtrain.parallel import local_param_bytes

    return local_param_bytes(model) + sum(b.numel() * b.element_size() for b in model.buffers())


ENGINES = ["fsdp2", "zero3", "zero2"]


def _shard(model, engine):
    """The model under ``engine``: FSDP2 (``apply_fsdp``) or a DeepSpeed ZeRO engine (CPU accelerator, every
    parameter partitioned under ZeRO-3, no clipping: the reference does not clip)."""
    opt_params = [p for p in model.parameters() if p.requires_grad]
    if engine == "fsdp2":
        from hf_dtrain.parallel import apply_fsdp

        apply_fsdp(model)
        opt_params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(opt_params, lr=1e-2)
        return model, model, opt
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": int(engine[-1]), "stage3_param_persistence_threshold": 0},
    }
    ds, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(opt_params, lr=1e-2), config=config, dist_init_required=False
    )
    return ds, ds.module, None


def _rank(rank, world, base, out):
    import os

    os.environ["DS_ACCELERATOR"] = "cpu"
    results = {}
    for engine in ENGINES:
        for quant, storage, method in CASES:
            model = _model(base, quant, storage, method)
            whole = _held_bytes(model)
            runner, module, opt = _shard(model, engine)
            local = _held_bytes(module)
            losses = []
            for step in range(STEPS):
                loss = runner(**_batch(step, rank)).loss
                if opt is None:  # DeepSpeed
                    runner.backward(loss)
                    runner.step()
                else:
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                losses.append(mean_over_ranks(loss.item()))
            results[f"{engine}-{quant}-{storage}-{method}"] = {"losses": losses, "bytes": [whole, local]}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("base")
    tiny_llama(seed=0).save_pretrained(base)
    out = base / "results.json"
    run_distributed(_rank, world_size=2, args=(str(base), str(out)), timeout=400)
    return str(base), json.loads(out.read_text())


@functools.cache
def _reference(base, quant, storage, method):
    """One process on both ranks' batches."""
    model = _model(base, quant, storage, method)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = (model(**_batch(step, 0)).loss + model(**_batch(step, 1)).loss) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("quant, storage, method", CASES)
@pytest.mark.parametrize("engine", ENGINES)
def test_4bit_base_is_sharded_and_trains_like_one_process(run, engine, quant, storage, method):
    base, results = run
    got = results[f"{engine}-{quant}-{storage}-{method}"]
    whole, local = got["bytes"]
    if engine != "zero2":  # ZeRO-2 partitions gradients and optimizer state, not the weights
        assert local < 0.55 * whole  # the packed 4-bit weights are sharded with the rest
    losses = _reference(base, quant, storage, method)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), rtol=1e-5, atol=0)
    assert losses[-2] < losses[0]  # it trained (steps 0 and 8 see the same batches)
