import copy
from unittest import mock

import pytest
import torch
from peft import get_peft_model
from transformers import Trainer, TrainingArguments

from hf_dtrain import SMTConfig, SMTSelectionCallback, select_smt_blocks, smt_warmup
from hf_dtrain.testing import SavedTensorCounter, random_batch, tiny_llama, train_steps
from hf_dtrain.tuners.smt import BlockSparseDelta, SMTLayer, start_smt_scoring

TARGETS = ["q_proj", "k_proj", "v_proj", "down_proj"]


def smt_layers(model):
    return {m.smt_layer_key["default"]: m for m in model.modules() if isinstance(m, SMTLayer)}


def dense_grads(model_or_base, batches, targets):
    """Reference: the summed dense gradient of each target weight, from a plain model with W requiring grad."""
    ref = copy.deepcopy(model_or_base)
    ref.requires_grad_(False)
    weights = {
        n.removesuffix(".weight"): p
        for n, p in ref.named_parameters()
        if n.removesuffix(".weight").split(".")[-1] in targets
    }
    for p in weights.values():
        p.requires_grad_(True)
    for b in batches:
        ref(**b).loss.backward()
    return {k: p.grad for k, p in weights.items()}


def test_block_gradients_equal_dense_gradient_blocks():
    base = tiny_llama()
    indices = {
        "model.layers.0.self_attn.q_proj": [[0, 0], [2, 3]],
        "model.layers.0.mlp.down_proj": [[1, 0], [1, 7], [3, 5]],
        "model.layers.1.self_attn.v_proj": [[3, 3]],
    }
    model = get_peft_model(copy.deepcopy(base), SMTConfig(block_size=16, block_indices=indices, target_modules=TARGETS))
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        if p.requires_grad:
            p.data = torch.randn(p.shape, generator=gen) * 0.1
    batch = random_batch(seed=5)
    model(**batch).loss.backward()
    # reference: the dense model with the deltas merged in, every target weight requiring grad
    merged = copy.deepcopy(model).merge_and_unload()
    ref = dense_grads(merged, [batch], TARGETS)
    for key, layer in smt_layers(model).items():
        idx = layer.smt_indices["default"]
        if not len(idx):
            assert "default" not in layer.smt_weight  # a target with no block holds no parameter
            continue
        g = ref[key].view(layer.out_features // 16, 16, layer.in_features // 16, 16)
        for k, (r, c) in enumerate(idx.tolist()):
            torch.testing.assert_close(layer.smt_weight["default"].grad[k], g[r, :, c, :], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtypes", ["fp32", "bf16_autocast_fp32_weights", "bf16"])
def test_the_fused_base_and_delta_product_equals_the_separate_path_bit_for_bit(dtypes):
    """A plain frozen Linear runs its SMT blocks inside the base product (BlockSparseLinear); the output, the input
    gradient and the block gradients must equal the separate path's (base layer, then the delta added) exactly, with
    several blocks sharing output rows and input columns, and a bias."""
    from hf_dtrain.tuners._base import MergeableLinearMixin
    from hf_dtrain.tuners.smt import Linear
    from hf_dtrain.tuners.smt.layer import BlockSparseLinear

    torch.manual_seed(0)
    weight_dtype = torch.bfloat16 if dtypes == "bf16" else torch.float32
    base = torch.nn.Linear(96, 64, bias=True).to(weight_dtype).requires_grad_(False)
    config = SMTConfig(block_size=16, target_modules=["x"], block_indices={"q": [[0, 1], [0, 4], [2, 1], [3, 0]]})
    layer = Linear(base, "default", config, layer_key="q")
    layer.smt_weight["default"].data.normal_()
    x = torch.randn(3, 5, 96, dtype=weight_dtype, requires_grad=True)
    grad = torch.randn(3, 5, 64, dtype=torch.bfloat16 if dtypes != "fp32" else torch.float32)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtypes == "bf16_autocast_fp32_weights")

    def run(forward):
        x.grad = layer.smt_weight["default"].grad = None
        with autocast:
            y = forward(x)
        y.backward(grad.to(y.dtype))
        return y.detach(), x.grad.clone(), layer.smt_weight["default"].grad.clone()

    with mock.patch.object(BlockSparseLinear, "apply", wraps=BlockSparseLinear.apply) as fused_call:
        fused = run(layer)
    assert fused_call.called, "the fused product did not run on a plain frozen Linear"
    separate = run(lambda t: MergeableLinearMixin.forward(layer, t))  # base layer, then the delta added
    for a, b in zip(fused, separate):
        assert a.dtype == b.dtype
        assert torch.equal(a, b), (a - b).abs().max()
    # a hooked base (ZeRO-3 gathers its parameters in a hook) keeps the separate path
    handle = base.register_forward_pre_hook(lambda m, a: None)
    with mock.patch.object(BlockSparseLinear, "apply", wraps=BlockSparseLinear.apply) as fused_call:
        run(layer)
    handle.remove()
    assert not fused_call.called


def test_block_sparse_delta_saves_only_needed_input_columns_as_copies():
    torch.manual_seed(0)
    n, d_in, d_out, bs = 512, 256, 128, 32
    x = torch.randn(4, n // 4, d_in, requires_grad=True)
    blocks = torch.randn(3, bs, bs, requires_grad=True)
    rows, cols = torch.tensor([0, 2, 3]), torch.tensor([1, 1, 6])  # two distinct input column blocks
    counter = SavedTensorCounter(exclude=[blocks])
    with counter():
        y = BlockSparseDelta.apply(x, blocks, rows, cols, d_out)
    # exactly the two needed column slices, as one contiguous copy, plus three small index tensors
    col_bytes = n * 2 * bs * 4
    assert col_bytes <= counter.nbytes <= col_bytes + 1024
    assert counter.nbytes < x.numel() * 4 / 3
    assert x.untyped_storage().data_ptr() not in counter._storages
    # and the function is right: it equals the dense product with the blocks scattered into a zero matrix
    dense = torch.zeros(d_out, d_in)
    for k, (r, c) in enumerate(zip(rows.tolist(), cols.tolist())):
        dense[r * bs : (r + 1) * bs, c * bs : (c + 1) * bs] = blocks[k].detach()
    torch.testing.assert_close(y, x.detach() @ dense.T, atol=1e-4, rtol=1e-5)
    assert torch.autograd.gradcheck(
        lambda a, b: BlockSparseDelta.apply(a, b, rows[:2], cols[:2], 4 * 4),
        (
            torch.randn(3, 4 * 8, dtype=torch.double, requires_grad=True),
            torch.randn(2, 4, 4, dtype=torch.double, requires_grad=True),
        ),
    )


@pytest.mark.parametrize("score", ["abs_mean", "mean_abs", "l1", "l2"])
def test_warmup_scores_and_global_top_n_match_reference(score):
    base = tiny_llama()
    batches = [random_batch(seed=s) for s in range(3)]
    model = get_peft_model(
        copy.deepcopy(base), SMTConfig(block_size=16, num_blocks=7, warmup_steps=3, score=score, target_modules=TARGETS)
    )
    frozen = {n: p.clone() for n, p in model.named_parameters()}
    selection = smt_warmup(model, batches, progress=False)
    # the warm-up changes no weight
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen and "smt_weight" not in n)
    ref = dense_grads(base, batches, TARGETS)
    all_scores = []
    for key in sorted(ref):
        g = ref[key].view(ref[key].shape[0] // 16, 16, ref[key].shape[1] // 16, 16)
        s = {
            "abs_mean": g.abs().mean((1, 3)),
            "mean_abs": g.mean((1, 3)).abs(),
            "l1": g.abs().sum((1, 3)),
            "l2": g.pow(2).sum((1, 3)).sqrt(),
        }[score]
        all_scores += [
            (v, key, r, c)
            for (r, c), v in zip([(r, c) for r in range(s.shape[0]) for c in range(s.shape[1])], s.flatten().tolist())
        ]
    top = sorted(all_scores, key=lambda t: -t[0])[:7]
    expected = {}
    for _, key, r, c in top:
        expected.setdefault(key, []).append([r, c])
    assert {k: sorted(v) for k, v in selection.items()} == {k: sorted(v) for k, v in expected.items()}
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 7 * 256


def test_after_training_only_selected_blocks_differ():
    base = tiny_llama()
    model = get_peft_model(
        copy.deepcopy(base), SMTConfig(block_size=16, num_blocks=5, warmup_steps=2, target_modules=TARGETS)
    )
    smt_warmup(model, [random_batch(seed=0)], progress=False)
    train_steps(model, 5, batch_seed=lambda step: 10 + step)
    selected = {k: set(map(tuple, v)) for k, v in model.peft_config["default"].block_indices.items()}
    # the base weights themselves are untouched
    merged = copy.deepcopy(model).merge_and_unload()
    base_sd, merged_sd = base.state_dict(), merged.state_dict()
    changed_blocks = 0
    for name, w0 in base_sd.items():
        w1 = merged_sd[name]
        module = name.removesuffix(".weight")
        if module not in selected:
            assert torch.equal(w0, w1), f"{name} changed but holds no selected block"
            continue
        diff = (w0 != w1).view(w0.shape[0] // 16, 16, w0.shape[1] // 16, 16).any(dim=3).any(dim=1)
        changed = {tuple(rc) for rc in diff.nonzero().tolist()}
        assert changed <= selected[module]  # outside the selected blocks every weight is bitwise unchanged
        changed_blocks += len(changed)
    assert changed_blocks == 5
    for layer in smt_layers(model).values():
        assert torch.equal(layer.base_layer.weight, base_sd[layer.smt_layer_key["default"] + ".weight"])


class _Batches(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        b = random_batch(batch=1, seq=16, seed=i)
        return {k: v[0] for k, v in b.items()}


def test_trainer_callback_warms_up_then_trains_selected_blocks(tmp_path):
    base = tiny_llama()
    model = get_peft_model(
        copy.deepcopy(base), SMTConfig(block_size=16, num_blocks=4, warmup_steps=3, target_modules=TARGETS)
    )
    seen = {}

    class Spy(SMTSelectionCallback.__mro__[1]):  # a plain TrainerCallback recording the state around the switch
        def on_step_end(self, args, state, control, model=None, **kw):
            seen[state.global_step] = sum(p.numel() for p in model.parameters() if p.requires_grad)

    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=8,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_steps=100,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_Batches(), callbacks=[SMTSelectionCallback(), Spy()])
    trainer.train()
    # warm-up: no trainable element; from step 3 on: the 4 selected blocks (the spy runs after the switch)
    assert seen[1] == seen[2] == 0 and seen[3] == seen[8] == 4 * 256
    cfg = model.peft_config["default"]
    assert sum(len(v) for v in cfg.block_indices.values()) == 4
    blocks = [m.smt_weight["default"] for m in smt_layers(model).values() if "default" in m.smt_weight]
    assert all(b.abs().sum() > 0 for b in blocks)  # the selected blocks trained after the switch
    inner = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    in_opt = {id(p) for g in inner.param_groups for p in g["params"] if p.numel()}
    assert in_opt == {id(b) for b in blocks}
    for layer in smt_layers(model).values():
        assert torch.equal(layer.base_layer.weight, base.state_dict()[layer.smt_layer_key["default"] + ".weight"])


def test_select_requires_warmup_first():
    model = get_peft_model(tiny_llama(), SMTConfig(block_size=16, num_blocks=2))
    with pytest.raises(RuntimeError, match="start_smt_scoring"):
        select_smt_blocks(model)
    start_smt_scoring(model)
    model(**random_batch()).loss.backward()
    assert sum(len(v) for v in select_smt_blocks(model).values()) == 2


def test_trainable_ratio_resolves_to_block_count():
    model = get_peft_model(tiny_llama(), SMTConfig(block_size=16, trainable_ratio=0.02, warmup_steps=1))
    smt_warmup(model, [random_batch()], progress=False)
    n_params = sum(p.numel() for p in tiny_llama().parameters())
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == int(0.02 * n_params // 256) * 256


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(block_size=24, num_blocks=1), ValueError, r"block_size=24 does not divide .*choose a block_size"),
        (dict(block_size=16, num_blocks=1, target_modules=["nope_proj"]), ValueError, r"not found in the base model"),
        (
            dict(block_size=16, num_blocks=10_000),
            ValueError,
            r"asks for 10000 blocks but the targets hold only 96 .*lower",
        ),
        (dict(block_size=16, num_blocks=1, score="max"), ValueError, r"score='max' is unknown; use one of"),
        (dict(block_size=16), ValueError, r"needs a budget: set num_blocks"),
        (dict(block_size=0, num_blocks=1), ValueError, r"block_size must be a positive integer"),
        (dict(block_size=16, num_blocks=1, trainable_ratio=0.1), ValueError, r"either SMTConfig.num_blocks or"),
        (
            dict(block_size=16, block_indices={"model.layers.9.self_attn.q_proj": [[0, 0]]}),
            ValueError,
            r"not SMT targets",
        ),
        (dict(block_size=16, block_indices={"model.layers.0.self_attn.q_proj": [[9, 0]]}), ValueError, r"out of range"),
        (dict(block_size=16, num_blocks=1, target_modules=["embed_tokens"]), TypeError, r"nn.Linear layers only"),
    ],
)
def test_bad_input_raises_clear_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        get_peft_model(tiny_llama(), SMTConfig(**kwargs))


def _ddp_warmup_rank(rank, world_size, out_dir):
    import json

    import torch.distributed as dist

    model = get_peft_model(tiny_llama(), SMTConfig(block_size=16, num_blocks=6, warmup_steps=2, target_modules=TARGETS))
    selection = smt_warmup(model, [random_batch(seed=10 * rank + s) for s in range(2)], progress=False)
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(selection, f, sort_keys=True)
    dist.barrier()


def test_smt_warmup_under_torch_distributed_selects_the_same_blocks_on_every_rank(tmp_path):
    import json

    from hf_dtrain.testing import run_distributed

    run_distributed(_ddp_warmup_rank, world_size=2, args=(str(tmp_path),), timeout=240)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    # the all-reduced scores equal a single process scoring all ranks' batches
    single = get_peft_model(
        tiny_llama(), SMTConfig(block_size=16, num_blocks=6, warmup_steps=4, target_modules=TARGETS)
    )
    expected = smt_warmup(single, [random_batch(seed=10 * r + s) for r in range(2) for s in range(2)], progress=False)
    assert {k: sorted(v) for k, v in ranks[0].items()} == {k: sorted(v) for k, v in expected.items()}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "amp"])
