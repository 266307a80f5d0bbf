"""Training throughput of every fine-tuning method against peft's LoRA, eager and ``torch.compile``d, on the largest
LLaMA shape the machine trains: tokens per second, peak memory and model FLOP utilisation (MFU).

Methods, at the trainable-parameter budget of LoRA r=8 on every linear layer of the decoder (q, k, v, o, gate, up,
down), each configured to the nearest budget its shape allows (the table lists each method's trainable parameters):

* ``full``: full fine-tuning (every parameter, AdamW);
* ``lora``, ``dora``: peft LoRA / DoRA, r=8 (the baseline: ``vs_lora`` is tokens/s over LoRA's in the same mode);
* ``lora_fast``: the same peft LoRA model through ``hf_dtrain.fast.apply`` (the lean low-rank function and the lean
  MLP and attention blocks; the adapter is still peft's); hf_dtrain's tuners run through it too (LoRA-FA's MLPs
  and attentions as lean blocks);
* ``qlora``: peft LoRA r=8 on a bitsandbytes NF4 base (``BitsAndBytesConfig(load_in_4bit=True)``);
* ``lorafa``: LoRA-FA (only B trains, so r = budget / sum of output widths);
* ``smt``: SMT, 64 x 64 blocks, budget / 4096 blocks spread over the targets (a seeded selection: throughput does not
  depend on which blocks);
* ``qbara``: Q-BaRA r=8, pool 2 on the NF4 base (r (in + out) per layer, as LoRA);
* ``qahira``: QA-HiRA, one matrix per layer (group 64 = NF4's block size; lambda_out the power of two whose count
  is nearest LoRA's budget: 1 on the 100m preset, 2 on the 1B shape) on the NF4 base.

Each (method, mode) runs in a fresh process: build the model from ``LlamaConfig`` (random weights, saved once and
loaded by every worker, so all start from the same weights), count one step's FLOPs with
``torch.utils.flop_counter.FlopCounterMode`` (eager; the compiled graph does the same arithmetic), compile (mode
``compiled``: ``torch.compile(model)``, inductor, as ``TrainingArguments(torch_compile=True)`` does), warm up, then
time ``--steps`` AdamW steps (forward, backward, optimizer step; bf16 weights on a GPU; on a CPU that computes bf16
natively, bf16 autocast, else fp32: ``hf_dtrain.fast.cpu_bf16``, ``HF_DTRAIN_CPU_BF16=0`` forces fp32).
Peak memory: on CPU the process's peak resident set over 2 more steps after the timed ones
(``/proc/self/clear_refs`` resets it first, so compilation's transient memory is not counted), with glibc's mmap
threshold fixed so that the resident set follows the live tensors (the timed steps run with the default allocator
settings), above its resident set before the model was built (the libraries imported); on a GPU
``torch.cuda.max_memory_allocated``. Each eager row's step is also traced by ``hf_dtrain.estimate`` on fake tensors
(the same base, method, lean layers, AdamW and batch) and its estimate put beside the row's own peak: on a GPU
``max_memory_allocated``, on CPU the tensors' peak over 2 more steps by the profiler's memory events
(``hf_dtrain.estimate.measure``; the resident set holds more than tensors). MFU: counted
FLOPs per second over the device's peak: on CPU the matmul peak in the step's compute dtype measured in this run (a
4096 x 4096 matmul in a fresh process), on a GPU its datasheet dense bf16 peak.

    python benchmarks/throughput.py                      # CPU: the 100M preset, about 30 minutes on 2 cores
    python benchmarks/throughput.py --preset test --steps 2 --seq 32   # a quick look at the mechanics
    python benchmarks/throughput.py --preset llama3.2-1b                # a GPU (gpu_check runs it)
    python benchmarks/throughput.py --profile            # where each method's step goes, by op family
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import RESULTS, emit_result, environment, markdown_table, run_worker, write

METHODS = ["full", "lora", "lora_fast", "dora", "qlora", "lorafa", "smt", "qbara", "qahira"]
QUANTIZED = {"qlora", "qbara", "qahira"}
MODES = ["eager", "compiled"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 8
SMT_BLOCK = 64
NF4_BLOCK = 64
# dense bf16 peak of the GPUs this project is lent (datasheet, SXM, without sparsity)
GPU_PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def _targets(model):
    import torch

    return [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in TARGETS]


def adapter_config(method: str, model):
    """The peft config of ``method`` at LoRA r=8's budget on ``model``'s target layers (None: full fine-tuning)."""
    import random

    from peft import LoraConfig

    from hf_dtrain import LoraFAConfig, QAHiRAConfig, QBaRAConfig, SMTConfig

    targets = _targets(model)
    budget = sum(RANK * (m.in_features + m.out_features) for _, m in targets)
    if method == "full":
        return None
    if method in ("lora", "lora_fast", "dora", "qlora"):
        return LoraConfig(
            r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules=TARGETS, use_dora=method == "dora"
        )
    if method == "lorafa":
        r = round(budget / sum(m.out_features for _, m in targets))
        return LoraFAConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS, init_seed=0)
    if method == "smt":
        rng = random.Random(0)
        cells = [
            (name, i, j)
            for name, m in targets
            for i in range(m.out_features // SMT_BLOCK)
            for j in range(m.in_features // SMT_BLOCK)
        ]
        picked: dict[str, list] = {}
        for name, i, j in rng.sample(cells, round(budget / SMT_BLOCK**2)):
            picked.setdefault(name, []).append([i, j])
        return SMTConfig(block_size=SMT_BLOCK, target_modules=TARGETS, block_indices=picked)
    if method == "qbara":
        return QBaRAConfig(r=RANK, lora_alpha=2 * RANK, pool=2, target_modules=TARGETS)
    if method == "qahira":
        # one matrix of (out / lambda_out) x (in / group) per layer: its count is set by the shape, so lambda_out (a
        # power of two dividing every out_features) is the one whose count is nearest LoRA's budget (by ratio)
        lambdas = [2**k for k in range(8) if all(m.out_features % 2**k == 0 for _, m in targets)]
        count = {
            lam: sum((m.out_features // lam) * (m.in_features // NF4_BLOCK) for _, m in targets) for lam in lambdas
        }
        lam = min(lambdas, key=lambda lam: abs(math.log(count[lam] / budget)))
        return QAHiRAConfig(group_size=NF4_BLOCK, lambda_out=lam, target_modules=TARGETS)
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def _peak_rss_reset() -> bool:
    """Reset the process's peak resident set (VmHWM) to the current one; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _exact_rss() -> bool:
    """Make the resident set follow the live tensors: glibc's malloc serves large blocks from its heap once its
    dynamic mmap threshold has grown, and keeps freed heap pages resident, so a peak RSS then depends on the
    allocation history. A fixed threshold (128 KiB) maps and unmaps every large block, and ``malloc_trim`` returns
    what is free now. False where glibc is not the allocator."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(-3, 128 * 1024) == 1  # M_MMAP_THRESHOLD
        libc.malloc_trim(0)
        return ok
    except (OSError, AttributeError):
        return False


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_rss() -> int:
    return _status("VmHWM")


def _rss() -> int:
    return _status("VmRSS")


def worker(
    method: str,
    mode: str,
    path: str,
    batch: int,
    seq: int,
    steps: int,
    warmup: int,
    profile=False,
    checkpointing=False,
) -> dict:
    import peft  # noqa: F401  (everything imported before the baseline resident set is read)
    import torch
    from transformers import AutoModelForCausalLM

    from hf_dtrain import fast

    cuda = torch.cuda.is_available()
    base_rss = 0 if cuda else _rss()
    device = "cuda" if cuda else "cpu"
    low = compute_dtype()
    if method in QUANTIZED:
        from transformers import BitsAndBytesConfig

        from hf_dtrain.quantization import prepare_bnb_4bit_for_training

        model = AutoModelForCausalLM.from_pretrained(
            path,
            device_map=device,
            quantization_config=BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=low
            ),
        )
        if not cuda:
            prepare_bnb_4bit_for_training(model)  # bitsandbytes' CPU kernel path for training
    else:
        # a GPU trains bf16 weights (what users load); the CPU keeps fp32 weights under bf16 autocast
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if cuda else torch.float32).to(device)
    if checkpointing:  # activation checkpointing per decoder layer (non-reentrant: a frozen embedding needs no hook)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = adapter_config(method, model)
    if config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, config)
    if method not in ("full", "lora", "dora", "qlora"):  # peft's own rows stay plain: the baselines
        fast.apply(model)  # peft LoRA's layers (lora_fast) and the decoder blocks (lora_fast, lorafa)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    trainable = sum(p.numel() for p in params)
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    dense_dtype = model.get_input_embeddings().weight.dtype  # what the base loaded as: the trace builds the same

    def batch_of():
        ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
        return {"input_ids": ids, "labels": ids}

    def step(fn, prof=None):
        return train_step(fn, optimizer, batch_of(), device, low, prof)

    flops = count_flops(model, step)
    if profile:
        return profile_row(method, model, step, batch * seq)
    fn = torch.compile(model) if mode == "compiled" else model
    t0 = time.perf_counter()
    for _ in range(warmup):
        step(fn)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    warm_seconds = time.perf_counter() - t0
    reset = cuda or _peak_rss_reset()
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step(fn)
        losses.append(float(loss))  # a host sync at every step, as a training loop that logs has
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if cuda:
        peak, exact = torch.cuda.max_memory_allocated(), True
    else:  # a memory pass after the timed ones (its allocator setting would slow the timed steps)
        exact = _exact_rss()
        reset = _peak_rss_reset() and reset
        for _ in range(2):
            step(fn)
        peak = _peak_rss() - base_rss
    estimated = tensors = estimate_error = None
    if mode == "eager" and (cuda or method not in QUANTIZED):  # the estimate is of the eager step
        try:
            estimated = estimated_peak(method, path, batch, seq, checkpointing, device, low, dense_dtype)
        except Exception as e:  # the row's measurement is kept; the estimate's failure is said beside it
            estimate_error = f"{type(e).__name__}: {str(e)[:300]}"
        if not cuda and estimated is not None:  # the tensors' peak (the resident set is more): 2 more steps
            from hf_dtrain.estimate.measure import StepPeak

            measured = StepPeak(device)
            measured.start(model, optimizer)
            for _ in range(2):
                step(fn)
            tensors = measured.stop()
    against = peak if cuda else tensors
    return {
        "method": method,
        "mode": mode,
        "trainable": trainable,
        "estimated_peak_bytes": estimated,
        "tensor_peak_bytes": tensors,  # CPU: the profiler's memory events over 2 steps (hf_dtrain.estimate.measure)
        "estimate_over_measured": estimated / against if estimated and against else None,
        "estimate_error": estimate_error,
        "step_seconds": times,
        "losses": losses,
        "flops_per_step": flops,
        "peak_bytes": peak,
        "peak_kind": "cuda max_memory_allocated"
        if cuda
        else (
            (
                "peak RSS over 2 steps after the timed ones, with every large block mapped and unmapped (a fixed "
                "mmap threshold), above the RSS before the model was built"
            )
            if reset and exact
            else "peak RSS of the process above the RSS before the model was built"
        ),
        "warmup_seconds": warm_seconds,
        "tokens_per_step": batch * seq,
        "checkpointing": checkpointing,
        "paths": fast.report(model, training=True),
    }


def train_step(fn, optimizer, batch: dict, device: str, low, prof=None):
    """One AdamW step as every row takes it: forward under autocast to ``low`` (none in fp32), backward, step."""
    import torch

    phase = prof.phase if prof is not None else (lambda name: contextlib.nullcontext())
    with phase("forward"), torch.autocast(device, dtype=low, enabled=low != torch.float32):
        loss = fn(**batch).loss
    with phase("backward"):
        loss.backward()
    with phase("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss


def estimated_peak(method: str, path: str, batch: int, seq: int, checkpointing: bool, device: str, low, dense_dtype):
    """The row's step traced by hf_dtrain's estimator on fake tensors (``hf_dtrain.estimate``: no weight read,
    nothing allocated on the device): the same base built from its config (the 4-bit layers as bitsandbytes loads
    them), the same method, lean layers, AdamW and batch. On a GPU it stands beside ``max_memory_allocated``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_dtrain import fast
    from hf_dtrain.estimate import fake_tensors, make_fake, trace_step

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dense_dtype)
    if method in QUANTIZED:
        from hf_dtrain.quantization import quantize_model_nf4

        quantize_model_nf4(model, compute_dtype=low)
        model.is_loaded_in_4bit = True  # as transformers marks it: peft wraps it in its bitsandbytes classes
    config = adapter_config(method, model)
    if config is not None:
        from peft import get_peft_model

        with torch.device("meta"):
            model = get_peft_model(model, config)
    with fake_tensors():
        model = make_fake(model, torch.device(device))
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if method not in ("full", "lora", "dora", "qlora"):
            fast.apply(model)
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
        memory = trace_step(
            model,
            optimizer,
            lambda: train_step(model, optimizer, {"input_ids": ids, "labels": ids}, device, low),
            flops=False,
        )
    return memory.peak


