"""ACP-SGD as a DDP communication hook, on 2 and 3 gloo ranks: the error-feedback identity, identical replicas,
byte counts against the formula, and clear errors instead of hangs."""

import json

import pytest
import torch

from hf_dtrain.testing import mean_over_ranks, random_batch, run_distributed, tiny_llama, train_on_loader

STEPS, START = 9, 3


def _ddp_model():
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(tiny_llama(seed=0))


def _acp_rank(rank, world, out_dir, rank_r):
    import torch.distributed as dist

    from hf_dtrain.comm import ACPSGDState, acp_sgd_hook, acp_sgd_step_bytes, register

    model = _ddp_model()
    state = register(model, {"method": "acp_sgd", "rank": rank_r, "start_iter": START})
    assert isinstance(state, ACPSGDState)
    # DDP takes one hook per model: a second, identical model gets acp_sgd_hook wrapped in a recorder of the local
    # gradient going in and the averaged gradient coming out, per bucket tensor, over the compressed steps.
    sums_local, sums_applied, calls = {}, {}, [0]

    def recording_hook(st, bucket):
        calls[0] += 1
        compressing = st.iter >= st.start_iter
        local = [g.detach().clone() for g in bucket.gradients()]
        fut = acp_sgd_hook(st, bucket)

        def record(f):
            for k, (before, after, param) in enumerate(zip(local, bucket.gradients(), bucket.parameters())):
                key = st.tensor_key(bucket, k, param)
                if compressing:
                    sums_local[key] = sums_local.get(key, 0) + before
                    sums_applied[key] = sums_applied.get(key, 0) + after.detach().clone()
            return f.value()

        return fut.then(record)

    from torch.nn.parallel import DistributedDataParallel as DDP

    model2 = DDP(tiny_llama(seed=0))
    state2 = ACPSGDState(rank=rank_r, start_iter=START)
    state2.param_names = {id(p): n for n, p in model2.module.named_parameters()}
    model2.register_comm_hook(state2, recording_hook)
    for m in (model, model2):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        for step in range(STEPS):
            loss = m(**random_batch(seed=1000 * rank + step)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert state.iter == STEPS and len(state.stats.steps) == STEPS and calls[0] > 0

    # 1. error feedback: sum of applied averaged gradients = average of the summed local gradients - average final E
    for key, applied in sorted(sums_applied.items()):
        local = sums_local[key].clone()
        dist.all_reduce(local)
        local /= world
        if key in state2.tensors:
            err = state2.tensors[key].error.clone()
            dist.all_reduce(err)
            expected = local - (err / world).view_as(local)
        else:
            expected = local  # uncompressed tensors are averaged exactly every step
        torch.testing.assert_close(applied, expected, atol=2e-5, rtol=1e-4)
    assert state2.tensors and set(state2.tensors) <= set(sums_applied)  # keyed by parameter name

    # 2. replicas identical on every rank (the same averaged gradient everywhere)
    for m in (model, model2):
        flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        assert all(torch.equal(gathered[0], g) for g in gathered)

    # 3. bytes per step: dense warm-up, then the alternating P / Q factors, counted here from the shapes (not with
    # the hook's own compresses() / acp_sgd_step_bytes): an n x m gradient with n m >= 2 (n + m) r sends P (n x r) on
    # even steps and Q (m x r) on odd ones, anything else goes dense; float32
    def counted(even):
        total = 0
        for p in model.module.parameters():
            n, m = (p.shape[0], p.numel() // p.shape[0]) if p.dim() >= 2 else (None, None)
            if n is not None and n * m >= 2.0 * (n + m) * rank_r:
                total += (n if even else m) * rank_r
            else:
                total += p.numel()
        return 4 * total

    dense = sum(p.numel() for p in model.parameters()) * 4
    expected = [dense] * START + [counted((t - START) % 2 == 0) for t in range(START, STEPS)]
    assert state.stats.steps == expected, (state.stats.steps, expected)
    assert expected[START:] == [
        acp_sgd_step_bytes(state, [(n, p.shape) for n, p in model.module.named_parameters()], even=(t - START) % 2 == 0)
        for t in range(START, STEPS)
    ]
    if rank == 0:
        with open(f"{out_dir}/bytes.json", "w") as f:
            json.dump({"steps": state.stats.steps, "dense": dense}, f)


@pytest.mark.smoke
@pytest.mark.parametrize("world", [2, 3])
def test_acp_sgd_error_feedback_identity_replicas_and_bytes(tmp_path, world):
    run_distributed(_acp_rank, world_size=world, args=(str(tmp_path), 4), timeout=240)
    steps = json.load(open(tmp_path / "bytes.json"))
    # compressed steps send far less than the dense all-reduce: on this tiny model about an order of magnitude
    assert max(steps["steps"][START:]) < steps["dense"] / 4


def _bad_rank(rank, world, case):
    from hf_dtrain.comm import register

    model = _ddp_model()
    if case == "rank_too_large":
        with pytest.raises(
            ValueError, match=r"ACP-SGD rank=65 exceeds min\(128, 64\) of 'model.embed_tokens.weight'.*use rank <= 64"
        ):
            register(model, {"rank": 65, "min_compression_rate": 0})
    elif case == "mismatch":
        with pytest.raises(ValueError, match=r"comm hook config differs across ranks.*same recipe"):
            register(model, {"rank": 4 + rank})
    elif case == "world_one":
        with pytest.raises(ValueError, match=r"world of >= 2 processes; this one has 1"):
            register(model, "acp_sgd")


@pytest.mark.parametrize("case, world", [("rank_too_large", 2), ("mismatch", 2), ("world_one", 1)])
def test_bad_input_is_a_clear_error_not_a_hang(case, world):
    run_distributed(_bad_rank, world_size=world, args=(case,), timeout=120, pg_timeout_s=30)


def test_unwrapped_model_and_bad_config():
    from hf_dtrain.comm import CommHookConfig, register

    with pytest.raises(TypeError, match=r"needs the DistributedDataParallel model that accelerator.prepare"):
        register(tiny_llama(), "acp_sgd")
    with pytest.raises(
        ValueError,
        match=r"method='topk' is unknown; set comm_hook.method \(--comm-hook\) to one of "
        r"allreduce, bf16, fp16, acp_sgd",
    ):
        CommHookConfig(method="topk")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['rnak'\]"):
        CommHookConfig.from_any({"rnak": 4})
    from hf_dtrain.comm import ACPSGDState

    with pytest.raises(ValueError, match=r"start_iter must be an integer >= 2"):
        ACPSGDState(start_iter=1)


@pytest.mark.slow
def test_accelerate_way_in_registers_on_the_prepared_model(tmp_path, tiny_base):
    """recipes/comm_hooks_accelerate.py under accelerate launch (2 gloo processes): the hook runs every step, the
    replicas end identical, and compressed steps send a fraction of the warm-up's dense bytes."""
    from hf_dtrain.testing import accelerate_launch

    base = tiny_base(50)
    hook_yaml = tmp_path / "hook.yaml"  # the method's settings as a YAML recipe (recipes/comm_acp_sgd.yaml's shape)
    hook_yaml.write_text("comm_hook:\n  method: acp_sgd\n  rank: 4\n  start_iter: 4\n")
    accelerate_launch(
        "recipes/comm_hooks_accelerate.py",
        "--model",
        base,
        "--steps",
        "12",
        "--hook-config",
        str(hook_yaml),
        "--out",
        str(tmp_path / "out"),
    )
    reports = [json.load(open(tmp_path / "out" / f"comm_{r}.json")) for r in range(2)]
    assert all(r["world_size"] == 2 and r["hook_steps"] == r["steps"] == 12 for r in reports)
    assert reports[0]["param_checksum"] == reports[1]["param_checksum"]
    sent = reports[0]["bytes_per_step"]
    assert len(set(sent[:4])) == 1 and max(sent[4:]) < sent[0] / 4


CONV_STEPS, CONV_RANK, CONV_LR = 150, 8, 5e-4


def _convergence_rank(rank, world, base, out_dir):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    import hf_dtrain.comm as comm
    from hf_dtrain import tasks
    from hf_dtrain.models import load_model_and_tokenizer

    final = {}
    for method in ("allreduce", "acp_sgd"):
        torch.manual_seed(0)
        model, tok = load_model_and_tokenizer(base, progress=False)
        ddp = DDP(model)
        state = comm.register(ddp, {"method": method, "rank": CONV_RANK, "start_iter": 10})
        data = tasks.make_task_dataset(tok, CONV_STEPS * 16, seed=100 + rank, split="train", digits=2)
        loader = DataLoader(data, batch_size=16, collate_fn=tasks.task_collator(tok))
        opt = torch.optim.AdamW(ddp.parameters(), lr=CONV_LR)
        losses = train_on_loader(ddp, opt, loader)
        final[method] = mean_over_ranks(sum(losses[-20:]) / 20)  # both ranks' batches, the last 20 steps
        final[method + "_bytes"] = state.stats.steps[-1]
        del ddp, opt
    if rank == 0:
        with open(f"{out_dir}/convergence.json", "w") as f:
            json.dump(final, f)


@pytest.mark.slow
def test_acp_sgd_with_error_feedback_converges_within_5pct_of_dense(tmp_path, tiny_base):
    """Full fine-tuning of the (test-size) default model, 2 ranks, 150 AdamW steps: ACP-SGD at rank 8 with error
    feedback ends within 5% of the dense all-reduce's training loss while sending a small fraction of its bytes.
    (Rank 4 on the same run: about 6% above dense; docs/comm.md has the measured figures.)"""
    base = tiny_base(200)
    run_distributed(_convergence_rank, world_size=2, args=(base, str(tmp_path)), timeout=600, pg_timeout_s=300)
    r = json.load(open(tmp_path / "convergence.json"))
    assert r["acp_sgd"] <= 1.05 * r["allreduce"], r
    assert r["acp_sgd_bytes"] < r["allreduce_bytes"] / 5, r


def test_step_bytes_formula_against_hand_counted_bytes():
    """acp_sgd_step_bytes on shapes counted by hand (rank 4, min_compression_rate 2, float32):
    64x64: 4096 >= 2*128*4 = 1024, compressed, P 64*4 = 256 / Q 256; 128x64: 8192 >= 1536, P 512 / Q 256;
    a bias of 64 and an 8x8 matrix (64 < 2*16*4 = 128) go dense, 64 each."""
    from hf_dtrain.comm import ACPSGDState, acp_sgd_step_bytes

    shapes = [("a", (64, 64)), ("b", (128, 64)), ("bias", (64,)), ("small", (8, 8))]
    state = ACPSGDState(rank=4)
    assert acp_sgd_step_bytes(state, shapes, even=True) == (256 + 512 + 64 + 64) * 4 == 3584
    assert acp_sgd_step_bytes(state, shapes, even=False) == (256 + 256 + 64 + 64) * 4 == 2560
    assert acp_sgd_step_bytes(state, [("conv", (16, 4, 3, 3))], even=False) == 36 * 4 * 4  # 16 x 36: Q is 36 x 4
