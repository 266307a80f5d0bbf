"""Per-rank memory of data parallelism against the sharded engines: DDP (replicated), FSDP2 (hf_dtrain.parallel.
apply_fsdp) and DeepSpeed ZeRO-3, at 1, 2 and 4 gloo ranks, on the tiny and small LLaMA presets, for full
fine-tuning and each hf_dtrain tuner.

Each rank's bytes are counted from the tensors the engine holds between backward and the optimizer step, on rank 0:

- parameters: the local shard (FSDP2's DTensor ``to_local()``, ZeRO-3's ``ds_tensor`` partition), else the whole
  tensor;
- gradients: ``.grad`` of each local parameter (FSDP2's local shard), or ZeRO-3's partitioned gradient buffer;
- optimizer state: the AdamW moments (``exp_avg``, ``exp_avg_sq``) in the innermost torch optimizer's state, plus
  ZeRO-3's fp32 master partitions;
- activations: the bytes autograd saves in one forward (unique storages, parameters excluded), counted on the
  DDP run: none of the three engines shards them.

DDP's gradient buckets (a second copy of the gradients while they are reduced) are not counted. Step time is the
median of the timed steps, as a ratio to DDP at the same world size, preset and method (one thread per rank; this
machine is noisy, and 4 ranks share 2 cores). JSON, markdown and a PNG under ``benchmarks/results/``.

    python benchmarks/sharded.py              # about 10 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import markdown_table, rerender, write

ENGINES = ["ddp", "fsdp2", "zero3"]
WORLDS = [1, 2, 4]
PRESETS = ["tiny", "small"]
METHODS = ["full", "smt", "lorafa", "qbara", "qahira"]
BATCH, SEQ, WARMUP, TIMED = 4, 128, 1, 3
KINDS = ["params", "grads", "optimizer", "activations"]


def _tuned(method: str, model):
    """``model`` with ``method``'s adapter (budgets near LoRA r=8 on every projection), or itself for full."""
    from peft import get_peft_model

    from hf_dtrain import LoraFAConfig, QAHiRAConfig, QBaRAConfig, SMTConfig, smt_warmup
    from hf_dtrain.testing import random_batch

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    if method == "full":
        return model
    config = {
        "smt": lambda: SMTConfig(block_size=64, num_blocks=64, target_modules=targets),
        "lorafa": lambda: LoraFAConfig(r=8, target_modules=targets, init_seed=0),
        "qbara": lambda: QBaRAConfig(r=8, target_modules=targets, require_quantized_base=False),
        "qahira": lambda: QAHiRAConfig(group_size=64, target_modules=targets, require_quantized_base=False),
    }[method]()
    model = get_peft_model(model, config)
    if method == "smt":  # selection before any engine wraps the model (the ranks' scores are summed)
        vocab = model.config.vocab_size
        smt_warmup(model, [random_batch(batch=2, seq=SEQ, vocab=vocab, seed=1)], num_steps=1, progress=False)
    return model


def _tensor_bytes(t) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _optimizer_bytes(optimizer) -> int:
    from hf_dtrain.distributed.engines import unwrap_optimizer

    inner = unwrap_optimizer(optimizer)
    total = 0
    for state in inner.state.values():
        total += sum(_tensor_bytes(v) for v in state.values() if hasattr(v, "numel") and v.numel() > 1)
    return total