def test_targets_without_a_block_run_the_frozen_base_lean(autocast):
    """After selection a target can hold no block: it runs the frozen base alone through the lean function
    (FrozenLinear keeps the weight itself, not autocast's bf16 copy of it), every layer is counted lean, and the
    logits and the input and block gradients equal the plain path's (fp32: within 1e-6); under autocast the model
    keeps less for backward than the plain path."""
    from hf_dtrain import fast
    from hf_dtrain.fast.lowrank import FrozenLinear

    indices = {"model.layers.0.self_attn.q_proj": [[0, 0], [2, 3]], "model.layers.1.mlp.down_proj": [[1, 0]]}
    model = get_peft_model(
        tiny_llama(seed=0, hidden_size=64), SMTConfig(block_size=16, block_indices=indices, target_modules=TARGETS)
    )
    for p in model.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    batch = random_batch(seq=16, seed=3)
    frozen = [*model.parameters(), *model.buffers()]

    def run():
        embeds = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_(True)
        counter = SavedTensorCounter(exclude=frozen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), counter():
            out = model(inputs_embeds=embeds, labels=batch["labels"])
        out.loss.backward()
        grads = [embeds.grad] + [p.grad.clone() for p in model.parameters() if p.requires_grad]
        model.zero_grad(set_to_none=True)
        return [out.logits.detach().float(), *grads], counter.nbytes

    with fast.disabled():
        plain, plain_kept = run()
    with mock.patch.object(FrozenLinear, "apply", wraps=FrozenLinear.apply) as frozen_call:
        lean, lean_kept = run()
    empty = 2 * len(TARGETS) - len(indices)
    assert frozen_call.call_count == empty  # the targets without a block, and only those
    n = 2 * len(TARGETS)
    assert fast.report(model) == {"layers": n, "lean": n, "lean adapter": 0, "plain": {}, "blocks": {}}
    for a, b in zip(lean, plain):
        if autocast:
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
        else:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert lean_kept <= plain_kept
    if autocast:  # no bf16 copy of any target's weight
        assert lean_kept < plain_kept


