"""One command for a CUDA machine: run every check of hf_dtrain's GPU paths and measure the GPU figures.

    python -m hf_dtrain.testing.gpu_check                 # on a machine with a CUDA device
    python -m hf_dtrain.testing.gpu_check --cpu-dry-run   # anywhere: every step runs, on CPU where it can; each
                                                          # CUDA-only measurement is skipped with a line saying why

Steps (each runs even when an earlier one failed; the exit status is 1 if any failed):

* ``cuda_tests``: the test-suite's tests that need CUDA (pytest marker ``cuda``; they skip on CPU);
* ``tuners_autocast``: SMT, LoRA-FA, Q-BaRA, QA-HiRA and peft LoRA forward/backward on the device under bf16
  autocast against fp32 on the same device (loss and gradient agreement);
* ``bnb_4bit``: Q-BaRA on a bitsandbytes NF4 base on the device (forward/backward finite, adapter gradients);
* ``qahira_merge``: QA-HiRA on an HQQ 4-bit base on the device, merged into the zero-points: logits unchanged;
* ``comm_hooks``: every DDP communication hook on 2 processes. On one GPU NCCL refuses two ranks on the same device;
  then the hooks run over gloo with CUDA tensors and the result says so;
* ``fsdp2``: ``apply_fsdp`` on the device (one rank, NCCL on CUDA) with bf16 gathered parameters and activation
  checkpointing, full fine-tuning and every tuner, against the unsharded model under bf16 autocast;
* ``delta_memory``: DELTA at budgets 0.5 and 0.25 against no saving, full checkpointing and transformers'
  checkpointing with ``offload=True`` (peak allocated memory on CUDA, step time);
* ``snapshot_stall``: the training loop's stall per snapshot, hf_dtrain's in-memory snapshot against DCP
  ``async_save`` with pinned staging;
* ``fused_sweep``: K LoRA jobs trained fused (``hf_dtrain.fused``) against the same jobs one after another (peft
  alone, AdamW, clip 1.0) on the device: K=2 fused equals each job alone (losses), then samples/s at K = 1, 4, 8 on
  the "tiny" shape (HFTA's case: one small job leaves a GPU idle);
* ``peak_memory``: ``torch.cuda.max_memory_allocated`` of one training step, LoRA-FA against LoRA and SMT against
  full fine-tuning, on a 1B-class LLaMA shape built from ``LlamaConfig`` (nothing is downloaded);
* ``throughput``: ``benchmarks/throughput.py`` on the Llama 3.2 1B shape within a time budget: tokens/s, MFU and
  peak memory of each method against peft LoRA, eager and ``torch.compile``d (its table beside this report); each
  eager row's step also traced by ``hf_dtrain.estimate`` on fake tensors, its estimate beside the row's
  ``max_memory_allocated`` (``estimate_over_measured``; the CPU dry run holds it against the tensors' peak by the
  profiler's memory events instead);
* ``multi_gpu``: with 2 or more GPUs, 2 ranks on NCCL (one per GPU): every comm hook, 1-bit LAMB, FSDP2 against
  the unsharded model and a sharded snapshot restored in place; skipped on one GPU, saying why; the dry run runs
  the same 2 ranks over gloo.

Writes ``gpu_check.json``, ``gpu_check.md`` and ``gpu_check.png`` under ``--out/<device>/`` (default
``benchmarks/results/gpu``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from peft import LoraConfig, get_peft_model
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm.auto import tqdm
from transformers import BitsAndBytesConfig, LlamaForCausalLM

from hf_dtrain import processes
from hf_dtrain.comm import exclude_embeddings, register
from hf_dtrain.distributed.groups import release_process_group
from hf_dtrain.fault import SnapshotEngine
from hf_dtrain.fused import FusedConfig, FusedJob, FusedTrainer, fuse_adapters
from hf_dtrain.memory import apply_delta
from hf_dtrain.models import build_llama
from hf_dtrain.optim.onebit_lamb import OneBitLamb
from hf_dtrain.parallel import FSDPConfig, apply_fsdp
from hf_dtrain.quantization import prepare_bnb_4bit_for_training, quantize_model_hqq
from hf_dtrain.testing import random_batch, tiny_llama
from hf_dtrain.testing.launch import free_port
from hf_dtrain.tuners import LoraFAConfig, QAHiRAConfig, QBaRAConfig, SMTConfig

ROOT = Path(__file__).resolve().parents[2]


class Skip(Exception):
    """A step (or part of one) that cannot run here; the message says why."""


@dataclass
class Step:
    name: str
    what: str
    run: Callable[[Context], dict]


@dataclass
class Context:
    device: torch.device
    dry_run: bool
    quick: bool
    out: Path | None = None  # the report folder; the throughput table is written beside the report there
    throughput_budget: float = 200.0  # seconds the throughput step may start new (method, mode) rows on the 1B shape
    throughput_8b_budget: float = 120.0  # the same on the 8B shape, after the 1B rows (0: not run)


# ------------------------------------------------------------------------------------------------------------ steps


def cuda_tests(ctx: Context) -> dict:
    """pytest on the tests marked ``cuda`` (they skip without a CUDA device, saying why)."""
    if not (ROOT / "tests").is_dir():
        raise Skip(f"the test suite is not next to the package ({ROOT / 'tests'}): run from a source checkout")
    # only the modules that mark tests ``cuda`` are collected: collecting the whole suite imports every test module
    # (and every optional dependency they skip without), for the handful of tests this step runs
    files = sorted(str(p) for p in (ROOT / "tests").rglob("test_*.py") if "mark.cuda" in p.read_text())
    if not files:
        raise AssertionError(f"no test module under {ROOT / 'tests'} marks a test `cuda`")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "-rs", *files]
    proc = processes.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1200)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", tail)}
    if proc.returncode not in (0, 5) or counts.get("failed") or counts.get("error") or counts.get("errors"):
        raise AssertionError(f"CUDA tests failed: {tail}\n{proc.stdout[-3000:]}")
    if ctx.device.type != "cuda":
        return {"result": tail, "counts": counts, "note": "no CUDA device: the CUDA tests were collected and skipped"}
    if counts.get("skipped"):
        raise AssertionError(f"CUDA tests skipped on a CUDA machine: {tail}\n{proc.stdout[-2000:]}")
    return {"result": tail, "counts": counts}


def _tiny(device, dtype=torch.float32):
    return tiny_llama(seed=0, hidden_size=64).to(device=device, dtype=dtype)


def _tuner_configs():
    targets = ["q_proj", "v_proj"]
    return {
        "lora": lambda: LoraConfig(r=4, target_modules=targets, init_lora_weights=False),
        "smt": lambda: SMTConfig(
            block_size=16,
            target_modules=targets,
            init_weights=False,
            block_indices={
                "model.layers.0.self_attn.q_proj": [[0, 1], [2, 3]],
                "model.layers.1.self_attn.v_proj": [[1, 0]],
            },
        ),
        "lorafa": lambda: LoraFAConfig(r=4, target_modules=targets, init_weights=False),
        "qbara": lambda: QBaRAConfig(r=4, target_modules=targets, require_quantized_base=False, init_weights=False),
        "qahira": lambda: QAHiRAConfig(
            group_size=16, target_modules=targets, require_quantized_base=False, init_weights=False
        ),
    }


def tuners_autocast(ctx: Context) -> dict:
    batch = {k: v.to(ctx.device) for k, v in random_batch(batch=2, seq=16, seed=0).items()}
    out = {}
    for name, make in _tuner_configs().items():
        runs = {}
        for label, autocast in (("fp32", False), ("bf16", True)):
            torch.manual_seed(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = get_peft_model(_tiny(ctx.device), make())
            with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(**batch).loss
            loss.backward()
            grads = {n: p.grad.float().flatten() for n, p in model.named_parameters() if p.requires_grad and p.numel()}
            runs[label] = (loss.item(), grads)
        (l32, g32), (l16, g16) = runs["fp32"], runs["bf16"]
        cos = min(torch.nn.functional.cosine_similarity(g32[n], g16[n], dim=0).item() for n in g32 if g32[n].norm() > 0)
        rel = abs(l16 - l32) / abs(l32)
        if not (rel < 2e-2 and cos > 0.98):
            raise AssertionError(
                f"{name}: bf16 autocast on {ctx.device} disagrees with fp32: loss rel {rel:.3g}, "
                f"min gradient cosine {cos:.4f}"
            )
        out[name] = {"loss_rel_diff": rel, "min_grad_cosine": cos}
    return out


def bnb_4bit(ctx: Context) -> dict:
    if importlib.util.find_spec("bitsandbytes") is None:
        raise Skip("bitsandbytes is not installed (pip install 'hf-dtrain[quant]')")

    kwargs = {} if ctx.device.type == "cuda" else {"device_map": "cpu"}
    with tempfile.TemporaryDirectory() as path:
        _tiny("cpu").save_pretrained(path)
        base = LlamaForCausalLM.from_pretrained(
            path,
            quantization_config=BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
            ),
            **kwargs,
        )
    prepare_bnb_4bit_for_training(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(base, QBaRAConfig(r=4, target_modules=["q_proj", "v_proj"], init_weights=False))
    batch = {k: v.to(ctx.device) for k, v in random_batch(batch=2, seq=16, seed=0).items()}
    with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
        loss = model(**batch).loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    if not torch.isfinite(loss) or any(g is None or not torch.isfinite(g).all() for g in grads):
        raise AssertionError("Q-BaRA on an NF4 base: non-finite loss or missing adapter gradients")
    if not any(g.abs().sum() > 0 for g in grads):
        raise AssertionError("Q-BaRA on an NF4 base: every adapter gradient is zero")
    layer = next(m for m in model.modules() if type(m).__name__ == "Linear4bit")
    return {
        "loss": loss.item(),
        "base_layer": f"{type(layer).__module__}.{type(layer).__name__}",
        "device": str(layer.weight.device),
    }


def qahira_merge(ctx: Context) -> dict:
    """QA-HiRA on an HQQ 4-bit base on the device, merged into the zero-points: the merged 4-bit model's logits
    equal the adapter model's (the merge is exact up to float rounding)."""
    if importlib.util.find_spec("hqq") is None:
        raise Skip("hqq is not installed (pip install 'hf-dtrain[quant]')")
    model = _tiny(ctx.device)
    quantize_model_hqq(model, group_size=16, skip=("lm_head",))
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(
            model, QAHiRAConfig(group_size=16, target_modules=["q_proj", "v_proj", "down_proj"], init_weights=False)
        )
    batch = {k: v.to(ctx.device) for k, v in random_batch(batch=2, seq=16, seed=0).items()}
    peft_model.eval()
    with torch.no_grad():
        adapted = peft_model(**batch).logits.float()
        with peft_model.disable_adapter():
            base = peft_model(**batch).logits.float()
    merged = peft_model.merge_and_unload()
    with torch.no_grad():
        out = merged(**batch).logits.float()
    err, moved = (out - adapted).abs().max().item(), (adapted - base).abs().max().item()
    layer = merged.get_submodule("model.layers.0.self_attn.q_proj")
    if moved < 1e-3:
        raise AssertionError(f"the adapter changed nothing (max logit change {moved:.3g}): the check would be empty")
    if err > 1e-4 * max(1.0, adapted.abs().max().item()):
        raise AssertionError(
            f"merged 4-bit logits differ from the adapter's by {err:.3g} (adapter moved them {moved:.3g})"
        )
    return {
        "max_logit_diff_after_merge": err,
        "adapter_logit_change": moved,
        "merged_layer": f"{type(layer).__module__}.{type(layer).__name__}",
        "device": str(ctx.device),
    }