def _rank(rank: int, world: int, engine: str, out: str, presets: list, methods: list) -> None:
    import contextlib
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from hf_dtrain.models import build_llama
    from hf_dtrain.parallel import apply_fsdp, local_param_bytes
    from hf_dtrain.testing import SavedTensorCounter, random_batch

    os.environ["DS_ACCELERATOR"] = "cpu"
    torch.set_num_threads(1)  # one thread per rank: 1, 2 and 4 ranks see the same per-rank compute
    rows = []
    for preset in presets:
        for method in methods:
            torch.manual_seed(0)
            model = _tuned(method, build_llama(preset, seed=0))
            vocab = model.config.vocab_size
            params = [p for p in model.parameters() if p.requires_grad]
            ds_engine = None
            if engine == "fsdp2":
                apply_fsdp(model)
                params = [p for p in model.parameters() if p.requires_grad]
                optimizer = torch.optim.AdamW(params, lr=1e-4)
            elif engine == "zero3":
                import deepspeed

                config = {
                    "train_micro_batch_size_per_gpu": BATCH,
                    "gradient_accumulation_steps": 1,
                    "gradient_clipping": 0.0,
                    "zero_allow_untested_optimizer": True,
                    "steps_per_print": 10**9,
                    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                }
                ds_engine, optimizer, *_ = deepspeed.initialize(
                    model=model, optimizer=torch.optim.AdamW(params, lr=1e-4), config=config, dist_init_required=False
                )
            else:
                if world > 1:
                    model = torch.nn.parallel.DistributedDataParallel(model)
                optimizer = torch.optim.AdamW(params, lr=1e-4)
            module = ds_engine.module if ds_engine is not None else getattr(model, "module", model)
            times, measured = [], {}
            for step in range(WARMUP + TIMED):
                batch = random_batch(batch=BATCH, seq=SEQ, vocab=vocab, seed=100 + 10 * step + rank)
                # saved activations are counted on DDP's run (no engine shards them; FSDP2 and ZeRO-3 also save
                # their gathered parameters, which are not activations)
                counter = SavedTensorCounter(exclude=list(module.parameters())) if engine == "ddp" else None
                t0 = time.perf_counter()
                with counter() if counter is not None else contextlib.nullcontext():
                    loss = (ds_engine or model)(**batch).loss
                if ds_engine is not None:
                    ds_engine.backward(loss)
                else:
                    loss.backward()
                if step == WARMUP + TIMED - 1:  # what the engine holds between backward and the step
                    if ds_engine is not None:
                        inner = ds_engine.optimizer
                        grads = inner.grad_partitions_flat_buffer
                        measured["grads"] = grads.numel() * grads.element_size()
                        master = sum(t.numel() * t.element_size() for t in inner.fp32_partitioned_groups_flat)
                    else:
                        measured["grads"] = sum(_tensor_bytes(p.grad) for p in params if p.grad is not None)
                        master = 0
                    measured["activations"] = counter.nbytes if counter is not None else None
                if ds_engine is not None:
                    ds_engine.step()
                else:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                times.append(time.perf_counter() - t0)
            measured["params"] = local_param_bytes(module)
            measured["optimizer"] = _optimizer_bytes(optimizer) + master
            step_time = torch.tensor([statistics.median(times[WARMUP:])])
            dist.all_reduce(step_time, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            # global counts: a DTensor's numel is global; a ZeRO-3 parameter's is in ds_numel
            n_params = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
            n_trainable = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters() if p.requires_grad)
            rows.append(
                {
                    "engine": engine,
                    "world": world,
                    "preset": preset,
                    "method": method,
                    "step_seconds": float(step_time),
                    "n_params": n_params,
                    "n_trainable": n_trainable,
                    **measured,
                }
            )
            del model, optimizer, ds_engine
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def measure(worlds=WORLDS, presets=PRESETS, methods=METHODS) -> list[dict]:
    from tqdm.auto import tqdm

    from hf_dtrain.testing import run_distributed

    rows = []
    runs = [(engine, world) for world in worlds for engine in ENGINES]
    with tempfile.TemporaryDirectory() as tmp:
        for engine, world in tqdm(runs, desc="sharded"):
            out = os.path.join(tmp, f"{engine}_{world}.json")
            run_distributed(
                _rank, world_size=world, args=(engine, out, presets, methods), timeout=3000, pg_timeout_s=600
            )
            rows += json.loads(Path(out).read_text())
    ddp = {(r["world"], r["preset"], r["method"]): r for r in rows if r["engine"] == "ddp"}
    for r in rows:
        base = ddp[(r["world"], r["preset"], r["method"])]
        if r["activations"] is None:
            r["activations"] = base["activations"]
        r["total"] = sum(r[k] for k in KINDS)
    for r in rows:
        base = ddp[(r["world"], r["preset"], r["method"])]
        r["bytes_vs_ddp"] = r["total"] / base["total"]
        r["step_time_vs_ddp"] = r["step_seconds"] / base["step_seconds"]
    return rows