@pytest.mark.parametrize("dtype", [torch.bfloat16, None], ids=["bf16", "fp32"])
def test_the_jobs_prepare_scores_under_its_autocast_and_keeps_given_blocks(dtype):
    """SMT's prepare step in the jobs (before the Trainer, on every engine): its warm-up passes run under the autocast
    the job trains in (``MethodData.autocast_dtype``), ``warmup_steps`` of them, and it selects; an adapter whose
    blocks are given is left as it is, with no pass."""
    from hf_dtrain.tuners.finetune_method import MethodData
    from hf_dtrain.tuners.smt.method import METHOD

    model = get_peft_model(tiny_llama(), SMTConfig(block_size=16, num_blocks=4, warmup_steps=3, target_modules=TARGETS))
    seen = []
    model.register_forward_pre_hook(
        lambda m, a: seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
    )
    data = MethodData(
        train=_Batches(),
        collator=torch.utils.data.default_collate,
        batch_size=4,
        seed=0,
        progress=False,
        autocast_dtype=dtype,
    )
    assert METHOD.prepare(model, None, data) == []
    assert seen == [dtype] * 3
    selection = model.peft_config["default"].block_indices
    assert sum(len(v) for v in selection.values()) == 4
    assert METHOD.prepare(model, None, data) == [] and seen == [dtype] * 3  # given blocks: no pass
    assert model.peft_config["default"].block_indices == selection