HOOKS = ["allreduce", "acp_sgd", "s2_reducer", "dear", "embrace"]


@contextlib.contextmanager
def _process_group(rank: int, world: int, port, backend: str, device: torch.device, seconds: int = 120):
    """This rank in a ``world``-rank group over ``backend`` (NCCL bound to ``device``), released on the way out."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group(
        backend, init_method=url, rank=rank, world_size=world, timeout=timedelta(seconds=seconds), **kwargs
    )
    try:
        yield
    finally:
        release_process_group()  # a DDP freed after its gloo group is gone can hang (pytorch/pytorch#56297)


def _hooks_worker(rank: int, world: int, port: int, backend: str, device_type: str, out: str) -> None:
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    with _process_group(rank, world, port, backend, device, seconds=60):
        _hooks_run(rank, world, backend, device, out)  # its DDP models are freed before the group is released


def _hooks_run(rank: int, world: int, backend: str, device, out: str) -> None:
    for method in HOOKS:
        model = _tiny(device)
        if method == "embrace":
            exclude_embeddings(model)
        ddp = DDP(model, device_ids=[device.index or 0] if device.type == "cuda" else None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        register(ddp, {"method": method, "start_iter": 2} if method == "acp_sgd" else method, optimizer=opt)
        for step in range(4):
            batch = {k: v.to(device) for k, v in random_batch(batch=2, seq=8, seed=step + 10 * rank).items()}
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = ddp(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        _ = ddp(**{k: v.to(device) for k, v in random_batch(batch=2, seq=8, seed=99).items()}).loss  # DeAR's last
        if not _replicas_equal(model, world):
            raise AssertionError(f"{method}: non-finite or replicas differ on {backend}/{device}")
        del ddp
    if rank == 0:
        Path(out).write_text(json.dumps({"backend": backend, "device": str(device), "hooks": HOOKS}))


def _hooks_main(port: str, backend: str, device_type: str, out: str) -> None:
    """Entry of the 2-rank hook run (in its own process, so an NCCL refusal cannot take the checker down)."""
    mp.spawn(_hooks_worker, args=(2, int(port), backend, device_type, out), nprocs=2, join=True)


def _spawn_two(main: str, backend: str, device_type: str, timeout: int = 600) -> tuple[bool, str, dict]:
    """Run ``main(port, backend, device_type, out)`` of this module (which spawns its ranks) in a process of its own,
    so an NCCL refusal cannot take the checker down: (ok, its stderr's end, the JSON it wrote to ``out``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        code = f"import sys, hf_dtrain.testing.gpu_check as g; g.{main}(*sys.argv[1:])"
        argv = [sys.executable, "-c", code, str(free_port()), backend, device_type, out]
        proc = processes.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        if proc.returncode == 0 and os.path.exists(out):
            return True, "", json.loads(Path(out).read_text())
        return False, proc.stderr[-3000:], {}


def comm_hooks(ctx: Context) -> dict:
    if ctx.device.type != "cuda":
        ok, err, info = _spawn_two("_hooks_main", "gloo", "cpu")
        if not ok:
            raise AssertionError(f"comm hooks on gloo/CPU failed:\n{err}")
        return {**info, "note": "no CUDA device: the hooks ran over gloo on CPU (bf16 autocast); NCCL not tried"}
    ok, err, info = _spawn_two("_hooks_main", "nccl", "cuda")
    if ok:
        return {**info, "nccl": "ran"}
    if torch.cuda.device_count() < 2 and ("Duplicate GPU" in err or "duplicate" in err.lower()):
        why = 'NCCL refuses two ranks on one GPU ("Duplicate GPU detected"); the hooks ran over gloo with CUDA tensors'
    elif torch.cuda.device_count() < 2:
        why = f"NCCL with two ranks on one GPU failed ({err.strip().splitlines()[-1] if err.strip() else 'no output'})"
    else:
        raise AssertionError(f"comm hooks on NCCL failed:\n{err}")
    ok, err2, info = _spawn_two("_hooks_main", "gloo", "cuda")
    if not ok:
        raise AssertionError(f"{why}; and over gloo with CUDA tensors they failed too:\n{err2}")
    return {**info, "nccl": why}


def _train_losses(model, device, steps: int = 3, autocast: bool = False) -> list[float]:
    """``steps`` AdamW steps of ``model``'s trainable parameters on seeded batches (the same on every rank), under
    bf16 autocast when asked: the losses."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for step in range(steps):
        batch = {k: v.to(device) for k, v in random_batch(batch=2, seq=16, seed=step).items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _fsdp2_worker(port: str, backend: str, device_type: str, out: str) -> None:
    """One rank: FSDP2 (``apply_fsdp``, bf16 gathered parameters, activation checkpointing) on the device, for full
    fine-tuning and each tuner, against the same model unsharded under bf16 autocast."""
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    with _process_group(0, 1, port, backend, device):
        results = {}
        configs = {"full": None, **{k: v for k, v in _tuner_configs().items() if k != "lora"}}
        for name, make in configs.items():
            losses = {}
            for sharded in (False, True):
                torch.manual_seed(0)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model = _tiny(device) if make is None else get_peft_model(_tiny(device), make())
                if sharded:
                    apply_fsdp(model, FSDPConfig(param_dtype="bf16", activation_checkpointing=True))
                losses["fsdp2" if sharded else "autocast"] = _train_losses(model, device, autocast=not sharded)
            rel = max(abs(a - b) / abs(b) for a, b in zip(losses["fsdp2"], losses["autocast"]))
            if not rel < 3e-2:
                raise AssertionError(
                    f"{name}: FSDP2 (bf16 parameters) on {device} disagrees with bf16 autocast: losses {losses}"
                )
            results[name] = {"max_loss_rel_diff": rel, **losses}
        Path(out).write_text(json.dumps({"backend": backend, "device": str(device), "methods": results}))


def fsdp2(ctx: Context) -> dict:
    """FSDP2 on the device (its CUDA streams, bf16 gathers, activation checkpointing), one rank per GPU: NCCL with
    one rank here (two ranks on one GPU are refused by NCCL; multi-GPU runs are the tests' gloo runs scaled up)."""
    backend, device_type = ("nccl", "cuda") if ctx.device.type == "cuda" else ("gloo", "cpu")
    ok, err, info = _spawn_two("_fsdp2_worker", backend, device_type, timeout=900)
    if not ok:
        raise AssertionError(f"FSDP2 on {backend}/{device_type} failed:\n{err}")
    return info


def _multi_worker(rank: int, world: int, port: int, backend: str, device_type: str, out: str) -> None:
    """One of 2 ranks, one per GPU (``cuda:<rank>``, NCCL), or on gloo/CPU in the dry run: every communication hook,
    1-bit LAMB, FSDP2 against the unsharded model, and a sharded snapshot restored in place."""
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    with _process_group(rank, world, port, backend, device):
        result = {
            "backend": backend,
            "devices": [str(torch.device(device_type, r)) if device_type == "cuda" else "cpu" for r in range(world)],
        }
        _hooks_run(rank, world, backend, device, os.devnull)
        result["comm_hooks"] = HOOKS
        result["onebit_lamb"] = _multi_onebit_lamb(rank, world, device)
        result["fsdp2"] = _multi_fsdp2(rank, world, device)
        result["snapshot"] = _multi_snapshot(rank, world, device, os.path.dirname(out))
        if rank == 0:
            Path(out).write_text(json.dumps(result))


def _replicas_equal(model, world: int) -> bool:
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    return bool(torch.isfinite(flat).all()) and all(torch.equal(gathered[0], g) for g in gathered)


def _multi_onebit_lamb(rank: int, world: int, device) -> dict:
    """1-bit LAMB on 2 ranks (its compressed exchange after a 2-step warm-up): losses finite and falling on the
    same batch, the replicas identical."""
    torch.manual_seed(0)
    model = _tiny(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    OneBitLamb.attach_ddp(ddp)  # the optimizer exchanges (compressed) itself
    opt = OneBitLamb(ddp.parameters(), lr=1e-2, freeze_step=2)
    batch = {k: v.to(device) for k, v in random_batch(batch=2, seq=16, seed=rank).items()}
    losses = []
    for _ in range(6):
        loss = ddp(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if not (all(v == v for v in losses) and losses[-1] < losses[0]):
        raise AssertionError(f"1-bit LAMB on {device}: losses {losses}")
    if not _replicas_equal(model, world):
        raise AssertionError(f"1-bit LAMB on {device}: the replicas differ")
    del ddp
    return {"losses": losses, "compressed_steps": 4}


def _multi_fsdp2(rank: int, world: int, device) -> dict:
    """FSDP2 on 2 ranks (fp32), 3 AdamW steps on the same batch on every rank: the losses equal the unsharded
    model's within fp32 reduction-order rounding."""
    losses = {}
    for sharded in (False, True):
        torch.manual_seed(0)
        model = _tiny(device)
        if sharded:
            apply_fsdp(model)
        losses["fsdp2" if sharded else "unsharded"] = _train_losses(model, device)
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses["fsdp2"], losses["unsharded"]))
    if not rel < 1e-4:
        raise AssertionError(f"FSDP2 on {world} ranks ({device}) disagrees with the unsharded model: {losses}")
    return {"max_loss_rel_diff": rel, **losses}


def _multi_snapshot(rank: int, world: int, device, tmp: str) -> dict:
    """A sharded (FSDP2) snapshot of step 2 on the device (pinned slots, the copy on a side stream), one more step,
    then ``restore()``: every rank's shards and optimizer state are back, bit for bit."""
    torch.manual_seed(0)
    model = _tiny(device)
    apply_fsdp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = SnapshotEngine(model, opt, directory=os.path.join(tmp, "snapshots"), parity=0, timeout=60)

    def step(k):
        batch = {k_: v.to(device) for k_, v in random_batch(batch=2, seq=16, seed=k).items()}
        model(**batch).loss.backward()
        engine.wait()
        opt.step()
        opt.zero_grad()

    def local():
        out = {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
        for i, st in enumerate(opt.state.values()):
            for k, v in st.items():
                if torch.is_tensor(v):
                    out[f"opt{i}.{k}"] = (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
        return out

    try:
        for k in (1, 2):
            step(k)
        engine.snapshot(2)
        engine.wait()
        want = local()
        step(3)
        restored = engine.restore()
        got = local()
        if restored is None or restored.step != 2 or not all(torch.equal(got[n], want[n]) for n in want):
            raise AssertionError(f"the sharded snapshot on {device} did not restore step 2 exactly ({restored})")
        return {"restored": restored.source, "step": restored.step, "bytes_per_rank": engine.stats["bytes"]}
    finally:
        engine.close(shutdown=True)


def _multi_main(port: str, backend: str, device_type: str, out: str) -> None:
    mp.spawn(_multi_worker, args=(2, int(port), backend, device_type, out), nprocs=2, join=True)


def multi_gpu(ctx: Context) -> dict:
    """NCCL with one rank per GPU, on 2 GPUs: every comm hook, 1-bit LAMB, FSDP2, a sharded snapshot + restore. On
    one GPU it is skipped with the reason; in the CPU dry run the same 2-rank worker runs over gloo."""
    if ctx.device.type == "cuda":
        count = torch.cuda.device_count()
        if count < 2:
            raise Skip(f"NCCL needs one GPU per rank and this machine has {count}; run it on 2 or more GPUs")
        backend, device_type = "nccl", "cuda"
    else:
        backend, device_type = "gloo", "cpu"
    ok, err, info = _spawn_two("_multi_main", backend, device_type)
    if not ok:
        raise AssertionError(f"the 2-rank run on {backend}/{device_type} failed:\n{err}")
    if backend == "gloo":
        info["note"] = "no CUDA device: the 2-rank steps ran over gloo on CPU; NCCL needs 2 GPUs"
    return info


# every GPU run's throughput rows, appended to one file (each row with its date, device, commit and torch version)
THROUGHPUT_RUNS = "gpu/throughput_runs"


def _throughput_argv(ctx: Context) -> list[tuple[str, list[str]]]:
    """The throughput runs in priority order: (label, benchmark arguments)."""
    if ctx.device.type != "cuda":  # the dry run: the mechanics on the test shape, the second run checkpointed
        small = shlex.split(
            "--preset test --batch 2 --seq 32 --steps 1 --warmup 1 --repeats 1 --modes eager --peak-size 512"
        )
        return [
            ("1b", [*small, "--methods", "lora,lora_fast,lorafa"]),
            ("profile", ["--profile", *small, "--methods", "lora,lora_fast"]),
            ("8b", [*small, "--methods", "lora", "--checkpointing"]),
        ]
    common = shlex.split("--seq 1024 --steps 3 --warmup 1 --order mode --repeats 1")
    # the 1B shape: every method eager first, then compiled (compiling takes a minute per row), so a short budget
    # still gives each method's eager row and the main methods' compiled rows: peft LoRA, full fine-tuning, the
    # tuners, peft LoRA through hf_dtrain.fast, then QLoRA beside the NF4 tuners
    one_b = shlex.split(
        "--preset llama3.2-1b --batch 4 --methods lora,full,lorafa,smt,lora_fast,qahira,qbara,qlora,dora"
    )
    # then the 8B shape on one GPU with activation checkpointing: what a user's single-GPU fine-tuning runs
    eight_b = shlex.split("--preset llama3-8b --batch 8 --checkpointing --modes eager --methods lora,lorafa,smt,qlora")
    # where each method's step goes on the device (CUDA event times per op family, ops, bytes kept): what a missed
    # goal is explained by
    profile = shlex.split("--profile --preset llama3.2-1b --batch 4 --seq 1024")
    return [
        ("1b", [*one_b, *common, "--time-budget", f"{ctx.throughput_budget:g}"]),
        ("profile", [*profile, "--methods", "lora,full,lora_fast,lorafa,smt,qbara,qahira,qlora"]),
        ("8b", [*eight_b, *common, "--time-budget", f"{ctx.throughput_8b_budget:g}"]),
    ]


def throughput(ctx: Context) -> dict:
    """``benchmarks/throughput.py`` on the device within time budgets: the 1B shape (every method eager, then
    compiled), then the 8B shape with activation checkpointing (LoRA, LoRA-FA, SMT, QLoRA). Each run's JSON / markdown
    / PNG go beside this report under a name with its date (an earlier run's file is never overwritten), and its rows
    are appended to ``results/gpu/throughput_runs.*``, which keeps every GPU run's rows."""
    script = ROOT / "benchmarks" / "throughput.py"
    if not script.exists():
        raise Skip(f"{script} is not here: run gpu_check from a checkout of hf_dtrain")
    stamp = time.strftime("%Y%m%d_%H%M", time.gmtime())
    device = re.sub(r"[^A-Za-z0-9]+", "_", _device_name(ctx.device)).strip("_")
    runs_name = "throughput_dry_run_runs" if ctx.dry_run else THROUGHPUT_RUNS
    out: dict = {"runs_file": f"benchmarks/results/{runs_name}.json", "shapes": {}}
    written_all = []
    peak_from: list[str] = []  # the first run's JSON: later runs on this machine take its matmul peak
    try:
        for label, argv in _throughput_argv(ctx):
            if label == "8b" and ctx.throughput_8b_budget <= 0:
                out["not_measured"] = out.get("not_measured", []) + ["the 8B shape (--throughput-8b-budget 0)"]
                continue
            name = f"throughput_dry_run_{label}" if ctx.dry_run else f"gpu/{device}/throughput_{label}_{stamp}"
            profile = label == "profile"
            proc = processes.run(
                [
                    sys.executable,
                    str(script),
                    *argv,
                    "--name",
                    name,
                    *([] if profile else ["--accumulate", runs_name, *peak_from]),
                ],
                capture_output=True,
                text=True,
                timeout=540,
                cwd=ROOT,
            )
            stem = f"{name}_profile" if profile else name
            written = [ROOT / "benchmarks" / "results" / f"{stem}.{ext}" for ext in ("json", "md", "png")]
            written_all += written
            if proc.returncode != 0:
                raise AssertionError(f"benchmarks/throughput.py ({label}) failed:\n{proc.stderr[-3000:]}")
            payload = json.loads(written[0].read_text())
            if not ctx.dry_run and ctx.out is not None:  # beside the report, where it was asked for
                folder = _report_folder(ctx)
                folder.mkdir(parents=True, exist_ok=True)
                for path in written:
                    if path.exists() and path.parent.resolve() != folder.resolve():
                        shutil.copy2(path, folder / path.name)
            if profile:
                out["profile"] = {
                    r["method"]: {k: r.get(k) for k in ("ops_vs_lora", "saved_vs_lora", "step_vs_lora", "error")}
                    for r in payload["rows"]
                }
                continue
            out["shapes"][label] = _throughput_rows(payload)
            peak_from = peak_from or ["--peak-from", str(written[0])]
        runs = json.loads((ROOT / "benchmarks" / "results" / f"{runs_name}.json").read_text())["rows"]
        out["rows_in_runs_file"] = len(runs)
        if ctx.dry_run:  # both runs' rows, in order, each with its run
            out["runs_file_shapes"] = [(r["preset"], r["checkpointing"], r["method"]) for r in runs]
    finally:
        if ctx.dry_run:
            for path in written_all + [
                ROOT / "benchmarks" / "results" / f"{runs_name}.{ext}" for ext in ("json", "md", "png")
            ]:
                path.unlink(missing_ok=True)
    failed = [
        (f"{label} {k}", r["error"]) for label, shape in out["shapes"].items() for k, r in shape["failed"].items()
    ]
    if failed:
        raise AssertionError(f"throughput rows failed: {failed}")
    return out


def _throughput_rows(payload: dict) -> dict:
    rows = {
        f"{r['method']} {r['mode']}": {
            k: r.get(k)
            for k in (
                "tokens_per_s",
                "vs_lora",
                "vs_qlora",
                "mfu",
                "peak_bytes",
                "estimated_peak_bytes",
                "estimate_over_measured",
                "estimate_error",
                "paths",
                "error",
            )
        }
        for r in payload["rows"]
    }
    # the NF4 rows need bitsandbytes' CUDA build, which a machine may lack (it is optional): not measured, not failed
    missing = [k for k, r in rows.items() if r.get("error") and "bitsandbytes" in r["error"]]
    failed = {k: r for k, r in rows.items() if r.get("error") and k not in missing}
    return {
        "preset": payload["preset"],
        "batch": payload["batch"],
        "peak_source": payload.get("peak_source"),  # the compute dtype the CPU could take (bf16 or fp32)
        "checkpointing": payload.get("checkpointing", False),
        "rows": {k: r for k, r in rows.items() if k not in missing and k not in failed},
        "failed": failed,
        "not_measured": payload.get("not_measured", []) + [f"{k} (bitsandbytes is not installed)" for k in missing],
    }


def _llama_1b():
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=2048,
    )
    return LlamaForCausalLM(config)


def _fused_batches(k: int, batch: int, seq: int, vocab: int, device):
    gen = torch.Generator().manual_seed(1000 + k)
    while True:
        ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
        yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def fused_sweep(ctx: Context) -> dict:
    """K LoRA jobs fused on one frozen base vs one after another with peft, on the device."""
    dev = ctx.device
    cuda = dev.type == "cuda"
    preset, batch, seq = ("test", 4, 32) if (ctx.dry_run or ctx.quick) else ("tiny", 16, 128)
    ks = (1, 2) if ctx.dry_run else (1, 4, 8)
    steps, warm = (4, 1) if ctx.dry_run else (20, 5)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    base = build_llama(preset).to(dev)
    vocab = base.config.vocab_size

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def alone(k: int, n: int):
        torch.manual_seed(k)
        model = get_peft_model(copy.deepcopy(base), LoraConfig(r=8, target_modules=targets))
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-3)
        data, losses, times = _fused_batches(k, batch, seq, vocab, dev), [], []
        for _ in range(n):
            sync()
            t0 = time.perf_counter()
            loss = model(**next(data)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        return losses, statistics.median(times[warm:]) if n > warm else times[-1]

    def fused(k: int, n: int):
        peft_model = None
        for j in range(k):
            torch.manual_seed(j)
            if peft_model is None:
                peft_model = get_peft_model(
                    copy.deepcopy(base), LoraConfig(r=8, target_modules=targets), adapter_name=f"j{j}"
                )
            else:
                peft_model.add_adapter(f"j{j}", LoraConfig(r=8, target_modules=targets))
        f = fuse_adapters(peft_model, [f"j{j}" for j in range(k)])
        jobs = [FusedJob(f"j{j}", 1e-3, _fused_batches(j, batch, seq, vocab, dev)) for j in range(k)]
        trainer = FusedTrainer(f, jobs, n, FusedConfig(lr_scheduler_type="constant"))
        times = []
        for _ in range(n):
            sync()
            t0 = time.perf_counter()
            trainer.step()
            sync()
            times.append(time.perf_counter() - t0)
        return trainer.history, statistics.median(times[warm:]) if n > warm else times[-1]

    history, _ = fused(2, 4)
    worst = 0.0
    for j in range(2):
        ref, _ = alone(j, 4)
        worst = max(worst, max(abs(h[j] - r) / abs(r) for h, r in zip(history, ref)))
    if worst > 1e-4:
        raise AssertionError(f"fused jobs differ from the jobs alone on {dev}: {worst:.2e} relative loss")
    _, t_alone = alone(0, steps)
    rows = {}
    for k in ks:
        _, t = fused(k, steps)
        rows[f"K={k}"] = {
            "fused_step_s": t,
            "samples_per_s": k * batch / t,
            "vs_peft_one_after_another": k * t_alone / t,
        }
    return {
        "shape": f"{preset} LLaMA, LoRA r=8 on every projection, batch {batch} x {seq} per job",
        "max_rel_loss_diff_fused_vs_alone": worst,
        "peft_alone_step_s": t_alone,
        **rows,
    }


def peak_memory(ctx: Context) -> dict:
    """Peak allocated memory of one training step (forward, backward, AdamW step) per method."""
    if ctx.device.type != "cuda":
        raise Skip("peak memory is torch.cuda.max_memory_allocated: needs a CUDA device")

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    batch, seq = (2, 256) if ctx.quick else (4, 1024)
    methods = {
        "full": None,
        "lora": lambda: LoraConfig(r=16, lora_alpha=32, target_modules=targets),
        "lorafa": lambda: LoraFAConfig(r=16, lora_alpha=32, target_modules=targets),
        "smt": lambda: SMTConfig(
            block_size=256, trainable_ratio=0.01, target_modules=["q_proj", "k_proj", "v_proj"], init_weights=False
        ),
    }
    out = {}
    for name, make in methods.items():
        torch.cuda.empty_cache()
        torch.manual_seed(0)
        model = _llama_1b().to(ctx.device, dtype=torch.bfloat16)
        if make is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = get_peft_model(model, make())
            if name == "smt":  # blocks picked from one scoring pass, as the warm-up would
                from hf_dtrain.tuners.smt import select_smt_blocks, start_smt_scoring

                start_smt_scoring(model)
                ids = torch.randint(0, 32000, (batch, seq), device=ctx.device)
                model(input_ids=ids, labels=ids).loss.backward()
                model.zero_grad(set_to_none=True)
                select_smt_blocks(model)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-5)
        ids = torch.randint(0, 32000, (batch, seq), device=ctx.device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(2):  # the second step includes the optimizer state
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        out[name] = {
            "peak_bytes": torch.cuda.max_memory_allocated(),
            "trainable": sum(p.numel() for p in params),
            "seconds_per_step": (time.perf_counter() - t0) / 2,
        }
        del model, opt, params
    out["lorafa_vs_lora"] = out["lorafa"]["peak_bytes"] / out["lora"]["peak_bytes"]
    out["smt_vs_full"] = out["smt"]["peak_bytes"] / out["full"]["peak_bytes"]
    out["shape"] = f"LLaMA 2048 wide, 16 layers, bf16 weights, batch {batch} x {seq} tokens"
    return out


def delta_memory(ctx: Context) -> dict:
    """DELTA (keep / offload / recompute per layer under a budget; on CUDA the pinned host tier with side-stream
    prefetch) against no saving, full gradient checkpointing and transformers' checkpointing with ``offload=True``:
    peak allocated memory (CUDA) and step time, steady steps after DELTA's profiling step."""
    cuda = ctx.device.type == "cuda"
    if cuda and not ctx.quick:
        make, batch, seq = (lambda: _llama_1b().to(ctx.device, dtype=torch.bfloat16)), 4, 1024
        shape = "LLaMA 2048 wide, 16 layers, bf16"
    elif ctx.dry_run:  # the mechanics only (every method's plan and tier), on the test shape
        make, batch, seq = (lambda: build_llama("test", seed=0).to(ctx.device)), 4, 64
        shape = "the test LLaMA preset, fp32"
    else:
        make, batch, seq = (lambda: build_llama("tiny", seed=0).to(ctx.device)), 4, 256
        shape = "the tiny LLaMA preset, fp32"
    out = {}
    for method in ("none", "checkpoint", "hf_offload", "delta_0.5", "delta_0.25"):
        torch.manual_seed(0)
        model = make()
        vocab = model.config.vocab_size
        scheduler = None
        if method == "checkpoint":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif method == "hf_offload":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, "offload": True})
        elif method.startswith("delta"):
            scheduler = apply_delta(model, float(method.split("_")[1]))
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        times, losses = [], []
        for step in range(4):
            b = {k: v.to(ctx.device) for k, v in random_batch(batch=batch, seq=seq, vocab=vocab, seed=step).items()}
            if cuda:
                torch.cuda.synchronize()
                if step == 2:  # steady state: after DELTA's profiling step and its first planned step
                    torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            loss = model(**b).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            if step >= 2:
                times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        row = {
            "step_s": statistics.median(times),
            "loss": losses[-1],
            "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        }
        if scheduler is not None:
            row["tier"] = type(scheduler.tier).__name__
            row["plan"] = {
                a: sum(list(p.actions.values()).count(a) for p in scheduler.plans.values())
                for a in ("keep", "offload", "recompute")
            }
            scheduler.remove()
        out[method] = row
        del model, opt
    for row in list(out.values()):
        row["step_vs_none"] = row["step_s"] / out["none"]["step_s"]
        if cuda:
            row["peak_vs_none"] = row["peak_bytes"] / out["none"]["peak_bytes"]
    if not cuda:
        out["note"] = "no CUDA device: step times on CPU (file tier); peak GPU memory needs CUDA"
    out["shape"] = f"{shape}, batch {batch} x {seq}, SGD"
    return out


def snapshot_stall(ctx: Context) -> dict:
    """How long the training loop is blocked per snapshot, snapshotting after every step: hf_dtrain's in-memory
    snapshot (the ``snapshot()`` call plus the ``wait()`` before the next optimizer step) against DCP ``async_save``
    with its default stager (pinned host staging on CUDA, asynchronous staging and non-blocking copies): the call
    plus waiting for the previous staging before the next optimizer step and for the previous upload before the
    next save."""
    cuda = ctx.device.type == "cuda"
    steps = 5 if ctx.quick or not cuda else 8
    out = {}
    for method in ("hf_dtrain_snapshot", "dcp_async_save"):
        torch.manual_seed(0)
        if cuda and not ctx.quick:
            model, shape = _llama_1b().to(ctx.device), "LLaMA 2048 wide, 16 layers, fp32 + AdamW"
        else:
            model, shape = build_llama("tiny", seed=0).to(ctx.device), "the tiny LLaMA preset, fp32 + AdamW"
        vocab = model.config.vocab_size
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
        stalls, times = [], []
        with tempfile.TemporaryDirectory() as tmp:
            engine = stager = staging = upload = None
            dcp_stager = "DefaultStager: pinned, asynchronous, non-blocking" if cuda else "DefaultStager"
            if method == "hf_dtrain_snapshot":
                engine = SnapshotEngine(model, opt, sched, directory=os.path.join(tmp, "ft"), parity=0)
            else:
                options = StagingOptions(
                    use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda
                )
                stager = DefaultStager(options)
            for step in range(steps + 1):
                batch = {k: v.to(ctx.device) for k, v in random_batch(batch=4, seq=256, vocab=vocab, seed=step).items()}
                t0 = time.perf_counter()
                model(**batch).loss.backward()
                w = time.perf_counter()
                if engine is not None:
                    engine.wait()
                elif staging is not None:
                    staging.result()  # the state must be staged before the optimizer changes it
                waited = time.perf_counter() - w
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                if cuda:
                    torch.cuda.synchronize()  # the step's own kernels are not the save's stall
                c = time.perf_counter()
                if engine is not None:
                    engine.snapshot(step)
                else:
                    if upload is not None:
                        upload.result()  # DCP's rule: one save in flight
                        shutil.rmtree(os.path.join(tmp, f"dcp{step - 2}"), ignore_errors=True)  # keep two
                    if stager is not None and not getattr(
                        getattr(stager, "_state_dict_stager", None), "_deepcopy_dispatch", True
                    ):
                        # torch 2.11's async_save closes the stager it is given after each save (the next save then
                        # fails with KeyError: <class 'type'>, seen on an H200); 2.13 keeps it open. A new pinned
                        # stager per save re-pins the whole state every time (minutes on the 1B shape), so from here
                        # on DCP stages with the default it creates itself for this torch
                        stager, dcp_stager = None, "DCP's own default (this torch closes a given stager per save)"
                    response = dcp.async_save(
                        {"model": model.state_dict(), "optimizer": opt.state_dict()},
                        checkpoint_id=os.path.join(tmp, f"dcp{step}"),
                        async_stager=stager,
                        no_dist=True,
                    )
                    staging, upload = (
                        (response.staging_completion, response.upload_completion)
                        if hasattr(response, "staging_completion")
                        else (None, response)
                    )
                called = time.perf_counter() - c
                if step >= 2:  # the first saves allocate (our slot, DCP's staging buffers)
                    stalls.append(called + waited)
                    times.append(time.perf_counter() - t0)
            if engine is not None:
                engine.wait()
                nbytes = engine.stats["bytes"]
                engine.close(shutdown=True)
            else:
                upload.result()
                if stager is not None:
                    stager.close()
                nbytes = sum(f.stat().st_size for f in Path(tmp).glob(f"dcp{steps}/*"))
        out[method] = {
            "stall_median_s": statistics.median(stalls),
            "step_median_s": statistics.median(times),
            "state_bytes": nbytes,
        }
        if method == "dcp_async_save":
            out[method]["stager"] = dcp_stager
        del model, opt
    out["stall_ours_vs_dcp"] = out["hf_dtrain_snapshot"]["stall_median_s"] / out["dcp_async_save"]["stall_median_s"]
    out["shape"] = f"{shape}, batch 4 x 256, a snapshot after every step, {steps} steps"
    return out


STEPS = [
    Step("cuda_tests", "the suite's CUDA tests (pytest -m cuda)", cuda_tests),
    Step(
        "tuners_autocast", "every tuner and peft LoRA under bf16 autocast against fp32, on the device", tuners_autocast
    ),
    Step("bnb_4bit", "Q-BaRA on a bitsandbytes NF4 base, on the device", bnb_4bit),
    Step("qahira_merge", "QA-HiRA merged exactly into an HQQ 4-bit base, on the device", qahira_merge),
    Step("comm_hooks", "every DDP comm hook on 2 ranks (NCCL where it can run)", comm_hooks),
    Step(
        "fsdp2", "FSDP2 with bf16 parameters and activation checkpointing, full and every tuner, on the device", fsdp2
    ),
    Step("delta_memory", "DELTA against no saving, checkpointing and transformers' offload", delta_memory),
    Step("snapshot_stall", "stall per snapshot: hf_dtrain's in-memory snapshot vs DCP async_save", snapshot_stall),
    Step("fused_sweep", "K LoRA jobs fused (HFTA) vs one after another: exactness, then samples/s", fused_sweep),
    Step("peak_memory", "peak memory of a training step: LoRA-FA vs LoRA, SMT vs full fine-tuning", peak_memory),
    Step("throughput", "tokens/s, MFU and peak memory of each method vs peft LoRA, eager and compiled", throughput),
    Step("multi_gpu", "NCCL on 2 GPUs: comm hooks, 1-bit LAMB, FSDP2, a sharded snapshot + restore", multi_gpu),
]


# ----------------------------------------------------------------------------------------------------------- driver


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})"


