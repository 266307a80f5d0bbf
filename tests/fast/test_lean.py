"""The lean low-rank path (``hf_dtrain.fast``): LoRA-FA, Q-BaRA and a user's peft LoRA (``fast.apply``) give the
plain path's output, input gradient and adapter gradients (fp32: within 1e-6; bf16 weights and bf16 autocast: within
bf16's rounding), keep less for backward (LoRA-FA keeps ``x A^T`` and never ``x``), take the lean path wherever it
applies (a bypass fails the tests), fall back where it does not with the reason counted, compile as one graph, and
train adapters that peft saves and loads like the plain path's."""

import copy
import warnings

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from hf_dtrain import LoraFAConfig, QAHiRAConfig, QBaRAConfig, fast
from hf_dtrain.distributed.counters import SavedTensorCounter
from hf_dtrain.fast.profile import StepProfile
from hf_dtrain.testing import random_batch, tiny_llama


def saved_bytes(fn, exclude):
    """``(bytes kept for backward while fn() runs, fn())``."""
    counter = SavedTensorCounter(exclude=exclude)
    with counter():
        out = fn()
    return counter.nbytes, out


TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIGS = {
    "lora": lambda **kw: LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **kw),
    "lorafa": lambda **kw: LoraFAConfig(r=4, lora_alpha=8, init_weights=False, **kw),
    "qbara": lambda **kw: QBaRAConfig(
        r=4, lora_alpha=8, pool=2, init_weights=False, require_quantized_base=False, **kw
    ),
    "qahira": lambda **kw: QAHiRAConfig(
        group_size=16, lambda_out=2, init_weights=False, require_quantized_base=False, **kw
    ),
    "qahira-r": lambda **kw: QAHiRAConfig(
        group_size=16, lambda_out=2, r=4, init_weights=False, require_quantized_base=False, **kw
    ),
}
LEAN_ADAPTER_ONLY = {"qahira", "qahira-r"}  # the base runs itself; the update is added in one op
# fp32, whole model with the lean blocks: a block sums its products in another order than the layers (the stacked
# q/k/v factors in one product, the input gradient's shares in one buffer), each exact within 1e-6 at the block
# (the block tests); the random 2-layer model carries those roundings through attention and softmax to a few 1e-6
BLOCKS_FP32 = 5e-6


def _lean_count(model, method) -> int:
    return fast.report(model)["lean adapter" if method in LEAN_ADAPTER_ONLY else "lean"]


def _model(method, base=None, **kw):
    torch.manual_seed(0)  # the adapters' random start
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(base or tiny_llama(seed=0), CONFIGS[method](target_modules=TARGETS, **kw))
    if method == "lora":
        assert fast.apply(model)["installed"] == 2 * len(TARGETS)
    return model


def _run(model, batch, autocast: bool):
    """Logits, the input embeddings' gradient and the trained tensors' gradients of one forward and backward; the
    bytes kept for backward; the loss."""
    embeds = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_(True)
    frozen = [*model.parameters(), *model.buffers()]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        kept, out = saved_bytes(lambda: model(inputs_embeds=embeds, labels=batch["labels"]), exclude=frozen)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out.logits.detach().float(), embeds.grad.float(), grads, kept, out.loss.item()