def profile_row(method: str, model, step, tokens: int) -> dict:
    """One eager step after a warm-up one, through :class:`hf_dtrain.fast.profile.StepProfile`: ops, times and
    bytes kept for backward by op family; and the step's time without the profile's dispatch (median of 3)."""
    import torch

    from hf_dtrain import fast
    from hf_dtrain.fast.profile import StepProfile

    step(model)
    prof = StepProfile(model)
    step(model, prof)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step(model)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "method": method,
        "mode": "eager",
        "trainable": trainable,
        "tokens_per_step": tokens,
        "step_s": statistics.median(times),
        "paths": fast.report(model, training=True),
        **prof.summary(),
    }


def count_flops(model, step) -> int:
    """FLOPs of one training step, counted by ``torch.utils.flop_counter`` with the attention run as explicit matmuls
    (transformers' eager attention): the counter's SDPA formulas refuse grouped key/value heads on torch 2.11 (Llama
    3.2's 8 KV heads for 32 query heads) and count nothing for SDPA's CPU math path with them on 2.13. The matmuls are
    the same arithmetic SDPA and the compiled graph run."""
    from torch.utils.flop_counter import FlopCounterMode

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    attention = base.config._attn_implementation
    base.set_attn_implementation("eager")
    try:
        with FlopCounterMode(display=False) as counter:
            step(model)
    finally:
        base.set_attn_implementation(attention)
    return counter.get_total_flops()


