"""FSDP2 (``apply_fsdp``) with full fine-tuning and each hf_dtrain tuner, 2 gloo ranks: every step's loss and the
saved adapter equal one process training on both ranks' batches; SMT selects the same blocks from the ranks'
gradients; the saved adapter reloads and merges; what cannot work is refused before any step."""

import json

import pytest
import torch
from peft import get_peft_model
from torch.distributed.fsdp import FSDPModule

from hf_dtrain import LoraFAConfig, create_lorafa_optimizer, smt_warmup
from hf_dtrain.parallel import FSDPConfig, apply_fsdp, fsdp_units, full_state_dict, save_pretrained
from hf_dtrain.settings import SettingsError
from hf_dtrain.testing import mean_over_ranks, random_batch, tiny_llama

from .common import (
    CONFIGS,
    LR,
    METHODS,
    STEPS,
    assert_reloads_and_merges,
    assert_trains_like_reference,
    batch,
    build_model,
    hetero_batches,
    hetero_reference,
    reference,
    run_ranks,
    trainable,
    uneven_model,
    uneven_reference,
)


def _steps(model, opt, rank, world, steps):
    losses = []
    for step in steps:
        loss = model(**batch(step, rank)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss.item()))
    return losses


def _dcp_state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, opt)
    return {"model": model_state, "optim": optim_state}


def _fsdp_rank(rank, world, out):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    results = {}
    half = STEPS // 2
    for method in METHODS:
        model = build_model(method, [random_batch(seed=rank)])
        selection = model.peft_config["default"].block_indices if method == "smt" else None
        apply_fsdp(model, FSDPConfig(activation_checkpointing=True))
        opt = torch.optim.AdamW(trainable(model), lr=LR)
        losses = _steps(model, opt, rank, world, range(half))
        dcp.save(_dcp_state(model, opt), checkpoint_id=f"{out}/ckpt_{method}")  # the engine's sharded checkpoint
        losses += _steps(model, opt, rank, world, range(half, STEPS))

        # resume: a fresh sharded model and optimizer load the checkpoint and repeat the second half
        fresh = build_model(method, [], selection=selection)
        apply_fsdp(fresh, FSDPConfig(activation_checkpointing=True))
        fresh_opt = torch.optim.AdamW(trainable(fresh), lr=LR)
        state = _dcp_state(fresh, fresh_opt)
        dcp.load(state, checkpoint_id=f"{out}/ckpt_{method}")
        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        resumed = _steps(fresh, fresh_opt, rank, world, range(half, STEPS))
        if method == "full":
            state = full_state_dict(model)
            if rank == 0:
                torch.save(state, f"{out}/full.pt")
        else:
            save_pretrained(model, f"{out}/{method}")
        results[method] = {"losses": losses, "selection": selection, "resumed": resumed}

    # LoRA-FA with its own optimizer (peft's LoraFAOptimizer correcting B's gradient), on row shards of B
    model = build_model("lorafa", [])
    apply_fsdp(model)
    results["lorafa_optimizer"] = _steps(model, create_lorafa_optimizer(model, lr=LR), rank, world, range(STEPS))

    # dims the ranks do not divide: FSDP2 pads the last row shard; nothing to refuse, it must train like one process
    for method in ("full", "lorafa"):
        model = uneven_model(method)
        apply_fsdp(model)
        results[f"uneven_{method}"] = _steps(
            model, torch.optim.AdamW(trainable(model), lr=LR), rank, world, range(STEPS)
        )

    # the heterogeneity-aware partitioner: batches of 2 and 6, each rank's loss scaled by the sampler
    model = build_model("full", [])
    apply_fsdp(model)
    opt = torch.optim.AdamW(trainable(model), lr=LR)
    results["hetero"] = []
    for data, scale in hetero_batches(rank):
        loss = model(**data).loss
        (loss * scale).backward()
        opt.step()
        opt.zero_grad()
        results["hetero"].append(mean_over_ranks(loss.item() * scale))

    # refused before any step: SMT selection on a sharded model, HSDP replicas that do not divide the processes
    refusals = {}
    model = build_model("smt", [])
    apply_fsdp(model)
    try:
        smt_warmup(model, [random_batch(seed=0)], num_steps=1, progress=False)
    except ValueError as e:
        refusals["smt_after_sharding"] = str(e)
    try:
        apply_fsdp(build_model("lorafa", []), FSDPConfig(replicate=3))
    except ValueError as e:
        refusals["replicate"] = str(e)
    from hf_dtrain.decentralized import ALDSGD, DPSGD, LSGD, DecentLaM
    from hf_dtrain.optim import OneBitLamb

    sharded = apply_fsdp(build_model("full", []))
    for name, make in {
        "onebit_lamb": lambda: OneBitLamb(sharded.parameters()),
        "dpsgd": lambda: DPSGD(sharded.parameters(), lr=0.1),
        "decentlam": lambda: DecentLaM(sharded.parameters(), lr=0.1),
        "lsgd": lambda: LSGD(sharded.parameters(), lr=0.1),
        "aldsgd": lambda: ALDSGD(sharded.parameters(), lr=0.1),
    }.items():
        try:
            make()
        except ValueError as e:
            refusals[name] = str(e)
    results["refusals"] = refusals
    if rank == 0:
        with open(f"{out}/results.json", "w") as f:
            json.dump(results, f)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    return run_ranks(_fsdp_rank, tmp_path_factory, "fsdp")