def _close(a, b, tol):
    """``a`` within ``tol`` of ``b`` relative to ``b``'s norm (bf16's rounding of sums taken in another order shows
    in single elements; the norm is what training sees)."""
    assert a.shape == b.shape
    err = (a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"


def _error(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _equal_to_plain(lean, plain, reference, precision):
    """fp32: each lean tensor within 1e-6 of the plain path's. bf16 (weights, or fp32 weights under autocast): both
    paths round, in other orders; against the fp32 result each lean tensor is within 1.25x the plain path's error +
    1e-3."""
    for a, b, r in zip(lean, plain, reference):
        assert a.dtype == b.dtype
        if precision == "fp32":
            _close(a, b, 1e-6)
        else:
            assert _error(a, r) <= 1.25 * _error(b, r) + 1e-3, (_error(a, r), _error(b, r))


@pytest.mark.parametrize("method", list(CONFIGS))
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("precision", ["fp32", "bf16 autocast", "bf16 weights"], ids=["fp32", "amp", "bf16"])
def test_one_lean_layer_equals_the_plain_one(method, bias, precision):
    """One layer: output, input gradient and adapter gradients. fp32: within 1e-6 of the plain path. bf16 (weights,
    or fp32 weights under autocast): both paths round, in other orders; against the fp32 result each of the lean
    path's tensors is within 1.25x the plain path's error + 1e-3."""
    base = tiny_llama(seed=0, hidden_size=64)
    base.model.layers[0].self_attn.q_proj = torch.nn.Linear(64, 64, bias=bias)
    model = _model(method, base=base)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, 7, 64)

    def run(layer, dtype=torch.float32, autocast=False):
        xi = x.detach().to(dtype).requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(xi)
        (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        grads = [p.grad.clone() for p in layer.parameters() if p.requires_grad]
        layer.zero_grad(set_to_none=True)
        return [y.detach(), xi.grad, *grads]

    with fast.disabled():
        reference = run(layer)
    if precision == "bf16 weights":
        layer = copy.deepcopy(layer).to(torch.bfloat16)
    args = dict(dtype=torch.bfloat16) if precision == "bf16 weights" else dict(autocast=precision == "bf16 autocast")
    with fast.disabled():
        plain = run(layer, **args)
    lean = run(layer, **args)
    assert layer.hf_dtrain_path == ("lean adapter" if method in LEAN_ADAPTER_ONLY else "lean")
    assert len(lean) == len(plain) >= 3
    _equal_to_plain(lean, plain, reference, precision)


@pytest.mark.parametrize("method", list(CONFIGS))
@pytest.mark.parametrize("precision", ["fp32", "bf16 autocast", "bf16 weights"], ids=["fp32", "amp", "bf16"])
def test_lean_model_takes_the_path_everywhere_and_keeps_less(method, precision):
    """The whole model (14 adapted layers, 2 decoder layers): every layer takes the lean path; fp32: logits, the
    input's gradient and every adapter gradient within 1e-6 of the plain path; bf16: the loss within 1e-2 (a
    random 2-layer model amplifies single roundings through attention: the layer test bounds the error); the bytes
    kept for backward at most the plain path's, and under autocast below 0.8x (no bf16 copies of the base
    weights)."""
    model = _model(method)
    batch = random_batch(seq=24)
    if precision == "bf16 weights":
        model = model.to(torch.bfloat16)
    autocast = precision == "bf16 autocast"
    with fast.disabled():
        plain = _run(model, batch, autocast)
    assert fast.report(model)["plain"] == {"switched off": 2 * len(TARGETS)}
    lean = _run(model, batch, autocast)
    assert _lean_count(model, method) == 2 * len(TARGETS)  # every layer took it: a bypass fails here
    assert lean[2].keys() == plain[2].keys()
    if precision == "fp32":
        tol = BLOCKS_FP32 if fast.report(model)["blocks"] else 1e-6
        for a, b in zip([lean[0], lean[1], *lean[2].values()], [plain[0], plain[1], *plain[2].values()]):
            _close(a, b, tol)
    else:
        assert abs(lean[4] - plain[4]) <= 1e-2 * abs(plain[4])
    assert lean[3] <= plain[3]  # in fp32, LoRA-FA's plain path keeps only x A^T too
    if autocast and method not in LEAN_ADAPTER_ONLY:
        assert lean[3] < 0.8 * plain[3]


def test_lorafa_keeps_x_a_and_never_x():
    """One LoRA-FA layer keeps ``r`` values per token (``x A^T``) and ``A``, ``B`` in the compute dtype; the plain
    path under autocast also keeps a bf16 copy of the base weight."""
    model = _model("lorafa")
    layer = model.base_model.model.model.layers[0].mlp.down_proj
    x = torch.randn(3, 40, layer.in_features, requires_grad=True)
    frozen = [*model.parameters(), *model.buffers()]
    r, tokens = 4, 3 * 40
    kept, _ = saved_bytes(lambda: layer(x), exclude=frozen)
    assert kept == tokens * r * 4  # fp32: A and B are the layer's own tensors
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept, _ = saved_bytes(lambda: layer(x), exclude=frozen)
        with fast.disabled():
            plain, _ = saved_bytes(lambda: layer(x), exclude=frozen)
    assert kept == (tokens * r + r * layer.in_features + layer.out_features * r) * 2
    assert plain >= kept + layer.in_features * layer.out_features * 2  # at least the bf16 copy of W


def test_fallbacks_are_exact_and_counted():
    model = _model("lorafa", lora_dropout=0.1)
    batch = random_batch()
    model(**batch)
    assert fast.report(model) == {"layers": 14, "lean": 0, "lean adapter": 0, "plain": {"dropout": 14}, "blocks": {}}
    model.eval()  # dropout off in eval: lean again
    with torch.no_grad():
        model(**batch)
    assert fast.report(model)["lean"] == 14
    # what trained is still counted apart: the evaluation does not make the plain training steps read as lean
    assert fast.report(model, training=True)["plain"] == {"dropout": 14}

    model = _model("lora")
    for decoder in model.base_model.model.model.layers:  # the layers alone (the blocks' fall-back: their own test)
        del decoder.self_attn.forward, decoder.mlp.forward
    layer = model.base_model.model.model.layers[1].self_attn.q_proj
    handle = layer.base_layer.register_forward_hook(lambda m, a, o: None)
    model(**batch)
    assert fast.report(model)["plain"] == {"hooks on the base layer": 1}
    handle.remove()
    for p in model.base_model.model.model.layers[0].self_attn.k_proj.base_layer.parameters():
        p.requires_grad_(True)
    logits = model(**batch).logits
    assert fast.report(model)["plain"] == {"base weights train": 1}
    with fast.disabled():
        assert torch.equal(model(**batch).logits, logits)


def test_a_4bit_base_runs_itself_and_the_adapter_is_added_lean(tmp_path):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes>=0.46.1 (the test extra) runs 4-bit on CPU")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from hf_dtrain.quantization import prepare_bnb_4bit_for_training

    tiny_llama().save_pretrained(tmp_path)
    base = AutoModelForCausalLM.from_pretrained(
        tmp_path,
        device_map="cpu",
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32),
    )
    prepare_bnb_4bit_for_training(base)
    for method in ("qbara", "lorafa", "qahira"):
        model = _model(method, base=copy.deepcopy(base))
        batch = random_batch(seq=24)
        with fast.disabled():
            plain = _run(model, batch, autocast=False)
        lean = _run(model, batch, autocast=False)
        assert fast.report(model)["lean adapter"] == 14
        layer = model.base_model.model.model.layers[0].self_attn.q_proj
        assert fast.paths.lean_when_compiled(layer)  # on a 4-bit base the lean path stays under compile
        for a, b in zip(lean[:2], plain[:2]):
            _close(a, b, 1e-5)
        for name in plain[2]:
            _close(lean[2][name], plain[2][name], 1e-5)


def _smt_model(block_indices):
    from hf_dtrain import SMTConfig

    model = get_peft_model(
        tiny_llama(seed=0), SMTConfig(block_size=16, block_indices=block_indices, target_modules=TARGETS)
    )
    for p in model.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    return model


@pytest.mark.parametrize("method", [*CONFIGS, "smt", "smt-no-block"])
def test_lean_layers_compile_as_one_graph(method):
    """Every lean layer kind compiles with ``fullgraph=True`` (a graph break raises) and gives the eager output and
    input gradient: the low-rank function (peft LoRA, LoRA-FA, Q-BaRA), QA-HiRA's pooled one, SMT's block product
    inside the base and the frozen base alone (an SMT target without a block). The kinds whose plain path inductor
    runs faster (``lean_when_compiled = False``) take it under compile, counted with that reason; their lean function
    still compiles whole where a layer asks for it."""
    if method.startswith("smt"):
        blocks = {} if method == "smt-no-block" else {"model.layers.0.self_attn.q_proj": [[0, 0], [2, 3]]}
        blocks["model.layers.1.mlp.down_proj"] = [[1, 0]]  # a selection was made: the empty targets hold no block
        model = _smt_model(blocks)
    else:
        model = _model(method)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    lean = "lean adapter" if method in LEAN_ADAPTER_ONLY else "lean"
    x = torch.randn(2, 8, layer.in_features, requires_grad=True)
    eager = layer(x)
    assert layer.hf_dtrain_path == lean
    (g_e,) = torch.autograd.grad(eager.sum(), x)
    default = fast.paths.lean_when_compiled(layer)  # these bases are dense: SMT, Q-BaRA, QA-HiRA go plain
    assert default == (method.split("-")[0] not in ("smt", "qbara", "qahira"))
    for lean_when_compiled in [default] if default else [default, True]:  # True: the lean function, asked for
        if not default:
            layer.lean_when_compiled = lean_when_compiled
        torch._dynamo.reset()
        out = torch.compile(layer, fullgraph=True)(x)  # a graph break raises
        assert layer.hf_dtrain_path == (lean if lean_when_compiled else fast.paths.COMPILED_PLAIN)
        _close(out, eager, 1e-6)
        (g_c,) = torch.autograd.grad(out.sum(), x)
        _close(g_c, g_e, 1e-6)


@pytest.mark.parametrize("method", ["lora", "lorafa", "qbara", "qahira", "smt"])
def test_adapters_trained_lean_save_and_load_through_peft_as_the_plain_ones(tmp_path, method):
    """Four steps through the lean path and through the plain one from the same start: the saved adapters load back
    through peft unchanged and give the same logits (fp32, within 1e-5)."""

    def train(lean: bool):
        torch.manual_seed(0)
        blocks = {"model.layers.0.self_attn.q_proj": [[0, 0], [2, 3]], "model.layers.1.mlp.down_proj": [[1, 0]]}
        model = _smt_model(blocks) if method == "smt" else _model(method)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        with fast.disabled() if not lean else torch.enable_grad():
            for step in range(4):
                model(**random_batch(seed=step)).loss.backward()
                opt.step()
                opt.zero_grad()
        expected = {"layers": 14, "lean": 0, "lean adapter": 0, "plain": {"switched off": 14}, "blocks": {}}
        if method == "lora":  # fast.apply installed the block path on the two MLPs
            expected["blocks"] = (
                {"lean block": 4} if lean else {"gate_proj: switched off": 2, "q_proj: switched off": 2}
            )
        if lean:
            expected = {**expected, _lean_key(method): 14, "plain": {}}
        assert fast.report(model) == expected
        model.save_pretrained(tmp_path / str(lean))
        return PeftModel.from_pretrained(tiny_llama(seed=0), tmp_path / str(lean)).eval()

    probe = random_batch(seed=9)
    lean, plain = train(True), train(False)
    with torch.no_grad():
        _close(lean(**probe).logits, plain(**probe).logits, 1e-5)


def _lean_key(method) -> str:
    return "lean adapter" if method in LEAN_ADAPTER_ONLY else "lean"


def test_the_step_profile_counts_the_lean_path():
    """The profile's families: under autocast the lean LoRA-FA step runs fewer adapter ops and keeps fewer bytes in
    the tuner layers than the plain one on the same model (no bf16 copy of the base weights)."""
    model = _model("lorafa")
    batch = random_batch(seq=32)

    def profile():
        prof = StepProfile(model)
        with prof.phase("forward"), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
        with prof.phase("backward"):
            loss.backward()
        model.zero_grad(set_to_none=True)
        return prof.summary()

    with fast.disabled():
        plain = profile()
    lean = profile()
    fam = lambda s, f: s["families"].get(f, {"ops": 0})["ops"]  # noqa: E731
    assert fam(lean, "adapter GEMM") + fam(lean, "adapter other") < fam(plain, "adapter GEMM") + fam(
        plain, "adapter other"
    )
    assert fam(lean, "base GEMM") == fam(plain, "base GEMM")
    assert lean["saved_bytes_by_scope"]["adapter"] < 0.8 * plain["saved_bytes_by_scope"]["adapter"]
    # the profile's scope hooks only watch: the MLP blocks stay lean under it, and keep less than the layers did
    fast.apply(model)
    blocks = profile()
    assert fast.report(model)["blocks"] == {"lean block": 4}
    assert blocks["saved_bytes"] < lean["saved_bytes"]
    assert fam(blocks, "base GEMM") == fam(plain, "base GEMM")  # the block's products told apart by shape too


@pytest.mark.parametrize("method", ["lora", "lorafa"])
@pytest.mark.parametrize("precision", ["fp32", "bf16 autocast"], ids=["fp32", "amp"])
def test_the_mlp_block_equals_the_plain_path_and_keeps_less_than_the_lean_layers(method, precision):
    """``fast.apply`` runs each decoder MLP whose gate, up and down projections carry peft LoRA or LoRA-FA adapters
    as one lean block: logits, the input's gradient and every adapter gradient equal the plain path's (fp32: 1e-6;
    bf16: the loss within 1e-2), and the model keeps less for backward than with the layers' own lean paths."""
    model = _model(method)
    if method != "lora":
        assert fast.apply(model) == {"installed": 0, "blocks": 4}  # 2 MLPs, 2 attentions
    for layer in model.base_model.model.model.layers:  # the MLP block alone (the attention block: its own tests)
        del layer.self_attn.forward
    batch = random_batch(seq=24)
    autocast = precision == "bf16 autocast"
    with fast.disabled():
        plain = _run(model, batch, autocast)
    block = _run(model, batch, autocast)
    assert fast.report(model)["blocks"] == {"lean block": 2} and fast.report(model)["lean"] == 14
    if precision == "fp32":
        for a, b in zip([block[0], block[1], *block[2].values()], [plain[0], plain[1], *plain[2].values()]):
            _close(a, b, 1e-6)
    else:
        assert abs(block[4] - plain[4]) <= 1e-2 * abs(plain[4])
    for layer in model.base_model.model.model.layers:  # the layers' own lean paths, without the block
        del layer.mlp.forward
    layers = _run(model, batch, autocast)
    assert block[3] < layers[3] <= plain[3]


@pytest.mark.parametrize("method", ["lora", "lorafa"])
def test_the_mlp_block_keeps_x_once_and_lorafa_never(method):
    """One MLP block in fp32 keeps exactly its input once (LoRA: ``A`` trains) or only ``x A^T`` of the gate and the
    up projection (LoRA-FA), and the gate and up outputs: ``silu(gate)`` and the product are computed again."""
    model = _model(method)
    fast.apply(model)
    mlp = model.base_model.model.model.layers[0].mlp
    hidden, inter = mlp.gate_proj.in_features, mlp.gate_proj.out_features
    x = torch.randn(2, 12, hidden, requires_grad=True)
    kept, out = saved_bytes(lambda: mlp(x), exclude=[*model.parameters(), *model.buffers()])
    assert mlp.hf_dtrain_block_path == "lean block"
    tokens, r = 24, 4
    assert kept == tokens * ((hidden if method == "lora" else 2 * r) + 2 * inter) * 4
    out.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in mlp.parameters() if p.requires_grad)