def compute_dtype():
    """The step's compute dtype: bf16 on a GPU and on a CPU that computes it natively (``hf_dtrain.fast.cpu_bf16``),
    else fp32 (bf16 emulated with AVX2 alone would measure the emulation, about 90x slower, not the method)."""
    import torch

    from hf_dtrain.fast import cpu_bf16

    return torch.bfloat16 if torch.cuda.is_available() or cpu_bf16()[0] else torch.float32


def precision_note(cuda: bool) -> str:
    import torch

    from hf_dtrain.fast import cpu_bf16

    if cuda:
        return "bf16 weights"
    if compute_dtype() == torch.bfloat16:
        return "fp32 weights under bf16 autocast"
    return f"fp32 weights and compute ({cpu_bf16()[1]})"


def matmul_peak(n: int = 4096) -> dict:
    """The device's matmul peak in the step's compute dtype: datasheet bf16 on a known GPU, else the best of timed
    ``n x n`` matmuls (4096 by default)."""
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        for key, peak in GPU_PEAK.items():
            if key in name:
                return {"peak_flops": peak, "peak_source": f"{name} datasheet dense bf16"}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = compute_dtype()
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    best = float("inf")
    for _ in range(6):
        t0 = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    name = str(dtype).replace("torch.bfloat16", "bf16").replace("torch.float32", "fp32")
    return {"peak_flops": 2 * n**3 / best, "peak_source": f"measured: best of 6 {name} {n}x{n} matmuls on {device}"}


