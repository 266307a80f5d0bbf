"""What ``--estimate`` says: the traced step of the job (in this process, or in a clean child process when this one is
already part of a launched world), the verdict against one device's memory, the changes that would make a step fit
(each traced), one table on rank 0, ``estimate.json`` and ``estimate.png`` in the output directory, and the refusal
of a run that will not fit."""

from __future__ import annotations

import json
import os

from hf_dtrain.errors import SettingsError

from .config import EstimateConfig
from .job import JobEstimate, device_memory_of, gib, trace_job

LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _trace_here(skeleton, cfg, world_size: int) -> JobEstimate:
    return trace_job(cfg, skeleton(cfg), world_size)


def _child(skeleton, cfg, world_size: int, queue) -> None:
    try:
        queue.put(("ok", _trace_here(skeleton, cfg, world_size)))
    except SettingsError as e:
        queue.put(("refused", str(e)))
    except Exception as e:  # a trace that failed: said by the parent with the job's input
        queue.put(("failed", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))


def trace(skeleton, cfg, world_size: int) -> JobEstimate:
    """The job's traced step: here, or (when this process already belongs to a launched world, whose process group
    the fake one cannot replace) in a child process started without the launcher's variables."""
    import torch.distributed as dist

    launched = (dist.is_available() and dist.is_initialized()) or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
    if not launched:
        return _trace_here(skeleton, cfg, world_size)
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k in LAUNCHER_VARIABLES or k.startswith("TORCHELASTIC")}
    try:
        child = context.Process(target=_child, args=(skeleton, cfg, world_size, queue), daemon=True)
        child.start()
    finally:
        os.environ.update(saved)
    try:
        kind, value = queue.get(timeout=1800)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    if kind == "refused":
        raise SettingsError(value)
    if kind == "failed":
        raise RuntimeError(value)
    return value


def table(estimate: JobEstimate, limit: int | None) -> str:
    """The estimate as the job prints it."""
    memory = estimate.memory
    lines = [
        f"estimate: one training step, rank 0 of {estimate.world_size} ({estimate.engine}), micro-batch "
        f"{estimate.batch} x {estimate.seq_len} tokens, traced on fake tensors in {estimate.seconds:.0f} s",
        f"  peak {gib(memory.peak)}:",
    ]
    for name, nbytes in sorted(memory.split.items(), key=lambda kv: -kv[1]):
        if nbytes:
            lines.append(f"    {name:<18} {gib(nbytes):>12}")
    lines.append(f"  {memory.flops / 1e12:.2f} TFLOP per step (forward and backward)")
    if limit is not None:
        lines.append("  " + verdict(memory.peak, limit))
    lines += [f"  note: {note}" for note in estimate.notes]
    lines.append(
        "  not counted: the CUDA context, NCCL buffers, allocator fragmentation (docs/estimate.md gives their sizes)"
    )
    return "\n".join(lines)


def verdict(peak: int, limit: int) -> str:
    if peak <= limit:
        return f"fits: {gib(peak)} of {gib(limit)} ({peak / limit:.0%})"
    return f"does not fit: {gib(peak)} > {gib(limit)} ({peak / limit:.0%})"


def alternatives(run, skeleton, cfg, world_size: int, limit: int | None) -> list[dict]:
    """The changes that lower the step's memory, each traced: the job's own (micro-batch 1, gradient checkpointing),
    the sections' (FSDP2), and twice the ranks when the parameters are sharded."""
    from hf_dtrain.run.section import sections_for

    options = [(what, changed, world_size) for what, changed in skeleton(cfg).alternatives]
    for cls in sections_for(cfg.job):
        options += [(what, changed, world_size) for what, changed in cls.alternatives(cfg, world_size)]
    if run.sharded:
        options.append((f"{2 * world_size} ranks", cfg, 2 * world_size))
    out = []
    for what, changed, world in options:
        try:
            peak = trace(skeleton, changed, world).memory.peak
        except (SettingsError, RuntimeError) as e:
            out.append({"change": what, "peak_bytes": None, "why_not": str(e)[:200]})
            continue
        out.append({"change": what, "peak_bytes": peak, "fits": limit is None or peak <= limit})
    return out