def test_the_mlp_block_falls_back_counted_and_compiles_whole():
    model = _model("lora", lora_dropout=0.1)  # dropout on: neither the block nor the layers are lean
    model(**random_batch())
    assert fast.report(model)["blocks"] == {"gate_proj: dropout": 2, "q_proj: dropout": 2}
    model = _model("lora")
    mlp = model.base_model.model.model.layers[1].mlp
    handle = mlp.up_proj.register_forward_hook(lambda m, a, o: None)  # a user's hook must run: no block there
    model(**random_batch())
    assert fast.report(model)["blocks"] == {"lean block": 3, "up_proj: hooks on the adapter layer": 1}
    handle.remove()
    x = torch.randn(2, 8, mlp.gate_proj.in_features, requires_grad=True)
    eager = mlp(x)
    (g_e,) = torch.autograd.grad(eager.sum(), x)
    torch._dynamo.reset()
    out = torch.compile(mlp, fullgraph=True)(x)  # a graph break raises
    assert mlp.hf_dtrain_block_path == "lean block"
    _close(out, eager, 1e-6)
    (g_c,) = torch.autograd.grad(out.sum(), x)
    _close(g_c, g_e, 1e-6)


def test_q_k_v_share_one_cast_of_their_input():
    """Under autocast an attention block's q, k and v projections (peft LoRA through ``fast.apply``) cast their common
    input once and keep that one copy for backward (the layers ran each their own before), with the plain path's
    gradients."""
    model = _model("lora")
    attn = model.base_model.model.model.layers[0].self_attn
    layers = (attn.q_proj, attn.k_proj, attn.v_proj)
    x = torch.randn(2, 12, attn.q_proj.in_features, requires_grad=True)
    frozen = [*model.parameters(), *model.buffers()]

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            kept, outs = saved_bytes(lambda: [layer(x) for layer in layers], exclude=[*frozen, x])
        (grad,) = torch.autograd.grad(sum((o.float() * o.float()).sum() for o in outs), x)
        return kept, grad

    lean_kept, lean_grad = run()
    assert all(layer.hf_dtrain_path == "lean" for layer in layers)
    with fast.disabled():
        _, plain_grad = run()
    factors = sum(
        (layer.lora_A["default"].weight.numel() + layer.lora_B["default"].weight.numel()) * 2 for layer in layers
    )
    assert lean_kept == 24 * attn.q_proj.in_features * 2 + factors  # x in bf16 once, each layer's factors in bf16
    _close(lean_grad, plain_grad, 1e-2)