# On paper, for the real shapes: bytes of training state per GPU, bf16 training as users run it on GPUs
PAPER = dict(
    frozen_bytes=2,  # a frozen base loaded in bf16
    trainable_bytes=16,  # fp32 master / sharded param 4 + gradient 4 (ZeRO-3: bf16 param 2 + bf16 grad 2) + Adam 8
    lora_r=8,  # the tuners' trainable budget is matched to LoRA at this rank on all seven projections (the jobs do)
    gpu_gib=80,
)
PAPER_MODELS = ["llama2-7b", "llama2-70b"]
PAPER_GPUS = [8, 64, 512]


def _paper_rows() -> list[dict]:
    """Training state per GPU for full fine-tuning and a LoRA-r=8-budget adapter, replicated (DDP) or sharded over
    the GPUs (FSDP2 / ZeRO-3), from the real parameter shapes (a meta-device model, nothing allocated)."""
    import torch
    from transformers import LlamaForCausalLM

    from hf_dtrain.models import llama_config

    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    rows = []
    for preset in PAPER_MODELS:
        with torch.device("meta"):
            model = LlamaForCausalLM(llama_config(preset))
        total = sum(p.numel() for p in model.parameters())
        adapter = sum(
            PAPER["lora_r"] * sum(p.shape)
            for n, p in model.named_parameters()
            if n.endswith(".weight") and n.split(".")[-2] in targets
        )
        for method, trainable in (("full", total), ("adapter", adapter)):
            frozen = total - trainable
            state = PAPER["frozen_bytes"] * frozen + PAPER["trainable_bytes"] * trainable
            for engine, gpus, shards in [("ddp", "any", 1)] + [("fsdp2 / zero3", g, g) for g in PAPER_GPUS]:
                gib = state / shards / 2**30
                rows.append(
                    {
                        "model": preset,
                        "method": method,
                        "gpus": gpus,
                        "engine": engine,
                        "params_b": total / 1e9,
                        "trainable_m": trainable / 1e6,
                        "state_gib": gib,
                        "fits": "yes" if gib < PAPER["gpu_gib"] else "no",
                    }
                )
        del model
    return rows