def write(output_dir: str, results: dict) -> list[str]:
    """``estimate.json`` and ``estimate.png`` (the peak's split as one stacked bar, the device's memory a line)."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "estimate.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    split = {k: v for k, v in results["split_bytes"].items() if v}
    fig, ax = plt.subplots(figsize=(4.5, 4))
    bottom = 0.0
    for name, nbytes in sorted(split.items(), key=lambda kv: -kv[1]):
        ax.bar([f"rank 0 of {results['world_size']}"], [nbytes / 2**30], bottom=bottom, label=name)
        bottom += nbytes / 2**30
    if results.get("device_memory_bytes"):
        ax.axhline(results["device_memory_bytes"] / 2**30, color="black", linestyle="--", label="device memory")
    ax.set_ylabel("GiB at the step's peak")
    ax.set_title(f"{results['engine']}: {gib(results['peak_bytes'])}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    png = os.path.join(output_dir, "estimate.png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return [path, png]


def answer(run, asked: EstimateConfig | None) -> dict | None:
    """The job's traced step (the estimate section's, see :mod:`hf_dtrain.estimate.section`), printed and written;
    None when it could not be traced and nobody asked for it. Refuses a run whose step will not fit."""
    if run.skeleton is None:
        return None
    unasked = asked is None  # a run on a GPU, checked before its weights are read
    asked = asked or EstimateConfig(train=True)
    cfg = run.cfg
    try:
        skeleton = run.skeleton(cfg)
        estimate = trace(run.skeleton, cfg, run.world_size)
    except (SettingsError, RuntimeError) as e:
        if unasked:  # a check nobody asked for does not stop a run it cannot trace
            if run.is_main:
                print(f"hf_dtrain: the step's memory was not estimated before the run: {e}", flush=True)
            return None
        if isinstance(e, SettingsError):
            raise
        raise SettingsError(f"--estimate: the step could not be traced ({e}).") from None
    limit = device_memory_of(asked.device_memory)
    peak = estimate.memory.peak
    results = {**estimate.to_dict(), "device_memory_bytes": limit, "fits": None if limit is None else peak <= limit}
    if limit is not None and peak > limit and asked.alternatives:
        results["alternatives"] = alternatives(run, run.skeleton, cfg, run.world_size, limit)
    if run.is_main:
        print(table(estimate, limit), flush=True)
        for option in results.get("alternatives", []):
            said = verdict(option["peak_bytes"], limit) if option["peak_bytes"] is not None else option["why_not"]
            print(f"  with {option['change']}: {said}", flush=True)
        if skeleton.output_dir:
            written = write(skeleton.output_dir, results)
            print(f"  written: {', '.join(written)}", flush=True)
    if limit is not None and peak > limit and asked.train:
        if not asked.anyway:
            raise SettingsError(refusal(estimate, limit, results.get("alternatives", [])))
        if run.is_main:
            print("hf_dtrain: the step will not fit; running anyway (--run-anyway).", flush=True)
    return results


def measured(results: dict, peak: int, how: str, steps: list[int], output_dir: str | None, main: bool) -> dict:
    """The estimate's ``results`` with the job's own measured peak beside it (``measured_peak_bytes``, how it was
    measured, over which steps, and ``estimate_over_measured``), said in one line and rewritten to ``estimate.json``
    on rank 0."""
    out = {
        **results,
        "measured_peak_bytes": int(peak),
        "measured_by": how,
        "measured_steps": steps,
        "estimate_over_measured": round(results["peak_bytes"] / peak, 4) if peak else None,
    }
    if main:
        ran = ", ".join(map(str, steps)) or "(none ran)"
        print(
            f"estimate checked: the job's own steps {ran} peaked at {gib(peak)} on rank 0 ({how}); estimated "
            f"{gib(results['peak_bytes'])}"
            + (f", {out['estimate_over_measured']:.3f}x" if out["estimate_over_measured"] is not None else ""),
            flush=True,
        )
        if output_dir:
            write(output_dir, out)
    return out


def refusal(estimate: JobEstimate, limit: int, options: list[dict]) -> str:
    """One line: the peak against the device, the largest buffer, and the changes that fit (or the best tried)."""
    split = estimate.memory.split
    largest = max(split, key=split.get)
    fitting = [o for o in options if o.get("fits")]
    tried = fitting or sorted((o for o in options if o["peak_bytes"] is not None), key=lambda o: o["peak_bytes"])[:2]
    said = "; ".join(f"{o['change']}: {gib(o['peak_bytes'])}" for o in tried)
    fix = (
        f"it would fit with {said}"
        if fitting
        else f"none of the changes tried fits ({said or 'none could be traced'}): use more ranks or a smaller model"
    )
    return (
        f"the training step will not fit: {gib(estimate.memory.peak)} at its peak on rank 0 of {estimate.world_size} "
        f"against {gib(limit)} of device memory; the largest part is {largest} ({gib(split[largest])}); {fix}; "
        "or give --run-anyway to run it as it is."
    )
