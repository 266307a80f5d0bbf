"""The engines under mixed precision: DELTA's recompute and offload stay exact under bf16/fp16 autocast, Eva's
preconditioner trains under it, and a snapshot keeps a ``GradScaler``'s state so an fp16 run resumes exactly."""

import pytest
import torch

from hf_dtrain.testing import random_batch, tiny_llama

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


@DTYPES
def test_delta_is_exact_under_autocast(dtype):
    from hf_dtrain.memory import apply_delta

    model, ref = tiny_llama(seed=0, hidden_size=64), tiny_llama(seed=0, hidden_size=64)
    scheduler = apply_delta(model, 0.5)
    for step in range(3):  # the first step profiles, the next ones run the plan
        batch = random_batch(batch=2, seq=8, seed=step)
        with torch.autocast("cpu", dtype=dtype):
            loss, want = model(**batch).loss, ref(**batch).loss
        loss.backward()
        want.backward()
        assert loss.item() == want.item()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), n
    assert any(any(a != "keep" for a in plan.actions) for plan in scheduler.plans.values())
    scheduler.remove()


@DTYPES
def test_eva_trains_under_autocast(dtype):
    from hf_dtrain.optim import Eva

    model = tiny_llama(seed=0, hidden_size=64)
    opt = Eva(model.parameters(), model=model, base_optimizer="adamw", lr=3e-3)
    batch = random_batch(batch=4, seq=8, seed=0)
    losses = []
    for _ in range(5):
        with torch.autocast("cpu", dtype=dtype):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(p).all() for p in model.parameters()) and losses[-1] < losses[0]


def test_a_snapshot_keeps_the_grad_scaler_and_an_fp16_run_resumes_exactly(tmp_path):
    from hf_dtrain.fault import SnapshotEngine
    from hf_dtrain.testing import stop_snapshot_processes

    def setup():
        torch.manual_seed(0)
        model = tiny_llama(seed=0, hidden_size=32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, opt, torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)

    def run(model, opt, scaler, engine, first, last):
        losses = []
        for step in range(first, last + 1):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**random_batch(batch=2, seq=8, seed=step)).loss
            scaler.scale(loss).backward()
            engine.wait()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.item())
            engine.snapshot(step, extra={"next_step": step + 1})
        engine.wait()
        return losses

    ft, ft_ref = str(tmp_path / "ft"), str(tmp_path / "ref")
    try:
        model, opt, scaler = setup()
        engine = SnapshotEngine(model, opt, scaler=scaler, directory=ft_ref, parity=0)
        reference = run(model, opt, scaler, engine, 1, 6)  # uninterrupted
        engine.close(shutdown=True)
        model, opt, scaler = setup()
        engine = SnapshotEngine(model, opt, scaler=scaler, directory=ft, parity=0)
        run(model, opt, scaler, engine, 1, 3)
        scale, state = scaler.get_scale(), scaler.state_dict()
        engine.close()  # the trainer dies; its snapshot process keeps step 3
        model2, opt2, scaler2 = setup()
        engine2 = SnapshotEngine(model2, opt2, scaler=scaler2, directory=ft, parity=0)
        assert engine2.restore().step == 3
        assert scaler2.get_scale() == scale and scaler2.state_dict() == state and scale != 2.0**16
        assert run(model2, opt2, scaler2, engine2, 4, 6) == reference[3:]  # fp16 steps after the restore, exactly
        engine2.close(shutdown=True)
    finally:
        stop_snapshot_processes(ft)
        stop_snapshot_processes(ft_ref)
