"""Eva and vectorized FOOF: the preconditioned gradient equals a dense computation of the same formula, huge damping
gives back the wrapped optimizer, data-parallel ranks precondition identically, checkpoints resume exactly, and bad
hyperparameters are clear errors."""

import pytest
import torch
from torch import nn

from hf_dtrain.optim import Eva
from hf_dtrain.testing import mean_over_ranks, random_batch, run_distributed, tiny_llama


def _one_layer_step(method):
    torch.manual_seed(0)
    layer = nn.Linear(5, 3)
    x, target = torch.randn(4, 7, 5), torch.randn(4, 7, 3)
    w0, b0 = layer.weight.detach().clone(), layer.bias.detach().clone()
    opt = Eva(
        layer.parameters(),
        model=layer,
        base_optimizer="sgd",
        lr=0.1,
        damping=0.03,
        kl_clip=1e9,
        factor_decay=1.0,
        method=method,
        exclude=(),
    )
    out = layer(x)
    out.retain_grad()
    ((out - target) ** 2).mean().backward()
    grad = torch.cat([layer.weight.grad, layer.bias.grad.unsqueeze(1)], 1).double()
    a = torch.cat([x.reshape(-1, 5).mean(0), torch.ones(1)]).double()
    g = out.grad.reshape(-1, 3).mean(0).double()
    opt.step()
    return layer, w0, b0, grad, a, g


def test_eva_equals_dense_kronecker_inverse():
    layer, w0, b0, grad, a, g = _one_layer_step("eva")
    gamma = 0.03
    # vec (column-major) of g aᵀ is a ⊗ g: the curvature (ā āᵀ) ⊗ (ḡ ḡᵀ) acts on vec(∇) as kron(a aᵀ, g gᵀ)
    fisher = torch.kron(torch.outer(a, a), torch.outer(g, g))
    vec = grad.T.reshape(-1)
    v = torch.linalg.solve(fisher + gamma * torch.eye(vec.numel(), dtype=torch.float64), vec).reshape(6, 3).T
    torch.testing.assert_close(layer.weight.detach().double(), w0.double() - 0.1 * v[:, :5], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.bias.detach().double(), b0.double() - 0.1 * v[:, 5], atol=1e-5, rtol=1e-5)


def test_foof_equals_dense_input_side_inverse():
    layer, w0, b0, grad, a, _ = _one_layer_step("foof")
    v = grad @ torch.linalg.inv(torch.outer(a, a) + 0.03 * torch.eye(6, dtype=torch.float64))
    torch.testing.assert_close(layer.weight.detach().double(), w0.double() - 0.1 * v[:, :5], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.bias.detach().double(), b0.double() - 0.1 * v[:, 5], atol=1e-5, rtol=1e-5)


def test_kl_clip_bounds_the_update():
    """The paper's KL clip: the applied step U = ν V has lr² ν² Σ V⊙∇ = κ when clipping is active."""
    torch.manual_seed(0)
    layer = nn.Linear(5, 3, bias=False)
    lr, kappa = 0.1, 1e-6
    opt = Eva(layer.parameters(), model=layer, lr=lr, damping=1e-3, kl_clip=kappa, factor_decay=1.0, exclude=())
    x = torch.randn(8, 5)
    w0 = layer.weight.detach().clone()
    out = layer(x)
    out.retain_grad()
    out.pow(2).sum().backward()
    grad = layer.weight.grad.clone()
    v = opt.precondition(grad, x.mean(0), out.grad.mean(0))
    opt.step()
    applied = (w0 - layer.weight.detach()) / lr
    nu = float((applied * v).sum() / (v * v).sum())
    torch.testing.assert_close(applied, nu * v, atol=1e-7, rtol=1e-4)  # a scaled copy of V
    assert 0 < nu < 1  # clipping active
    assert abs(lr**2 * nu**2 * float((v * grad).sum()) - kappa) < 1e-3 * kappa


