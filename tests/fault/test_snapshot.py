"""The snapshot engine on one process (its snapshot process still a separate one): exact state back, a corrupted
byte caught, another world size or model refused, PEFT stores only trainable state, the slot is a safetensors file,
and the sockets, key and memory are private."""

import json
import mmap
import os
import stat

import numpy as np
import pytest
import torch

from hf_dtrain.fault import SnapshotEngine
from hf_dtrain.fault.ranks import Ranks
from hf_dtrain.fault.state import Layout, flatten_state, parse, unflatten_state
from hf_dtrain.testing import random_batch, run_distributed, tiny_llama


def _setup(hidden=64):
    model = tiny_llama(seed=0, hidden_size=hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (k + 1))
    return model, opt, sched


def _steps(model, opt, sched, engine, first, last, snapshot=True):
    losses = []
    for step in range(first, last + 1):
        seed = int(torch.randint(0, 1 << 20, (1,)))
        loss = model(**random_batch(batch=2, seq=16, seed=seed)).loss
        loss.backward()
        engine.wait()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
        if snapshot:
            engine.snapshot(step, extra={"next_step": step + 1, "epoch": np.int64(0)})
    engine.wait()
    return losses


def test_restore_is_exact_and_a_corrupted_byte_is_caught(ft_dir, caplog):
    torch.manual_seed(0)
    model, opt, sched = _setup()
    engine = SnapshotEngine(model, opt, sched, directory=ft_dir, parity=0)
    assert engine.restore() is None  # a fresh start
    _steps(model, opt, sched, engine, 1, 4)
    _steps(model, opt, sched, engine, 5, 7)
    engine.close()

    # a restarted trainer: state after step 7 comes back, then steps 8.. are what the first run would do
    model2, opt2, sched2 = _setup()
    engine2 = SnapshotEngine(model2, opt2, sched2, directory=ft_dir, parity=0)
    restored = engine2.restore()
    assert (restored.step, restored.source, restored.extra) == (7, "memory", {"next_step": 8, "epoch": 0})
    for (n, p), (_, q) in zip(model.named_parameters(), model2.named_parameters()):
        assert torch.equal(p, q), n
    assert sched2.state_dict()["last_epoch"] == 7 and opt2.state_dict()["state"][0]["step"] == 7
    engine2.close()

    # flip one byte of the newest slot: the checksum catches it and the step before is used
    model3, opt3, sched3 = _setup()
    engine3 = SnapshotEngine(model3, opt3, sched3, directory=ft_dir, parity=0)
    reply, fd = engine3.client.call({"op": "open", "rank": 0, "step": 7, "pid": os.getpid()}, want_fd=True)
    with mmap.mmap(fd, reply["size"]) as m:
        m[reply["manifest"]["nbytes"] - 100] ^= 0xFF
    os.close(fd)
    with caplog.at_level("ERROR"):
        restored = engine3.restore()
    assert restored.step == 6 and restored.source == "memory"
    assert "fails its checksum" in caplog.text
    engine3.close(shutdown=True)


@pytest.mark.smoke
def test_restored_run_continues_bit_for_bit(ft_dir):
    torch.manual_seed(0)
    model, opt, sched = _setup()
    engine = SnapshotEngine(model, opt, sched, directory=ft_dir, parity=0)
    _steps(model, opt, sched, engine, 1, 3)
    expected = _steps(model, opt, sched, engine, 4, 6, snapshot=False)  # then the trainer dies
    engine.close()
    model2, opt2, sched2 = _setup()
    torch.manual_seed(999)  # a restarted process has other RNG states: the snapshot's must win
    engine2 = SnapshotEngine(model2, opt2, sched2, directory=ft_dir, parity=0)
    assert engine2.restore().step == 3
    assert _steps(model2, opt2, sched2, engine2, 4, 6) == expected
    engine2.close(shutdown=True)


def _snapshot_two_ranks(rank, world, ft_dir):
    model, opt, sched = _setup()
    engine = SnapshotEngine(model, opt, sched, directory=ft_dir, parity=1)
    _steps(model, opt, sched, engine, 1, 2)
    engine.close()