class _GemmCount(torch.utils._python_dispatch.TorchDispatchMode):
    """The matrix products dispatched while it is on (``mm``, ``addmm``, ``addmm_``, ``bmm``...)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket.__name__ in ("mm", "addmm", "addmm_", "bmm", "baddbmm", "matmul")
        return func(*args, **(kwargs or {}))


def _attention(method, **kw):
    """The first decoder attention of a model whose q, k and v (and o) carry adapters, ``fast.apply`` run; the
    rotary embeddings for 12 positions."""
    model = _model(method, **kw)
    if method != "lora":
        fast.apply(model)
    attn = model.base_model.model.model.layers[0].self_attn
    x = torch.randn(2, 12, attn.q_proj.in_features)
    positions = model.base_model.model.model.rotary_emb(x, torch.arange(12)[None].expand(2, 12))
    return model, attn, x, positions


def _attention_step(attn, x, positions, dtype=torch.float32, autocast=False):
    """The attention's output, its input's gradient and its adapters' gradients."""
    xi = x.detach().to(dtype).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out, _ = attn(xi, position_embeddings=positions, attention_mask=None)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    grads = [p.grad.clone() for p in attn.parameters() if p.requires_grad]
    attn.zero_grad(set_to_none=True)
    return [out.detach(), xi.grad, *grads]