def _report_folder(ctx: Context, out_dir: Path | None = None) -> Path:
    """``<out>/<device name>``: one folder of results per device."""
    return Path(out_dir or ctx.out) / re.sub(r"[^A-Za-z0-9._-]+", "_", _device_name(ctx.device)).strip("_")


def run(
    steps: list[Step], ctx: Context, progress: bool = True, after_step: Callable[[list[dict]], None] | None = None
) -> list[dict]:
    """Run ``steps`` in order; ``after_step(results so far)`` after each one (the driver writes the report there, so
    a run stopped by a time limit keeps what it measured)."""
    results = []
    for step in tqdm(steps, desc="gpu_check", disable=not progress):
        t0 = time.perf_counter()
        try:
            detail, status = step.run(ctx), "passed"
        except Skip as why:
            detail, status = {"reason": str(why)}, "skipped"
        except Exception as exc:  # a failed step is reported, and the others still run
            detail, status = (
                {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]},
                "failed",
            )
        results.append(
            {
                "step": step.name,
                "what": step.what,
                "status": status,
                "seconds": round(time.perf_counter() - t0, 1),
                "detail": detail,
            }
        )
        line = f"[{status}] {step.name} ({results[-1]['seconds']} s)"
        if status == "skipped":
            line += f": {detail['reason']}"
        elif status == "failed":
            line += f": {detail['error'][:300]}"
        print(line, flush=True)
        if after_step is not None:
            after_step(results)
    return results