@pytest.mark.slow
@pytest.mark.smoke
@pytest.mark.parametrize("method", METHODS)
def test_fsdp2_trains_like_one_process(fsdp_run, references, method):
    out, results = fsdp_run
    ref_dir, refs = references
    saved = out / ("full.pt" if method == "full" else method)
    assert_trains_like_reference(method, results[method], refs[method], saved, ref_dir / method)


@pytest.mark.slow
def test_lorafa_optimizer_corrects_row_shards_of_b_like_one_process(fsdp_run):
    """The correction ``g_B (A Aᵀ)⁻¹`` acts on each row of B's gradient alone: on FSDP2's row shards (DTensor's
    implicit replication of the whole ``(A Aᵀ)⁻¹``) it equals one process. peft runs the product under bf16
    autocast, so its rounding sets the tolerance."""
    _, results = fsdp_run
    _, losses = reference("lorafa", optimizer=lambda model: create_lorafa_optimizer(model, lr=LR))
    torch.testing.assert_close(torch.tensor(results["lorafa_optimizer"]), torch.tensor(losses), rtol=1e-4, atol=0)
    assert losses[-2] < losses[0] - 0.01


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_resume_from_a_sharded_checkpoint_repeats_the_steps_exactly(fsdp_run, method):
    _, results = fsdp_run
    got = results[method]
    assert [x.hex() for x in got["resumed"]] == [x.hex() for x in got["losses"][STEPS // 2 :]]


@pytest.mark.slow
@pytest.mark.parametrize("method", list(CONFIGS))
def test_adapter_from_a_sharded_run_reloads_and_merges(fsdp_run, method):
    out, _ = fsdp_run
    assert_reloads_and_merges(out / method)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["full", "lorafa"])
def test_dims_that_do_not_divide_the_shard_count_train_like_one_process(fsdp_run, method):
    """129 vocabulary rows and 75 MLP rows on 2 ranks: FSDP2 pads the last row shard (torch.chunk's split), so
    uneven dims are not an error to refuse; the losses equal one process."""
    got = fsdp_run[1][f"uneven_{method}"]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(uneven_reference(method)), rtol=2e-5, atol=0)


@pytest.mark.slow
def test_heterogeneity_aware_partitioner_under_fsdp2_weighs_every_sample_alike(fsdp_run):
    """Ranks with batches of 2 and 6 (speeds 1:3), each loss scaled by the sampler: every step equals one process
    on the union of the two batches."""
    want, sizes = hetero_reference()
    assert sizes == [2, 6]
    torch.testing.assert_close(torch.tensor(fsdp_run[1]["hetero"]), torch.tensor(want), rtol=2e-5, atol=0)