@pytest.mark.parametrize("method", ["lora", "lorafa"])
@pytest.mark.parametrize("precision", ["fp32", "bf16 autocast", "bf16 weights"], ids=["fp32", "amp", "bf16"])
def test_the_attention_block_equals_the_plain_path(method, precision):
    """``fast.apply`` runs each decoder attention's q, k and v projections (peft LoRA or LoRA-FA, k at another rank)
    as one function of their shared input: the attention's output, input gradient and every adapter gradient equal
    the plain path's (fp32: within 1e-6; bf16 weights or autocast: within 1.25x the plain path's own error against
    fp32 + 1e-3), and its projections' forwards are their own again after it."""
    _, attn, x, positions = _attention(method, **({"rank_pattern": {"k_proj": 2}} if method == "lora" else {}))
    own = {n: getattr(attn, n).__dict__.get("forward") for n in ("q_proj", "k_proj", "v_proj")}
    with fast.disabled():
        reference = _attention_step(attn, x, positions)
    if precision == "bf16 weights":
        attn = attn.to(torch.bfloat16)
        positions = tuple(t.to(torch.bfloat16) for t in positions)  # as the model's rotary embedding gives them
    args = dict(dtype=torch.bfloat16) if precision == "bf16 weights" else dict(autocast=precision == "bf16 autocast")
    with fast.disabled():
        plain = _attention_step(attn, x, positions, **args)
        assert attn.hf_dtrain_block_path == "q_proj: switched off"
    lean = _attention_step(attn, x, positions, **args)
    assert attn.hf_dtrain_block_path == "lean block"
    assert len(lean) == len(plain) == 2 + (8 if method == "lora" else 4)  # LoRA-FA: the B factors train
    _equal_to_plain(lean, plain, reference, precision)
    assert {n: getattr(attn, n).__dict__.get("forward") for n in own} == own