def render(payload: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    mib = 1 / 2**20
    table_rows = [{**r, **{f"{k}_mib": r[k] * mib for k in KINDS + ["total"]}} for r in rows]
    columns = [
        ("preset", "preset", ""),
        ("method", "method", ""),
        ("world", "ranks", "d"),
        ("engine", "engine", ""),
        ("params_mib", "params MiB", ".2f"),
        ("grads_mib", "grads MiB", ".2f"),
        ("optimizer_mib", "optimizer MiB", ".2f"),
        ("activations_mib", "activations MiB", ".1f"),
        ("total_mib", "total MiB", ".1f"),
        ("bytes_vs_ddp", "bytes / DDP", ".2f"),
        ("step_time_vs_ddp", "step time / DDP", ".2f"),
    ]
    table = markdown_table(table_rows, columns)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, preset in zip(axes, PRESETS):
        for engine, style in zip(ENGINES, ["-o", "--s", ":^"]):
            for method, color in zip(["full", "lorafa"], ["C0", "C1"]):
                pts = sorted(
                    (r["world"], (r["total"] - r["activations"]) * mib)
                    for r in rows
                    if r["engine"] == engine and r["preset"] == preset and r["method"] == method
                )
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=f"{engine} {method}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(WORLDS, [str(w) for w in WORLDS])
        ax.set_xlabel("ranks")
        ax.set_ylabel("parameters + gradients + optimizer state per rank (MiB)")
        ax.set_title(f"{preset} preset")
        ax.legend(fontsize=7)
    fig.tight_layout()
    full = {(r["engine"], r["world"], r["preset"]): r for r in rows if r["method"] == "full"}
    lines = []
    for preset in PRESETS:
        for world in WORLDS[1:]:
            f, z = full[("fsdp2", world, preset)], full[("zero3", world, preset)]
            lines.append(
                f"- {preset}, full fine-tuning, {world} ranks: FSDP2 holds {f['bytes_vs_ddp']:.2f}x DDP's "
                f"bytes per rank at {f['step_time_vs_ddp']:.2f}x its step time; ZeRO-3 "
                f"{z['bytes_vs_ddp']:.2f}x at {z['step_time_vs_ddp']:.2f}x."
            )
    notes = (
        "Bytes are counted per rank on rank 0 (see the module docstring for what each column holds); activations "
        "are not sharded by any engine, so the totals fall less than the model state does. Step time is the "
        "slowest rank's median over the timed steps; 4 ranks share 2 CPU cores, so times at 4 ranks are "
        "mostly contention.\n\n" + "\n".join(lines)
    )
    per_param = []
    for r in rows:
        if r["method"] == "full" and r["world"] in (1, max(WORLDS)):
            per_param.append(
                f"{r['engine']} at {r['world']} rank(s), {r['preset']}: "
                f"{(r['params'] + r['grads'] + r['optimizer']) / r['n_params']:.2f} bytes/param"
            )
    notes += (
        "\n\nMeasured training state per parameter per rank, full fine-tuning in fp32 (parameters + gradients + "
        "optimizer state, over the model's parameter count): " + "; ".join(per_param) + ". Sharding divides it "
        "by the ranks (padding of uneven shards aside); ZeRO-3 adds its fp32 master partition (4 bytes/param) "
        "here because the client optimizer steps on its own flat copy."
    )
    paper = payload.get("paper") or []
    if paper:
        p = PAPER
        notes += (
            "\n\n## On paper: LLaMA-2 7B and 70B\n\nTraining state per GPU (activations and the transient "
            f"gathered layer not included) with bf16 training: a frozen base at {p['frozen_bytes']} bytes/param, "
            f"trainable parameters at {p['trainable_bytes']} bytes/param (fp32 master 4 + gradient 4 + Adam 8; "
            "ZeRO-3 in bf16: bf16 parameter 2 + bf16 gradient 2 + fp32 master 4 + Adam 8), replicated by DDP "
            "or divided by the GPUs under FSDP2 / ZeRO-3 as measured above. The adapter row stands for all "
            f"four tuners: the jobs match their trainable count to LoRA at r={p['lora_r']} on all seven "
            f"projections. 'fits' compares with {p['gpu_gib']} GiB.\n\n"
            + markdown_table(
                paper,
                [
                    ("model", "model", ""),
                    ("method", "method", ""),
                    ("gpus", "GPUs", ""),
                    ("engine", "engine", ""),
                    ("trainable_m", "trainable (M)", ".1f"),
                    ("state_gib", "state per GPU (GiB)", ".1f"),
                    ("fits", "fits 80 GB", ""),
                ],
            )
        )
    return table, fig, notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from-json", metavar="PATH", help="only rebuild the table and plot from a results JSON")
    args = ap.parse_args()
    if args.from_json:
        paths = rerender(args.from_json, "sharded", render)
    else:
        payload = {
            "rows": measure(),
            "paper": _paper_rows(),
            "paper_assumptions": PAPER,
            "batch": BATCH,
            "seq": SEQ,
            "timed_steps": TIMED,
        }
        table, fig, notes = render(payload)
        paths = write("sharded", payload, table, fig, notes)
    print("\n".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    main()