@pytest.mark.slow
def test_sharding_refusals_name_the_fix(fsdp_run):
    _, results = fsdp_run
    refusals = results["refusals"]
    assert "SMT block selection on a model already sharded by FSDP2" in refusals["smt_after_sharding"]
    assert "block_indices" in refusals["smt_after_sharding"]
    assert "replicate=3 does not divide the 2 processes" in refusals["replicate"]
    for name in ("onebit_lamb", "dpsgd", "decentlam", "lsgd", "aldsgd"):  # whole replicas; FSDP2 holds shards
        assert "held by FSDP2 (a DTensor shard)" in refusals[name] and "Train it with DDP" in refusals[name]


def test_a_wrap_that_splits_a_tuner_layer_is_refused():
    model = get_peft_model(tiny_llama(seed=0), LoraFAConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"q_proj.base_layer.*apart from the adapter.*LlamaDecoderLayer"):
        fsdp_units(model, FSDPConfig(layer_classes=["Linear"]))
    with pytest.raises(ValueError, match="matches no module"):
        fsdp_units(model, FSDPConfig(layer_classes=["GPT2Block"]))
    assert len(fsdp_units(model, FSDPConfig())) == 2  # the decoder layers, from _no_split_modules


def test_integer_parameters_on_a_torch_whose_fsdp2_cannot_shard_them_are_refused_by_name(monkeypatch):
    """torch 2.11's fully_shard fails on a 4-bit base's packed integer weights (a raw "only Tensors of floating point
    dtype can require gradients" from inside FSDP2); there the job says which parameter, and the fix, before
    sharding anything."""
    from hf_dtrain.parallel import fsdp

    model = tiny_llama(seed=0)
    packed = torch.nn.Parameter(torch.zeros(8, dtype=torch.uint8), requires_grad=False)
    model.model.layers[0].self_attn.q_proj.register_parameter("packed", packed)
    monkeypatch.setattr(fsdp, "INTEGER_SHARDS_FROM", (99, 0))
    with pytest.raises(SettingsError, match=r"integer parameters \(model.layers.0.self_attn.q_proj.packed"):
        apply_fsdp(model, FSDPConfig())
    assert not any(isinstance(m, FSDPModule) for m in model.modules())


def test_a_trainer_on_accelerate_before_1_14_gets_the_sharded_model_back_as_it_is(monkeypatch):
    """Accelerate before 1.14 did not hand a model marked prepared back as it is: its ``prepare_model`` wrapped the
    FSDP2-sharded model in DDP, which failed on the DTensor shards (``hf-dtrain finetune --fsdp`` on the floor
    releases, accelerate 1.11). The Trainer's Accelerator gets the newer behaviour; every other model is prepared."""
    import accelerate.utils
    from accelerate import Accelerator

    from hf_dtrain.parallel.section import keep_sharded, leave_sharded_to_the_trainer

    monkeypatch.setattr(accelerate.utils, "compare_versions", lambda *args: False)  # as on accelerate 1.11-1.13
    accelerator = Accelerator(cpu=True)
    wrapped = []
    monkeypatch.setattr(accelerator, "prepare_model", lambda model, *a, **k: wrapped.append(model) or "wrapped")
    leave_sharded_to_the_trainer(accelerator)
    sharded, plain = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    keep_sharded(sharded)
    assert accelerator.prepare(sharded) is sharded and sharded in accelerator._models and wrapped == []
    assert accelerator.prepare(plain) == "wrapped" and wrapped == [plain]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"replicate": 0}, "replicate must be a whole number"),
        ({"param_dtype": "int8"}, "param_dtype='int8' is unknown"),
        ({"layer_classes": []}, "layer_classes must be a non-empty list"),
        ({"cpu_offload": True, "param_dtype": "fp16"}, "use param_dtype=bf16"),
    ],
)
def test_bad_fsdp_config_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FSDPConfig(**kwargs)