def _pooled(runs: list[dict]) -> dict:
    """One row from the rounds of a (method, mode): every round's timed steps, the median round's peak memory."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    row = dict(runs[0])
    row["step_seconds"] = [t for r in runs for t in r["step_seconds"]]
    row["round_medians"] = [statistics.median(r["step_seconds"]) for r in runs]
    row["peak_bytes"] = int(statistics.median(r["peak_bytes"] for r in runs))
    if row.get("estimate_over_measured") is not None and row.get("tensor_peak_bytes") is None:  # a GPU's peak
        row["estimate_over_measured"] = row["estimated_peak_bytes"] / row["peak_bytes"]
    row["rounds"] = len(runs)
    return row


def summarize(rows: list[dict], peak: float) -> None:
    for r in rows:
        if "error" in r:
            continue
        r["step_s"] = statistics.median(r["step_seconds"])
        r["tokens_per_s"] = r["tokens_per_step"] / r["step_s"]
        r["mfu"] = r["flops_per_step"] / r["step_s"] / peak
    for mode in MODES:
        base = next((r for r in rows if r["method"] == "lora" and r["mode"] == mode and "error" not in r), None)
        for r in rows:
            if r["mode"] == mode and base is not None and "error" not in r:
                r["vs_lora"] = r["tokens_per_s"] / base["tokens_per_s"]
                r["peak_vs_lora"] = r["peak_bytes"] / base["peak_bytes"]
                r["budget_vs_lora"] = r["trainable"] / base["trainable"]
        # the NF4 tuners against peft LoRA on the same NF4 base (QLoRA)
        qbase = next((r for r in rows if r["method"] == "qlora" and r["mode"] == mode and "error" not in r), None)
        for r in rows:
            if r["mode"] == mode and r["method"] in QUANTIZED and qbase is not None and "error" not in r:
                r["vs_qlora"] = r["tokens_per_s"] / qbase["tokens_per_s"]


def render(payload: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in payload["rows"] if "error" not in r]
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.4
    for i, mode in enumerate(MODES):
        vals = [next((r.get("vs_lora", 0) for r in rows if r["method"] == m and r["mode"] == mode), 0) for m in methods]
        axes[0].bar([x + (i - 0.5) * width for x in range(len(methods))], vals, width, label=mode)
        mem = [
            next((r["peak_bytes"] / 2**30 for r in rows if r["method"] == m and r["mode"] == mode), 0) for m in methods
        ]
        axes[1].bar([x + (i - 0.5) * width for x in range(len(methods))], mem, width, label=mode)
    axes[0].axhline(1.0, color="k", lw=0.8, ls="--")
    axes[0].set_ylabel("tokens/s over peft LoRA's (same mode)")
    axes[1].set_ylabel("peak memory (GiB; how: the JSON's peak_kind)")
    for ax in axes:
        ax.set_xticks(range(len(methods)))
        ax.set_xticklabels(methods, rotation=30)
        ax.legend()
    fig.suptitle(f"{payload['preset']}: batch {payload['batch']} x {payload['seq']} tokens")
    fig.tight_layout()
    return fig


def _failures(payload: dict) -> str:
    """The line under a table naming the rows that failed, with their errors ("" when none did)."""
    failed = [r for r in payload["rows"] if "error" in r]
    if not failed:
        return ""
    return "\n\nFailed: " + "; ".join(f"{r['method']} {r.get('mode', '')}: {r['error']}" for r in failed)


# the columns every throughput table shows: key, header, format
SPEED_COLUMNS = [
    ("step_s", "step (s)", ".3f"),
    ("tokens_per_s", "tokens/s", ",.0f"),
    ("vs_lora", "vs LoRA", ".2f"),
    ("vs_qlora", "vs QLoRA", ".2f"),
    ("mfu", "MFU", ".3f"),
    ("peak_bytes", "peak bytes", ",d"),
]


def table(payload: dict) -> str:
    rows = sorted(
        (r for r in payload["rows"] if "error" not in r),
        key=lambda r: (MODES.index(r["mode"]), METHODS.index(r["method"])),
    )
    md = markdown_table(
        rows,
        [
            ("method", "method", ""),
            ("mode", "mode", ""),
            ("trainable", "trainable", ",d"),
            ("budget_vs_lora", "budget / LoRA's", ".2f"),
            *SPEED_COLUMNS,
            ("peak_vs_lora", "peak / LoRA's", ".2f"),
            ("estimated_peak_bytes", "estimated peak (hf_dtrain.estimate)", ",d"),
            ("estimate_over_measured", "estimate / measured (GPU: peak bytes; CPU: the tensors' peak)", ".3f"),
        ],
    )
    return md + _failures(payload)


PROFILE_FAMILIES = ("base GEMM", "adapter GEMM", "adapter other", "casts", "elementwise", "attention", "loss head")


def profile_main(args, preset: str, batch: int, seq: int, script: str) -> None:
    """``--profile``: one eager step of every method through the step profile, in a fresh process each."""
    import torch

    from hf_dtrain.models import build_llama

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model")
        build_llama(preset, seed=0).save_pretrained(path)
        for method in args.methods.split(","):
            spec = f"{method}:eager:{path}:{batch}:{seq}:1:1:1:0"
            row = run_worker(script, ["--worker", spec], what=f"{method} profile", timeout=3600)
            rows.append(row)
            kept = row.get("saved_bytes", 0) / 2**20
            print(f"{method:10s} {row.get('ops', '?')} ops, {kept:.1f} MiB kept", flush=True)
    base = next((r for r in rows if r["method"] == "lora" and "error" not in r), None)
    for r in rows:
        if base is not None and "error" not in r:
            r["ops_vs_lora"] = r["ops"] / base["ops"]
            r["saved_vs_lora"] = r["saved_bytes"] / base["saved_bytes"]
            r["step_vs_lora"] = r["step_s"] / base["step_s"]
        for fam in PROFILE_FAMILIES:
            r[f"ms {fam}"] = 1e3 * r.get("families", {}).get(fam, {}).get("seconds", 0.0)
        r["ms optimizer"] = 1e3 * r.get("families", {}).get("optimizer", {}).get("seconds", 0.0)
        paths = r.get("paths", {})
        r["lean layers"] = f"{paths.get('lean', 0)}+{paths.get('lean adapter', 0)}/{paths.get('layers', 0)}"
        blocks = paths.get("blocks", {}).get("lean block", 0)
        r["lean layers"] += f", {blocks} blocks" if blocks else ""
    payload = {
        "preset": preset,
        "batch": batch,
        "seq": seq,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "rows": rows,
    }
    notes = (
        f"{preset} LLaMA (random weights from LlamaConfig), batch {batch} x {seq} tokens, AdamW, "
        f"{precision_note(torch.cuda.is_available())}; one eager step "
        "after a warm-up one, each method in a fresh process, every aten op counted and timed by "
        "hf_dtrain.fast.profile.StepProfile (on CPU each op's wall time, the dispatch adding a constant per op; "
        "views are not counted as ops); kept: bytes autograd keeps for backward, once per storage, parameters "
        "excluded; step: median of 3 steps without the profile. lean layers: lean + lean adapter / tuner layers "
        "(the layers of a lean block, MLP or attention, among the lean; the JSON's paths say why the others took "
        "the plain path). Counts and bytes are deterministic; the times are one step's."
    )
    paths = write(f"{args.name}_profile", payload, profile_table(payload), profile_render(payload), notes)
    print(profile_table(payload))
    print("wrote", ", ".join(str(p) for p in paths.values()))


def profile_table(payload: dict) -> str:
    rows = [r for r in payload["rows"] if "error" not in r]
    md = markdown_table(
        rows,
        [
            ("method", "method", ""),
            ("trainable", "trainable", ",d"),
            ("ops", "ops", ",.0f"),
            ("ops_vs_lora", "ops / LoRA's", ".2f"),
            ("saved_bytes", "kept for backward (bytes)", ",.0f"),
            ("saved_vs_lora", "kept / LoRA's", ".2f"),
            ("step_s", "step (s)", ".3f"),
            ("step_vs_lora", "step / LoRA's", ".2f"),
            *[(f"ms {fam}", f"{fam} (ms)", ".0f") for fam in PROFILE_FAMILIES],
            ("ms optimizer", "optimizer (ms)", ".0f"),
            ("lean layers", "lean layers", ""),
        ],
    )
    return md + _failures(payload)


def profile_render(payload: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in payload["rows"] if "error" not in r]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    bottom = [0.0] * len(rows)
    for fam in (*PROFILE_FAMILIES, "optimizer"):
        vals = [r[f"ms {fam}"] for r in rows]
        axes[0].bar(range(len(rows)), vals, bottom=bottom, label=fam)
        bottom = [b + v for b, v in zip(bottom, vals)]
    axes[0].set_ylabel("ms per step, by op family (profiled)")
    axes[0].legend(fontsize=7)
    axes[1].bar(range(len(rows)), [r["saved_bytes"] / 2**20 for r in rows])
    axes[1].set_ylabel("MiB kept for backward")
    for ax in axes:
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([r["method"] for r in rows], rotation=30)
    fig.suptitle(f"{payload['preset']}: batch {payload['batch']} x {payload['seq']} tokens, one eager step")
    fig.tight_layout()
    return fig


def save_model(preset: str, path: str, cuda: bool) -> None:
    """The preset's random weights (seed 0), saved once for every worker to load. On a GPU they are made on the device
    in bf16 (the 8B shape in fp32 on the host would take 32 GB of memory and a minute to initialise)."""
    import torch

    from hf_dtrain.models import build_llama, llama_config

    if not cuda:
        build_llama(preset, seed=0).save_pretrained(path)
        return
    from transformers import LlamaForCausalLM

    default = torch.get_default_dtype()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(llama_config(preset))
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()


def _commit() -> str:
    """The commit measured: ``$HF_DTRAIN_COMMIT`` (a copied tree without ``.git``, as the GPU machine gets), else
    git's HEAD of this checkout (``+dirty`` with uncommitted changes to tracked files)."""
    import subprocess

    if os.environ.get("HF_DTRAIN_COMMIT"):
        return os.environ["HF_DTRAIN_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "diff", "--quiet", "HEAD"], capture_output=True).returncode
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout; set HF_DTRAIN_COMMIT)"
    return head + ("+dirty" if dirty else "")