def write_report(results: list[dict], ctx: Context, out_dir: Path) -> Path:
    device = _device_name(ctx.device)
    folder = _report_folder(ctx, out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    env = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dry_run": ctx.dry_run,
        "command": "python -m hf_dtrain.testing.gpu_check " + " ".join(sys.argv[1:]),
    }
    (folder / "gpu_check.json").write_text(json.dumps({"environment": env, "steps": results}, indent=1, default=str))
    (folder / "gpu_check.md").write_text(report_markdown(results, env))
    _plot(results, device, folder / "gpu_check.png")
    return folder


def _passed(results: list[dict], step: str) -> dict | None:
    """The detail of ``step`` if it passed."""
    return next((r["detail"] for r in results if r["step"] == step and r["status"] == "passed"), None)


def _table(title: str, columns: list[str], rows) -> list[str]:
    """A titled markdown table, as lines (a blank line before the title and the table)."""
    head = ["", title, "", "| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    return head + ["| " + " | ".join(row) + " |" for row in rows]


def report_markdown(results: list[dict], env: dict) -> str:
    """gpu_check.md from the steps' results and the environment (what ``gpu_check.json`` holds)."""
    lines = [
        f"# gpu_check on {env['device']}",
        "",
        "| step | what | status | seconds | result |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        d = r["detail"]
        brief = d.get("reason") or d.get("error", "")[:200] or d.get("note") or d.get("nccl") or d.get("result") or ""
        lines.append(f"| {r['step']} | {r['what']} | {r['status']} | {r['seconds']} | {str(brief).replace('|', '/')} |")
    peak = _passed(results, "peak_memory")
    if peak:
        rows = [
            (
                m,
                f"{peak[m]['trainable']:,}",
                f"{peak[m]['peak_bytes'] / 2**30:.2f}",
                f"{peak[m]['seconds_per_step']:.3f}",
            )
            for m in ("full", "lora", "lorafa", "smt")
        ]
        lines += _table(f"Peak memory, {peak['shape']}:", ["method", "trainable", "peak (GiB)", "s/step"], rows)
        lines += [
            "",
            f"LoRA-FA / LoRA: {peak['lorafa_vs_lora']:.2f}; SMT / full fine-tuning: {peak['smt_vs_full']:.2f}",
        ]
    delta = _passed(results, "delta_memory")
    if delta:
        rows = []
        for m in ("none", "checkpoint", "hf_offload", "delta_0.5", "delta_0.25"):
            r = delta[m]
            gib = "n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f}"
            ratio = f"{r['peak_vs_none']:.2f}" if "peak_vs_none" in r else "n/a"
            rows.append((m, gib, ratio, f"{r['step_vs_none']:.2f}"))
        columns = ["method", "peak (GiB)", "peak / none", "step / none"]
        lines += _table(f"Activation memory, {delta['shape']}:", columns, rows)
    stall = _passed(results, "snapshot_stall")
    if stall:
        rows = [
            (m, f"{stall[m]['stall_median_s']:.4f}", f"{stall[m]['step_median_s']:.3f}", f"{stall[m]['state_bytes']:,}")
            for m in ("hf_dtrain_snapshot", "dcp_async_save")
        ]
        columns = ["method", "stall (s)", "step (s)", "state bytes"]
        lines += _table(f"Stall per snapshot, {stall['shape']}:", columns, rows)
        lines += ["", f"stall, ours / DCP async_save: {stall['stall_ours_vs_dcp']:.2f}"]
    lines += ["", "## Environment"] + [f"- {k}: {v}" for k, v in env.items()]
    return "\n".join(lines) + "\n"


def _plot(results: list[dict], device: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peak = _passed(results, "peak_memory")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    if peak:
        names = ["full", "lora", "lorafa", "smt"]
        ax.bar(names, [peak[m]["peak_bytes"] / 2**30 for m in names])
        ax.set_ylabel("peak GiB")
        ax.set_title(f"one training step, {device}")
    else:
        colors = {"passed": "tab:green", "skipped": "tab:gray", "failed": "tab:red"}
        ax.barh(
            [r["step"] for r in results], [r["seconds"] for r in results], color=[colors[r["status"]] for r in results]
        )
        ax.set_xlabel("seconds (green passed, grey skipped, red failed)")
        ax.set_title(f"gpu_check on {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m hf_dtrain.testing.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run every step on CPU where it can, skipping the CUDA-only measurements with a line each",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu"), help="results folder")
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated steps to run, in the order given (of "
        f"{', '.join(s.name for s in STEPS)}); a device lease too short for every step runs the ones "
        "that matter first",
    )
    ap.add_argument(
        "--throughput-budget",
        type=float,
        default=Context.throughput_budget,
        help="seconds within which the throughput step starts new (method, mode) rows on the 1B shape (default "
        f"{Context.throughput_budget:g})",
    )
    ap.add_argument(
        "--throughput-8b-budget",
        type=float,
        default=Context.throughput_8b_budget,
        help="the same on the 8B shape, run after the 1B rows (default "
        f"{Context.throughput_8b_budget:g}; 0 skips the 8B shape)",
    )
    ap.add_argument("--quick", action="store_true", help="smaller batches for the measurements")
    args = ap.parse_args(argv)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here. Run it on a GPU machine, or add --cpu-dry-run to run every step on CPU.",
            file=sys.stderr,
        )
        return 2
    steps = STEPS
    if args.only:
        names = args.only.split(",")
        unknown = sorted(set(names) - {s.name for s in STEPS})
        if unknown:
            ap.error(f"--only: unknown steps {unknown}; choose from {[s.name for s in STEPS]}")
        by_name = {s.name: s for s in STEPS}
        steps = [by_name[n] for n in dict.fromkeys(names)]
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.cpu_dry_run else torch.device("cpu")
    if args.throughput_budget <= 0:
        ap.error(f"--throughput-budget must be positive seconds, got {args.throughput_budget}")
    if args.throughput_8b_budget < 0:
        ap.error(f"--throughput-8b-budget must be 0 (skip) or positive seconds, got {args.throughput_8b_budget}")
    ctx = Context(
        device=device,
        dry_run=args.cpu_dry_run,
        quick=args.quick,
        out=Path(args.out),
        throughput_budget=args.throughput_budget,
        throughput_8b_budget=args.throughput_8b_budget,
    )
    print(f"gpu_check on {_device_name(device)} (torch {torch.__version__}, CUDA {torch.version.cuda})", flush=True)
    results = run(steps, ctx, after_step=lambda done: write_report(done, ctx, Path(args.out)))
    folder = write_report(results, ctx, Path(args.out))
    failed = [r["step"] for r in results if r["status"] == "failed"]
    print(
        f"results in {folder}/gpu_check.{{json,md,png}}; "
        + (f"FAILED: {', '.join(failed)}" if failed else "no failures")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