@pytest.mark.parametrize("base, kwargs", [("sgd", {"lr": 0.05, "momentum": 0.9}), ("adamw", {"lr": 1e-3})])
def test_infinite_damping_gives_back_the_wrapped_optimizer(base, kwargs):
    """γ -> ∞ makes the curvature term vanish: V = ∇ / γ, which kl_clip=0 rescales to the raw gradient's norm."""
    ref, model = tiny_llama(seed=0), tiny_llama(seed=0)
    ref_opt = (torch.optim.SGD if base == "sgd" else torch.optim.AdamW)(ref.parameters(), **kwargs)
    opt = Eva(model.parameters(), model=model, base_optimizer=base, damping=1e12, kl_clip=0.0, **kwargs)
    assert len(opt.layers) > 0
    for step in range(4):
        for m, o in ((ref, ref_opt), (model, opt)):
            m(**random_batch(seed=step)).loss.backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)


def test_checkpoint_resume_is_exact(tmp_path):
    def make():
        model = tiny_llama(seed=0)
        return model, Eva(model.parameters(), model=model, base_optimizer="adamw", lr=1e-3, update_interval=2)

    def run(model, opt, steps):
        losses = []
        for step in steps:
            loss = model(**random_batch(seed=step)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    model, opt = make()
    run(model, opt, range(3))
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    straight = run(model, opt, range(3, 7))
    model2, opt2 = make()
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    assert opt2.steps == 3 and opt2.extra_memory_bytes() == opt.extra_memory_bytes() > 0
    assert run(model2, opt2, range(3, 7)) == straight


def test_preconditions_peft_adapter_layers():
    """peft's LoRA adapters are nn.Linear layers: Eva preconditions them and leaves the frozen base alone."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_llama(seed=0), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    opt = Eva([p for p in model.parameters() if p.requires_grad], model=model, lr=0.1)
    names = [layer.name for layer in opt.layers]
    assert len(names) == 2 * 2 * 2 and all("lora_A" in n or "lora_B" in n for n in names), names
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(**random_batch()).loss.backward()
    opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(before[n], p) != p.requires_grad, n  # adapters move, the base does not


def _watch_and_randomize(model, module) -> dict:
    """Record ``module``'s input and output (its gradient retained) at each forward, and give the trainable
    parameters small random values (nonzero adapters, so no step is trivially zero)."""
    seen = {}

    def keep(m, i, o):
        o.retain_grad()
        seen.update(x=i[0].detach(), out=o)

    module.register_forward_hook(keep)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.02)
    return seen


def test_preconditions_lorafa_adapters_with_their_own_input():
    """LoRA-FA's trainable B sees A x (A frozen) and the layer's output gradient times the scaling s: Eva's update of B
    equals the dense Kronecker inverse built from those vectors."""
    from peft import get_peft_model

    from hf_dtrain import LoraFAConfig

    model = get_peft_model(tiny_llama(seed=0), LoraFAConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_seed=0))
    opt = Eva([p for p in model.parameters() if p.requires_grad], model=model, lr=0.1, kl_clip=1e9, factor_decay=1.0)
    assert len(opt.layers) == 2 and all("lorafa_B" in layer.name for layer in opt.layers)
    layer = opt.layers[0]
    module = layer.module
    seen = _watch_and_randomize(model, module)
    model(**random_batch()).loss.backward()
    b = layer.weight
    b0, grad = b.detach().clone().double(), b.grad.detach().clone().double()
    opt.step()
    s = module.scaling["default"]
    a = module.lorafa_A["default"].double() @ seen["x"].reshape(-1, seen["x"].shape[-1]).double().mean(0)
    torch.testing.assert_close(layer.a.double(), a, atol=1e-6, rtol=1e-5)
    g = s * seen["out"].grad.reshape(-1, seen["out"].shape[-1]).double().mean(0)  # s x the mean output gradient
    torch.testing.assert_close(layer.g.double(), g, atol=1e-7, rtol=1e-5)
    fisher = torch.kron(torch.outer(a, a), torch.outer(g, g))
    vec = grad.T.reshape(-1)
    v = torch.linalg.solve(fisher + 0.03 * torch.eye(vec.numel(), dtype=torch.float64), vec).reshape(a.numel(), -1).T
    torch.testing.assert_close(b.detach().double(), b0 - 0.1 * v, atol=1e-5, rtol=1e-5)
    assert s == 2.0 and float(g.norm()) > 0


def _smt_dense_reference(method, grad_blocks, idx, bs, a, g, out_f, in_f, gamma):
    """The dense computation: the curvature of the full matrix (Eva: (ā āᵀ) ⊗ (ḡ ḡᵀ); FOOF: (ā āᵀ) ⊗ I) restricted to
    the entries of the selected blocks, damped and inverted as a matrix, applied to those entries' gradient."""
    rows = [(int(r) * bs + i, int(c) * bs + j) for r, c in idx.tolist() for i in range(bs) for j in range(bs)]
    pos = torch.tensor([j * out_f + i for i, j in rows])  # column-major vec index of entry (i, j)
    full = torch.kron(torch.outer(a, a), torch.outer(g, g) if method == "eva" else torch.eye(out_f, dtype=a.dtype))
    fisher = full[pos][:, pos]
    vec = grad_blocks.reshape(-1)  # (k, i, j) order matches ``rows``
    v = torch.linalg.solve(fisher + gamma * torch.eye(len(pos), dtype=a.dtype), vec)
    return v.reshape(grad_blocks.shape)


@pytest.mark.parametrize("method", ["eva", "foof"])
def test_preconditions_smt_blocks_with_the_restricted_curvature(method):
    """SMT's trainable delta blocks see the layer's input and output gradient: Eva's update of the blocks equals the
    dense inverse of the matrix's curvature restricted to the selected entries (two blocks share a block row, so FOOF
    couples them), and the live parameter is followed when the blocks are (re)selected."""
    from peft import get_peft_model

    from hf_dtrain import SMTConfig, set_smt_block_indices

    key = "model.layers.0.self_attn.q_proj"
    model = get_peft_model(
        tiny_llama(seed=0), SMTConfig(block_size=16, target_modules=["q_proj"], block_indices={key: [[0, 0]]})
    )
    gamma = 0.03  # the paper's damping
    opt = Eva(
        [p for p in model.parameters() if p.requires_grad],
        model=model,
        lr=0.1,
        kl_clip=1e9,
        factor_decay=1.0,
        method=method,
        damping=gamma,
    )
    assert [layer.name.endswith("smt_weight.default") for layer in opt.layers] == [True, True]
    # the selection replaces the block parameters; Eva (through the optimizer swap) follows them
    set_smt_block_indices(model, {key: [[0, 0], [0, 2], [3, 1]]}, optimizer=opt)
    layer = next(layer for layer in opt.layers if key in layer.name)
    module = layer.module
    seen = _watch_and_randomize(model, module)
    loss = model(**random_batch()).loss
    # plus a term whose output gradient is the same at every token, so the gradient has a large component along
    # ḡ āᵀ (the LM loss alone gives a nearly orthogonal one and the curvature term would hardly show)
    c = torch.randn(module.out_features, generator=torch.Generator().manual_seed(1))
    (loss + seen["out"].mean((0, 1)) @ c).backward()
    blocks = module.smt_weight["default"]
    assert blocks.shape[0] == 3 and layer.weight is blocks
    b0, grad = blocks.detach().clone().double(), blocks.grad.detach().clone().double()
    opt.step()
    a = seen["x"].reshape(-1, seen["x"].shape[-1]).double().mean(0)
    g = seen["out"].grad.reshape(-1, seen["out"].shape[-1]).double().mean(0)
    v = _smt_dense_reference(
        method, grad, module.smt_indices["default"], 16, a, g, module.out_features, module.in_features, gamma
    )
    step = b0 - blocks.detach().double()
    torch.testing.assert_close(step, 0.1 * v, atol=1e-5 * float(step.abs().max()), rtol=1e-5)
    # the curvature term is not negligible: the step is far from plain gradient / damping
    assert float((v - grad / gamma).norm() / (grad / gamma).norm()) > 0.05


def test_bad_hyperparameters():
    model = nn.Linear(3, 3)
    with pytest.raises(ValueError, match=r"damping must be a number > 0 \(the paper uses 0.03\)"):
        Eva(model.parameters(), model=model, damping=-1.0, exclude=())
    with pytest.raises(ValueError, match=r"update_interval must be an integer >= 1"):
        Eva(model.parameters(), model=model, update_interval=0, exclude=())
    with pytest.raises(ValueError, match=r"kl_clip must be a number >= 0 \(0.001 in the paper"):
        Eva(model.parameters(), model=model, kl_clip=-0.1, exclude=())
    with pytest.raises(ValueError, match=r"method='shampoo' is unknown; set eva.method to one of eva, foof"):
        Eva(model.parameters(), model=model, method="shampoo", exclude=())
    with pytest.raises(ValueError, match=r"base_optimizer='lion' is unknown"):
        Eva(model.parameters(), model=model, base_optimizer="lion", exclude=())
    with pytest.raises(ValueError, match=r"found no trainable nn.Linear"):
        emb = nn.Embedding(3, 3)
        Eva(emb.parameters(), model=emb)
    with pytest.raises(TypeError, match=r"Eva needs the model"):
        Eva(model.parameters(), model="model")


def _ddp_rank(rank, world):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(tiny_llama(seed=0))
    opt = Eva(model.parameters(), model=model, base_optimizer="sgd", lr=0.1, momentum=0.9)
    for step in range(3):
        model(**random_batch(seed=10 * step + rank)).loss.backward()  # different data on every rank
        opt.step()
        opt.zero_grad()
    vectors = torch.cat([torch.cat([layer.a, layer.g]) for layer in opt.layers])
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for t in (vectors, flat):
        gathered = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(gathered, t)
        assert all(torch.equal(gathered[0], x) for x in gathered)  # averaged vectors, identical replicas


@pytest.mark.parametrize("world", [2, 3])
def test_data_parallel_ranks_precondition_identically(world):
    run_distributed(_ddp_rank, world_size=world, timeout=180)


def _fsdp_rank(rank, world, out, methods, replicate):
    """For each method: Eva on DDP, then on FSDP2 (row shards of every gradient), from the same model and the same
    per-rank data; then Eva on SMT blocks under FSDP2 (refused)."""
    import json

    from peft import get_peft_model
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_dtrain import SMTConfig
    from hf_dtrain.parallel import FSDPConfig, apply_fsdp, full_state_dict

    results = {}
    for method in methods:
        runs = {}
        for engine in ("ddp", "fsdp2"):
            model = tiny_llama(seed=0)
            if engine == "ddp":
                model = DDP(model)
            else:
                apply_fsdp(model, FSDPConfig(replicate=replicate))
            opt = Eva(model.parameters(), model=model, base_optimizer="adamw", lr=1e-2, method=method)
            losses = []
            for step in range(5):
                loss = model(**random_batch(seed=1000 + 10 * (step % 2) + rank)).loss  # two batches a rank
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(mean_over_ranks(loss.item()))
            state = full_state_dict(model) if engine == "fsdp2" else dict(model.module.state_dict())
            runs[engine] = (losses, state)
        (ddp_losses, ddp_state), (fsdp_losses, fsdp_state) = runs["ddp"], runs["fsdp2"]
        if rank == 0:
            err = max(float((fsdp_state[k] - v).abs().max()) for k, v in ddp_state.items())
            results[method] = {"ddp": ddp_losses, "fsdp2": fsdp_losses, "max_param_diff": err}
    smt = get_peft_model(
        tiny_llama(seed=0),
        SMTConfig(
            block_size=16,
            target_modules=["q_proj"],
            block_indices={"model.layers.0.self_attn.q_proj": [[0, 0], [0, 1]]},
        ),
    )
    apply_fsdp(smt, FSDPConfig(replicate=replicate))
    try:
        Eva(smt.parameters(), model=smt)
        results["smt"] = None
    except ValueError as e:
        results["smt"] = str(e)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


@pytest.mark.parametrize("methods, world, replicate", [(["eva", "foof"], 2, 1), (["eva"], 4, 2)])
def test_fsdp2_row_shards_are_preconditioned_as_the_whole_matrices(tmp_path, methods, world, replicate):
    """Eva's scalar and the KL clip are sums over whole matrices: on FSDP2's row shards (and HSDP's 2x2 mesh) each
    rank adds its rows and one all-reduce completes them, so the run equals Eva on DDP with the same data (FOOF
    acts on each row alone)."""
    import json

    run_distributed(_fsdp_rank, world_size=world, args=(str(tmp_path / "r.json"), methods, replicate), timeout=300)
    results = json.loads((tmp_path / "r.json").read_text())
    for method in methods:
        r = results[method]
        torch.testing.assert_close(torch.tensor(r["fsdp2"]), torch.tensor(r["ddp"]), rtol=1e-5, atol=0, msg=method)
        assert r["ddp"][-1] < r["ddp"][0]
        assert r["max_param_diff"] < 1e-5
    assert "holds SMT blocks sharded by FSDP2" in results["smt"]  # refused before any step, with the reason