RUN_KEYS = ("date", "device", "commit", "torch", "preset", "batch", "seq", "checkpointing", "source")
ROW_KEYS = (
    "method", "mode", "trainable", "step_s", "tokens_per_s", "vs_lora", "vs_qlora", "mfu", "peak_bytes",
    "peak_vs_lora", "estimated_peak_bytes", "tensor_peak_bytes", "estimate_over_measured", "paths", "error",
)  # fmt: skip


def accumulate(name: str, payload: dict, env: dict, source: str) -> dict[str, Path]:
    """Append this run's rows to ``results/<name>.*`` (one file over several GPU runs): every earlier row is kept as it
    was; each new row carries its run's date, device, commit, torch version and shape."""
    path = RESULTS / f"{name}.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    run = {
        "date": env["date"],
        "device": payload.get("device") or env.get("gpu"),
        "commit": _commit(),
        "torch": env.get("torch"),
        "preset": payload["preset"],
        "batch": payload["batch"],
        "seq": payload["seq"],
        "checkpointing": payload.get("checkpointing", False),
        "source": source,
    }
    rows = rows + [{**run, **{k: r[k] for k in ROW_KEYS if k in r}} for r in payload["rows"]]
    out = {"rows": rows}
    notes = (
        "Rows of every run of benchmarks/throughput.py --accumulate, oldest first, each with the run it comes from "
        "(its own table: source). vs LoRA / vs QLoRA: tokens/s over peft LoRA's (QLoRA's, on the same NF4 base) in "
        "the same run and mode. lean: layers whose last training forward took hf_dtrain.fast's lean path, of those "
        "with an adapter. The environment below is the latest run's."
    )
    return write(name, out, accumulated_table(out), accumulated_render(out), notes, env=env)