@pytest.mark.parametrize("method", ["lora", "lorafa"])
def test_the_attention_block_runs_fewer_products_and_lorafa_keeps_no_x(method):
    """The block reads its input once for the three adapters: 8 fewer matrix products per forward and backward than
    the layers' lean paths with LoRA (one ``x [A_q; A_k; A_v]^T`` for three, one product for the three ``A``
    gradients, one for their share of the input gradient, ``x A^T`` recomputed once), 4 with LoRA-FA; no more bytes
    kept (LoRA: ``x`` once; LoRA-FA: ``x A^T`` of the three, never ``x``)."""
    model, attn, x, positions = _attention(method)
    frozen = [*model.parameters(), *model.buffers()]

    def step():
        with _GemmCount() as count:
            kept, _ = saved_bytes(lambda: _attention_step(attn, x, positions), exclude=frozen)
        return count.n, kept

    block = step()
    assert attn.hf_dtrain_block_path == "lean block"
    with fast.disabled():
        plain = step()
    del attn.forward  # the layers' own lean paths
    layers = step()
    assert attn.q_proj.hf_dtrain_path == "lean"
    assert block[0] == layers[0] - (8 if method == "lora" else 4) < plain[0]  # LoRA-FA: no A gradient, no x A^T again
    assert block[1] == layers[1] <= plain[1]  # LoRA: x once; LoRA-FA: x A^T of the three (r per token), never x


