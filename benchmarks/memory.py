"""Activation memory on this machine: no saving, full gradient checkpointing, transformers' offload option,
torchtune-style offload of everything (its technique: saved-tensor hooks to the host tier), and DELTA at several
budgets, on the default model ("tiny") and a larger LLaMA shape ("small").

Each method runs in a fresh process (peak RSS is the process's own ``ru_maxrss``), a few SGD steps of batch 8 x 256
tokens, median step time after a warm-up step, as a ratio to no saving. Saved-tensor bytes are measured with
saved-tensor hooks (unique storages, parameters excluded; for checkpointed layers, their kept inputs). Then the
largest batch whose saved activations fit a fixed budget (the no-saving bytes of batch 8), without saving and with
DELTA, from measured profiles at each batch size. JSON, markdown and a PNG (memory against step time) under
``benchmarks/results/``.

    python benchmarks/memory.py              # about 6 minutes on 2 CPU cores
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit_result, run_worker

PRESETS = ["tiny", "small"]
BUDGETS = [0.75, 0.5, 0.25, 0.15]
SUB_BUDGETS = [0.5, 0.25]  # granularity="submodule": attention, MLP and norms planned separately
BATCH, SEQ, STEPS = 8, 256, 4


def _saved_counter(model):
    from hf_dtrain.testing import SavedTensorCounter

    return SavedTensorCounter(exclude=list(model.parameters()))


def worker(preset: str, method: str, batch: int, seq: int, steps: int) -> dict:
    import resource
    import statistics
    import time

    import torch

    from hf_dtrain.memory import apply_delta
    from hf_dtrain.memory.executor import FileTier
    from hf_dtrain.models import build_llama
    from hf_dtrain.testing import random_batch

    torch.manual_seed(0)
    model = build_llama(preset, seed=0)
    vocab = model.config.vocab_size
    scheduler = None
    counted = None
    if method == "checkpoint":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif method == "hf_offload":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, "offload": True})
    elif method == "offload_all":  # torchtune's technique on this host: every saved activation to the host tier
        tier = FileTier()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        counted = {"offloaded": 0}

        def pack(t):
            if t.untyped_storage().data_ptr() in params:
                return t
            counted["offloaded"] += t.numel() * t.element_size()
            return ("off", tier.store(t))

        def unpack(x):
            return tier.load(x[1]) if isinstance(x, tuple) and x and x[0] == "off" else x
    elif method.startswith("delta"):  # delta_<budget>: per decoder layer; delta-sub_<budget>: per sub-module;
        # delta-mem_<budget>: the fewest bytes predicted no slower than full checkpointing
        scheduler = apply_delta(
            model,
            float(method.split("_")[1]),
            granularity="submodule" if method.startswith("delta-sub") else "layer",
            objective="memory" if method.startswith("delta-mem") else "time",
        )
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times, saved = [], []
    for step in range(steps + 1):
        b = random_batch(batch=batch, seq=seq, vocab=vocab, seed=step)
        start = time.perf_counter()
        if method == "offload_all":
            tier.reset()
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                loss = model(**b).loss
            saved.append(0)
        elif scheduler is not None:
            loss = model(**b).loss
            saved.append(scheduler.executor.stats.saved_bytes)
        else:
            counter = _saved_counter(model)  # checkpointed layers' inputs are saved through these hooks too
            with counter():
                loss = model(**b).loss
            saved.append(counter.nbytes)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step:  # the first step warms up (and, for DELTA, profiles and plans)
            times.append(time.perf_counter() - start)
    row = {
        "preset": preset,
        "method": method,
        "step_seconds": statistics.median(times),
        "saved_bytes": saved[-1],
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "loss": loss.item(),
    }
    if scheduler is not None:
        plan = next(iter(scheduler.plans.values()))
        row["plan"] = plan.actions
        row["budget_bytes"] = plan.budget
        row["plan_table"] = plan.table()
    return row


def largest_batch(preset: str, seq: int, budget_bytes: int, max_batch: int = 48) -> dict:
    """Largest batch whose saved activations fit ``budget_bytes``: without saving (all kept) and with DELTA (its
    minimum feasible budget), from a measured profile at batch sizes 1-8, then x1.5 steps."""
    import torch

    from hf_dtrain.memory import minimum_budget, profile_step
    from hf_dtrain.memory.executor import FileTier
    from hf_dtrain.models import build_llama
    from hf_dtrain.testing import random_batch

    model = build_llama(preset, seed=0)
    tier = FileTier()
    fits = {"none": 0, "delta": 0}
    b = 1
    while b <= max_batch:
        profile = profile_step(model, random_batch(batch=b, seq=seq, vocab=model.config.vocab_size), tier)
        if profile.total_saved_bytes <= budget_bytes:
            fits["none"] = b
        if minimum_budget(profile) <= budget_bytes:
            fits["delta"] = b
        else:
            break
        b = b + 1 if b < 8 else int(b * 1.5)
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return fits


def main():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--from-json")
    ap.add_argument("--worker")
    args = ap.parse_args()
    if args.from_json:
        from _report import rerender

        rerender(args.from_json, "memory", render)
        return
    if args.worker:
        preset, method = args.worker.split(":")
        emit_result(worker(preset, method, BATCH, SEQ, STEPS))
        return
    from tqdm import tqdm

    methods = (
        ["none", "checkpoint", "hf_offload", "offload_all"]
        + [f"delta_{b}" for b in BUDGETS]
        + [f"delta-sub_{b}" for b in SUB_BUDGETS]
        + ["delta-mem_0.5"]
    )
    rows, batches = [], []
    env = dict(os.environ, OMP_NUM_THREADS="2")
    for preset in args.presets.split(","):
        for method in tqdm(methods, desc=preset):
            rows.append(run_worker(__file__, ["--worker", f"{preset}:{method}"], env=env, timeout=1800))
        none = next(r for r in rows if r["preset"] == preset and r["method"] == "none")
        batches.append(
            {"preset": preset, "budget_bytes": none["saved_bytes"], **largest_batch(preset, SEQ, none["saved_bytes"])}
        )
    payload = {"rows": rows, "largest_batch": batches, "batch": BATCH, "seq": SEQ, "steps": STEPS}
    from _report import write

    table, fig, notes = render(payload)
    paths = write("memory", payload, table, fig, notes)
    print(table)
    print("\n".join(str(p) for p in paths.values()))


def render(payload: dict):
    from _report import markdown_table

    rows = payload["rows"]
    for r in rows:
        none = next(x for x in rows if x["preset"] == r["preset"] and x["method"] == "none")
        r["time_vs_none"] = r["step_seconds"] / none["step_seconds"]
        r["saved_vs_none"] = r["saved_bytes"] / none["saved_bytes"]
        r["saved_mib"] = r["saved_bytes"] / 2**20
        r["rss_mib"] = r["peak_rss_bytes"] / 2**20
        r["actions"] = (
            ", ".join(f"{a}: {list(r['plan'].values()).count(a)}" for a in ("keep", "recompute", "offload"))
            + (
                " (sub-modules)"
                if r["method"].startswith("delta-sub")
                else " (layers, fewest bytes)"
                if r["method"].startswith("delta-mem")
                else " (layers)"
            )
            if "plan" in r
            else None
        )
    table = markdown_table(
        rows,
        [
            ("preset", "model", ""),
            ("method", "method", ""),
            ("saved_mib", "saved activations (MiB)", ".1f"),
            ("saved_vs_none", "saved / no saving", ".2f"),
            ("rss_mib", "peak RSS (MiB)", ".0f"),
            ("step_seconds", "step time (s)", ".3f"),
            ("time_vs_none", "step time / no saving", ".2f"),
            ("actions", "DELTA plan (units)", ""),
        ],
    )
    for b in payload["largest_batch"]:
        b["ratio"] = b["delta"] / max(1, b["none"])
    table += "\n\n### Largest batch whose saved activations fit a fixed budget\n\n" + markdown_table(
        payload["largest_batch"],
        [
            ("preset", "model", ""),
            ("budget_bytes", "budget (bytes)", ""),
            ("none", "no saving", ""),
            ("delta", "DELTA", ""),
            ("ratio", "DELTA / no saving", ".1f"),
        ],
    )
    notes = (
        f"Batch {payload['batch']} x {payload['seq']} tokens, SGD, {payload['steps']} timed steps after one warm-up "
        "step (DELTA profiles and plans in it), median step time; each method in a fresh process on this 2-core CPU "
        "host. Saved activations: unique storages saved for backward, parameters excluded (checkpointed layers: their "
        "kept inputs); what is offloaded to the file tier is not counted as saved. transformers' offload option on a "
        "host without a GPU copies the checkpoint inputs to host memory, so they stay resident. offload_all: every "
        "saved activation to the file tier with saved-tensor hooks (torchtune's technique, on this host's slower "
        "tier). DELTA budgets: fractions of the no-saving activation bytes; delta-sub: planned per sub-module "
        "(attention, MLP, the two norms of each layer); delta-mem: objective='memory', the fewest bytes among the "
        "plans predicted no slower than full checkpointing. Largest batch: the budget is the no-saving bytes of batch "
        "8; from measured profiles at each batch size (DELTA: its minimum feasible budget, every layer offloaded)."
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len({r["preset"] for r in rows}), figsize=(13, 4.8), squeeze=False)
    for ax, preset in zip(axes[0], sorted({r["preset"] for r in rows}, key=PRESETS.index)):
        for r in rows:
            if r["preset"] == preset:
                ax.scatter(r["time_vs_none"], r["saved_mib"], s=40)
                ax.annotate(
                    r["method"],
                    (r["time_vs_none"], r["saved_mib"]),
                    fontsize=8,
                    xytext=(4, 4),
                    textcoords="offset points",
                )
        ax.set_xlabel("step time / no saving")
        ax.set_ylabel("saved activations (MiB)")
        ax.set_title(f"{preset} LLaMA, batch {payload['batch']} x {payload['seq']}")
    fig.suptitle("Activation memory against step time (one point per method)")
    return table, fig, notes


if __name__ == "__main__":
    main()