def accumulated_table(payload: dict) -> str:
    rows = []
    for r in payload["rows"]:
        paths = r.get("paths") or {}
        rows.append(
            {
                **r,
                "shape": f"{r['preset']} {r['batch']}x{r['seq']}" + (" ckpt" if r.get("checkpointing") else ""),
                "lean": f"{paths.get('lean', 0)}/{paths.get('layers', 0)}" if paths else "n/a",
                "status": r.get("error", "ok")[:60],
            }
        )
    return markdown_table(
        rows,
        [
            ("date", "date", ""),
            ("device", "device", ""),
            ("commit", "commit", ""),
            ("torch", "torch", ""),
            ("shape", "shape", ""),
            ("method", "method", ""),
            ("mode", "mode", ""),
            *SPEED_COLUMNS,
            ("lean", "lean", ""),
            ("status", "status", ""),
        ],
    )


def accumulated_render(payload: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in payload["rows"] if r.get("tokens_per_s")]
    fig, ax = plt.subplots(figsize=(10, max(3, 0.25 * len(rows) + 1)))
    labels = [f"{r['date'][:16]} {r['device']} {r['preset']} {r['method']} {r['mode']}" for r in rows]
    ax.barh(range(len(rows)), [r.get("vs_lora") or 0 for r in rows])
    ax.axvline(1.0, color="k", lw=0.8, ls="--")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s over peft LoRA's (same run and mode)")
    fig.tight_layout()
    return fig