@pytest.mark.parametrize("method", ["lora", "lorafa"])
def test_the_attention_block_falls_back_counted_and_compiles_whole(method):
    _, attn, x, positions = _attention(method)
    handle = attn.k_proj.register_forward_hook(lambda m, a, o: None)  # a user's hook must run: no block there
    hooked = _attention_step(attn, x, positions)
    assert attn.hf_dtrain_block_path == "k_proj: hooks on the adapter layer"
    assert attn.q_proj.hf_dtrain_path == "lean"  # the layers' own lean paths still apply
    handle.remove()
    with fast.disabled():
        plain = _attention_step(attn, x, positions)
    for a, b in zip(hooked, plain):
        _close(a, b, 1e-6)
    eager = _attention_step(attn, x, positions)
    own = {n: getattr(attn, n).__dict__.get("forward") for n in ("q_proj", "k_proj", "v_proj")}
    torch._dynamo.reset()
    compiled = torch.compile(attn, fullgraph=True)  # a graph break raises
    out = _attention_step(compiled, x, positions)
    assert attn.hf_dtrain_block_path == "lean block"
    assert {n: getattr(attn, n).__dict__.get("forward") for n in own} == own  # the projections' own again
    for a, b in zip(out, eager):
        _close(a, b, 1e-6)
    _attention_step(compiled, x, positions)  # again: the block left the projections as it found them