def test_another_world_size_or_model_is_refused(ft_dir):
    run_distributed(_snapshot_two_ranks, world_size=2, args=(ft_dir,), timeout=240)
    model, opt, sched = _setup()
    engine = SnapshotEngine(model, opt, sched, directory=ft_dir, parity=0)  # world size 1, node 0's process
    with pytest.raises(
        ValueError,
        match=r"taken on 2 ranks and this run has 1; in-memory snapshots load only "
        r"into the world size and layout that took them.*persist_every",
    ):
        engine.restore()
    engine.close()
    os.environ["HF_DTRAIN_NODE_RANK"] = "0"
    try:
        model, opt, sched = _setup(hidden=96)
        other = SnapshotEngine(model, opt, sched, directory=ft_dir, parity=0)
        other.ranks.world = 2  # past the world-size check, to reach the model check
        with pytest.raises(ValueError, match=r"belongs to another job: .*parameters: .*fresh-start true"):
            other.restore()
        other.close(shutdown=True)
    finally:
        del os.environ["HF_DTRAIN_NODE_RANK"]


def test_another_layout_is_the_same_job_resharded_or_refused_naming_the_layout(ft_dir):
    """Snapshots taken with another placement (a job's layout settings) are not another job's: without a persisted
    copy to reshard from, the restore is refused naming the layout that differs and ``persist_every``; with the
    same placement they restore from memory."""
    torch.manual_seed(0)
    model, opt, sched = _setup()
    engine = SnapshotEngine(model, opt, sched, directory=ft_dir, parity=0, placement={"degrees": {"tp": 2}})
    _steps(model, opt, sched, engine, 1, 2)
    engine.close()
    other = SnapshotEngine(*_setup(), directory=ft_dir, parity=0, placement={"degrees": {"tp": 1}})
    with pytest.raises(
        ValueError,
        match=r"taken on 1 ranks in another layout \(degrees\.tp: 2 there, 1 here\) and this run has "
        r"1; .*world size and layout that took them.*persist_every",
    ):
        other.restore()
    other.close()
    same = SnapshotEngine(*_setup(), directory=ft_dir, parity=0, placement={"degrees": {"tp": 2}})
    restored = same.restore()
    assert (restored.step, restored.source) == (2, "memory")
    same.close(shutdown=True)


def test_peft_stores_only_the_adapter(ft_dir):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(seed=0), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    engine = SnapshotEngine(model, opt, directory=ft_dir, parity=0)
    assert engine.trainable_only
    _steps(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0), engine, 1, 1)
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() * 4 for p in model.parameters())
    assert engine.stats["bytes"] < 3 * trainable + 64 * 1024 < total  # adapter + AdamW moments + header
    engine.close(shutdown=True)


def test_a_model_layout_is_a_module_source_loading_in_place_with_the_fingerprint_of_older_copies():
    """What a snapshot holds of a model (``source.py``): its tensors, or with a frozen base only the trainable ones;
    loaded back in place; a tensor the model lacks named; and the fingerprint entries in the format copies persisted
    before the layout sources were written in (name, global shape, dtype, placement), so those still load."""
    from peft import LoraConfig, get_peft_model

    from hf_dtrain.fault.source import ModuleSource, source_for

    model = tiny_llama(seed=0)
    source = source_for(model, torch.optim.AdamW(model.parameters()))
    assert isinstance(source, ModuleSource) and not source.trainable_only
    assert source.describe() == [f"{n}:{tuple(t.shape)}:{t.dtype}:None" for n, t in model.state_dict().items()]
    state = {"model": {k: v.clone() for k, v in source.capture()["model"].items()}}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert source.check(state) is None
    source.load(state)
    assert all(torch.equal(v, state["model"][k]) for k, v in model.state_dict().items())
    why = source.check({"model": {**state["model"], "lm_head.extra": torch.zeros(1)}})
    assert why is not None and "lm_head.extra" in why
    peft = get_peft_model(tiny_llama(seed=0), LoraConfig(r=4, target_modules=["q_proj"]))
    adapter = source_for(peft)
    assert adapter.trainable_only and set(adapter.capture()["model"]) == {
        n for n, p in peft.named_parameters() if p.requires_grad
    }