def _peak_from(ap: argparse.ArgumentParser, path: str, device: str) -> dict:
    """``--peak-from``: the matmul peak of an earlier run's results JSON, refused unless that run was on this device."""
    try:
        earlier = json.loads(Path(path).read_text())
        peak = {"peak_flops": float(earlier["peak_flops"]), "peak_source": earlier["peak_source"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        ap.error(f"--peak-from {path}: not a results JSON of this benchmark with peak_flops ({type(e).__name__}: {e})")
    if earlier.get("device") != device:
        ap.error(f"--peak-from {path}: measured on {earlier.get('device')!r}, this run is on {device!r}: drop the flag")
    return {**peak, "peak_source": f"{peak['peak_source']} (taken from {Path(path).name})"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--preset", default=None, help="one LlamaConfig preset (default: 100m on CPU, llama3.2-1b on a GPU)"
    )
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 4 on CPU, 8 on a GPU)")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence (default 256 on CPU, 1024 on a GPU)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per method and mode")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
    ap.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="rounds over every (method, mode), in reversed order every other round; each row pools "
        "the timed steps of all its rounds (this host's step times drift by 10-15%% between runs)",
    )
    ap.add_argument("--name", default="throughput", help="results/<name>.{json,md,png}")
    ap.add_argument(
        "--time-budget",
        type=float,
        default=0.0,
        help="seconds: start no further (method, mode) once this much has passed (0: no limit); the "
        "rest are listed as not measured",
    )
    ap.add_argument(
        "--order",
        choices=("method", "mode"),
        default="method",
        help="method: each method's modes one after another; mode: every method eager, then every "
        "method compiled (with a short --time-budget, every eager row comes first)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="instead of timing: one eager step per method through hf_dtrain.fast.profile (ops, times and bytes kept "
        "for backward by op family, and the layers' lean paths) into results/<name>_profile.*",
    )
    ap.add_argument(
        "--checkpointing",
        action="store_true",
        help="activation checkpointing per decoder layer (every row): the 8B shape on one GPU",
    )
    ap.add_argument(
        "--accumulate",
        metavar="NAME",
        help="also append this run's rows (each with its date, device, commit and torch version) to results/<NAME>.*, "
        "keeping every earlier run's rows",
    )
    ap.add_argument(
        "--from-json",
        metavar="PATH",
        help="with --accumulate: append the rows of an earlier run's results JSON (its own date and torch version; "
        "the commit from $HF_DTRAIN_COMMIT) instead of measuring",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--peak-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--peak-size",
        type=int,
        default=4096,
        help="the square matmul timed for the device's peak where no datasheet figure applies (a dry run's mechanics "
        "need no more than 512)",
    )
    ap.add_argument(
        "--peak-from",
        metavar="PATH",
        help="take the device's matmul peak from an earlier run's results JSON on the same machine (its peak_flops and "
        "peak_source, the source naming that file) instead of timing it again in a fresh process",
    )
    args = ap.parse_args()
    if args.peak_worker:
        emit_result(matmul_peak(args.peak_size))
        return
    if args.worker:
        method, mode, path, batch, seq, steps, warmup, prof, ckpt = args.worker.split(":")
        try:
            emit_result(
                worker(method, mode, path, int(batch), int(seq), int(steps), int(warmup), prof == "1", ckpt == "1")
            )
        except Exception as e:  # reported in the table, not a crashed run
            emit_result({"method": method, "mode": mode, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        return

    if args.from_json:
        if not args.accumulate:
            ap.error("--from-json appends an earlier run's rows: give --accumulate NAME too")
        earlier = json.loads(Path(args.from_json).read_text())  # its figures as that run computed them
        source = os.path.relpath(os.path.abspath(args.from_json), Path(__file__).resolve().parent)
        written = accumulate(args.accumulate, earlier, earlier["environment"], source)
        print("appended to", ", ".join(str(p) for p in written.values()))
        return

    import torch

    cuda = torch.cuda.is_available()
    preset = args.preset or ("llama3.2-1b" if cuda else "100m")
    batch = args.batch or (8 if cuda else 4)
    seq = args.seq if args.seq != 256 or not cuda else 1024
    script = os.path.abspath(__file__)
    if args.profile:
        profile_main(args, preset, batch, seq, script)
        return
    rows, not_measured = [], []
    # checked before the model is built
    peak = _peak_from(ap, args.peak_from, torch.cuda.get_device_name(0) if cuda else "cpu") if args.peak_from else None
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model")
        save_model(preset, path, cuda)
        if peak is None:
            peak = run_worker(script, ["--peak-worker", "--peak-size", str(args.peak_size)], what="matmul peak")
        print(f"peak {peak['peak_flops'] / 1e9:.0f} GFLOP/s ({peak['peak_source']})", flush=True)
        methods, modes = args.methods.split(","), args.modes.split(",")
        runs = (
            [(m, mode) for m in methods for mode in modes]
            if args.order == "method"
            else [(m, mode) for mode in modes for m in methods]
        )
        rounds: dict[tuple, list] = {}
        for round_ in range(args.repeats):
            for method, mode in runs if round_ % 2 == 0 else runs[::-1]:
                t0 = time.perf_counter()
                if args.time_budget and t0 - start > args.time_budget:
                    if round_ == 0:
                        not_measured.append(f"{method} {mode}")
                    continue
                spec = (
                    f"{method}:{mode}:{path}:{batch}:{seq}:{args.steps}:{args.warmup}:{int(args.profile)}"
                    f":{int(args.checkpointing)}"
                )
                row = run_worker(
                    script,
                    ["--worker", spec],
                    what=f"{method} {mode}",
                    timeout=3600,
                )
                rounds.setdefault((method, mode), []).append(row)
                done = f"{statistics.median(row['step_seconds']):.3f} s/step" if "error" not in row else row["error"]
                print(
                    f"round {round_ + 1}: {method:8s} {mode:8s} {done} ({time.perf_counter() - t0:.0f} s)", flush=True
                )
        for key in runs:
            if key in rounds:
                rows.append(_pooled(rounds[key]))
    summarize(rows, peak["peak_flops"])
    payload = {
        "preset": preset,
        "batch": batch,
        "seq": seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "order": args.order,
        "checkpointing": args.checkpointing,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        **peak,
        "rows": rows,
        "not_measured": not_measured,
    }
    notes = (
        f"{preset} LLaMA (random weights from LlamaConfig), batch {batch} x {seq} tokens, AdamW, "
        f"{precision_note(cuda)}"
        f"{', activation checkpointing per decoder layer' if args.checkpointing else ''}; median of "
        f"{args.steps} timed steps after {args.warmup} warm-up steps in each of {args.repeats} rounds (every "
        f"other one in reversed order), each (method, mode) in a fresh process. MFU: FLOPs counted by "
        f"torch.utils.flop_counter for one step over the step time and {peak['peak_source']} "
        f"({peak['peak_flops'] / 1e12:.3f} TFLOP/s). vs LoRA: tokens/s over peft LoRA's in the same mode."
    )
    if not_measured:
        notes += f" Not measured (time budget {args.time_budget:.0f} s spent): {', '.join(not_measured)}."
    (Path(__file__).resolve().parent / "results" / args.name).parent.mkdir(parents=True, exist_ok=True)
    paths = write(args.name, payload, table(payload), render(payload), notes)
    print(table(payload))
    print("wrote", ", ".join(str(p) for p in paths.values()))
    if args.accumulate:
        written = accumulate(args.accumulate, payload, environment(), f"results/{args.name}.json")
        print("appended to", ", ".join(str(p) for p in written.values()))


if __name__ == "__main__":
    main()