def test_state_round_trip_and_the_slot_is_a_safetensors_file(tmp_path):
    from safetensors.torch import load_file

    state = {
        "model": {"w": torch.arange(6.0).reshape(2, 3)},
        "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "rng": (3, (1, 2, 3), None),
        "np": np.arange(4, dtype=np.uint32),
        "inf": float("inf"),
        "dtype": torch.bfloat16,
    }
    tensors = {}
    skeleton = flatten_state(state, tensors)
    layout = Layout(tensors)
    header = layout.header({"skeleton": json.dumps(skeleton)})
    buf = bytearray(layout.total_bytes)
    buf[: len(header)] = header
    meta, views = parse(buf)
    for k, t in tensors.items():
        views[k].copy_(t)
    back = unflatten_state(json.loads(meta["skeleton"]), views)
    assert back["optimizer"]["state"][0]["step"].item() == 3.0 and back["rng"] == (3, (1, 2, 3), None)
    assert back["np"].dtype == np.uint32 and back["inf"] == float("inf") and back["dtype"] is torch.bfloat16
    path = tmp_path / "slot.safetensors"
    path.write_bytes(bytes(buf))
    assert torch.equal(load_file(str(path))["state.model.w"], state["model"]["w"])
    with pytest.raises(TypeError, match=r"state.bad is a object"):
        flatten_state({"bad": object()}, {})


def test_private_directory_key_socket_and_no_shared_memory_name(ft_dir):
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    model, opt, sched = _setup()
    engine = SnapshotEngine(model, opt, sched, directory=ft_dir, parity=0)
    _steps(model, opt, sched, engine, 1, 1)
    assert stat.S_IMODE(os.stat(ft_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(ft_dir, "key")).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(engine.dir).st_mode) == 0o700
    with pytest.raises(AuthenticationError):
        Client(os.path.join(engine.dir, "smp.sock"), family="AF_UNIX", authkey=b"not the key" * 3)
    assert not [f for f in os.listdir("/dev/shm") if "hf_dtrain" in f]  # memfd: no name anyone could open
    # an authenticated request the snapshot process does not know is refused, naming what it answers
    reply, fd = engine.client.call({"op": "delete_everything", "rank": 0})
    assert fd is None and reply["error"].startswith("unknown op 'delete_everything'; the snapshot process answers ")
    assert "commit" in reply["error"] and "fetch_symbols" in reply["error"]
    assert engine.client.call({"op": "available", "rank": 0})[0]["steps"] == [1]  # and it keeps serving
    engine.close(shutdown=True)


def test_an_idle_snapshot_process_exits(tmp_path):
    """A snapshot process whose trainers never come back frees its memory after ``--idle-exit`` seconds."""
    import subprocess
    import sys

    import hf_dtrain.fault.smp as smp

    proc = subprocess.Popen(
        [sys.executable, smp.__file__, "--dir", str(tmp_path / "node0"), "--node", "0", "--idle-exit", "1"],
        stdin=subprocess.PIPE,
    )
    proc.stdin.write(os.urandom(32).hex().encode() + b"\n")
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0
    assert not (tmp_path / "node0" / "smp.sock").exists()


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="page-locked (cudaHostRegister) slots and side-stream copies need a CUDA device",
)
def test_cuda_state_snapshots_through_pinned_slots_and_restores_exactly(ft_dir):
    """A CUDA model and optimizer: the slots are page-locked, the device-to-host copies run on a side stream, and
    the restored state (on the device again) equals the state that was snapshotted, bit for bit."""

    def steps(model, opt, sched, engine, first, last):
        for step in range(first, last + 1):
            batch = {k: v.cuda() for k, v in random_batch(batch=2, seq=16, seed=step).items()}
            model(**batch).loss.backward()
            engine.wait()
            opt.step()
            sched.step()
            opt.zero_grad()
            engine.snapshot(step, extra={"next_step": step + 1})
        engine.wait()

    torch.manual_seed(0)
    model, opt, sched = _setup()
    model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (k + 1))
    engine = SnapshotEngine(model, opt, sched, directory=ft_dir, parity=0)
    steps(model, opt, sched, engine, 1, 3)
    assert engine.copier.registered, "the slots were not page-locked"
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    want_opt = opt.state_dict()["state"]
    engine.close()

    model2, _, _ = _setup()
    model2.cuda()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda k: 1.0 / (k + 1))
    engine2 = SnapshotEngine(model2, opt2, sched2, directory=ft_dir, parity=0)
    assert engine2.restore().step == 3
    for n, p in model2.named_parameters():
        assert p.is_cuda and torch.equal(p, want[n]), n
    for i, s in opt2.state_dict()["state"].items():
        assert torch.equal(s["exp_avg"].cpu(), want_opt[i]["exp_avg"].cpu())
    engine2.close(shutdown=True)


def test_the_engine_talks_over_gloo_when_the_job_group_is_nccl_only(monkeypatch):
    """Accelerate sets up NCCL alone on GPUs; the engine's collectives are small CPU tensors, which NCCL refuses (a
    GPU run failed there: "No backend type associated with device type cpu"). The engine takes a gloo group of the
    same ranks then, and the job's group as it is when it carries CPU tensors."""
    import torch.distributed as dist

    from hf_dtrain.testing import free_port, gloo_group

    with gloo_group(0, 1, port=free_port()):
        assert Ranks.control_group(None, 5.0) is None  # gloo already: the default group
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        group = Ranks.control_group(None, 5.0)
        monkeypatch.undo()
        assert group is not None and dist.get_backend(group) == "gloo"
        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        assert t.item() == 1.0


class _ByName(torch.optim.Optimizer):
    """SGD with momentum keyed by its own names, as peft's ``LoraFAOptimizer`` keys its state; ``extra``: a tensor it
    also holds that is not the model's (as that optimizer holds each layer's frozen A)."""

    def __init__(self, named, extra=None):
        names, params = [n for n, _ in named], [p for _, p in named]
        if extra is not None:
            names, params = [*names, "extra"], [*params, extra]
        super().__init__([{"params": params, "names": names}], {"lr": 1e-2})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p, name in zip(group["params"], group["names"]):
                if p.grad is not None:
                    buf = self.state[name].setdefault("momentum", torch.zeros_like(p))
                    p.sub_(group["lr"] * buf.mul_(0.9).add_(p.grad))


@pytest.mark.parametrize("foreign", [False, True], ids=["state-keyed-by-name", "holds-a-tensor-not-the-models"])
def test_an_optimizer_the_dcp_copy_cannot_place_gets_the_exact_disk_copy(ft_dir, tmp_path, caplog, foreign):
    """An optimizer whose state a copy for another world size cannot place (keyed by its own names; holding a tensor
    that is not a model parameter) still gets its disk copy, each rank's exact one, said once: the node lost, the
    restart resumes from it exactly. (It was refused before the first step, or its first write failed.)"""
    from hf_dtrain.testing import stop_snapshot_processes

    def setup():
        model = tiny_llama(seed=0)
        opt = _ByName(list(model.named_parameters()), torch.ones(3) if foreign else None)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (k + 1))

    torch.manual_seed(0)
    model, opt, sched = setup()
    disk = str(tmp_path / "disk")
    engine = SnapshotEngine(model, opt, sched, directory=ft_dir, parity=0, persist_dir=disk, persist_every=1)
    with caplog.at_level("WARNING"):
        _steps(model, opt, sched, engine, 1, 3)
        engine.close()
    assert caplog.text.count("no copy for another world size is written") == 1, caplog.text
    assert sorted(os.listdir(os.path.join(disk, "snapshot-3"))) == ["rank0.json", "rank0.safetensors"]
    stop_snapshot_processes(ft_dir)  # the node is gone with its memory
    model2, opt2, sched2 = setup()
    engine2 = SnapshotEngine(model2, opt2, sched2, directory=ft_dir, parity=0, persist_dir=disk, persist_every=1)
    restored = engine2.restore()
    assert (restored.step, restored.source) == (3, "disk")
    for (n, p), (_, q) in zip(model.named_parameters(), model2.named_parameters()):
        assert torch.equal(p, q), n
    assert opt2.state.keys() == opt.state.keys() and all(
        torch.equal(opt2.state[k]["momentum"], v["momentum"]) for k, v in opt.state.items()
    )
    engine2.close(shutdown=True)
