"""Shared benchmark reporting: every benchmark writes results/<name>.json, <name>.md and <name>.png, stating the
machine, library versions and the command that produced them."""

from __future__ import annotations

import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

# where results are written: benchmarks/results/, or $HF_DTRAIN_BENCH_RESULTS (rerender.py draws into a scratch folder)
RESULTS = Path(os.environ.get("HF_DTRAIN_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")


RESULT_TAG = "RESULT "


def emit_result(result) -> None:
    """A worker's last word: its result as one JSON line after :data:`RESULT_TAG` on stdout."""
    print(RESULT_TAG + json.dumps(result), flush=True)


def parse_result(stdout: str):
    """The result a worker emitted (the last :data:`RESULT_TAG` line of its output)."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_TAG)]
    if not lines:
        raise RuntimeError(f"the worker printed no {RESULT_TAG.strip()} line; its output ended with:\n{stdout[-2000:]}")
    return json.loads(lines[-1][len(RESULT_TAG) :])


def run_worker(script: str, argv: list[str], env: dict | None = None, timeout: float = 1800, what: str = ""):
    """Run ``python script *argv`` (a benchmark in its worker mode) in a fresh process; return its result, or raise
    with the end of its stderr."""
    import sys

    from hf_dtrain import processes  # the worker and whatever it starts, killed on timeout

    proc = processes.run([sys.executable, script, *argv], capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {what or ' '.join(argv)} failed:\n{proc.stderr[-4000:]}")
    return parse_result(proc.stdout)


def timed_steps(model, loader, params, optimizer, scheduler) -> tuple[list[float], list[float]]:
    """Train one optimizer step per batch of ``loader`` as the Trainer does (grad-norm clip 1.0, scheduler step);
    returns the wall time and the loss of every step."""
    import time

    import torch

    times, losses = [], []
    for batch in loader:
        t0 = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # the Trainer's max_grad_norm=1.0
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return times, losses


def cpu_capability() -> str:
    """The CPU's model and how it computes bf16 (``hf_dtrain.fast.cpu_bf16``: natively with AMX tiles or AVX-512
    BF16, or emulated with AVX2 alone, where a bf16 matmul is tens of times slower than fp32)."""
    from hf_dtrain.fast import cpu_bf16

    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        text = ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    return f"{model or platform.processor() or 'unknown CPU'}; {cpu_bf16()[1]}"


def environment() -> dict:
    import torch

    env = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.processor() or 'cpu'}",
        "cpu": cpu_capability(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "python": platform.python_version(),
        "command": "python " + " ".join(sys.argv),
    }
    for mod in ("torch", "transformers", "peft", "accelerate"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:  # pragma: no cover
            pass
    return env


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """``columns``: (key, header, format spec, e.g. ',d' or '.3f' or '' for str)."""
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    lines = [head, sep]
    for r in rows:
        cells = []
        for key, _, fmt in columns:
            v = r.get(key)
            cells.append("n/a" if v is None else (format(v, fmt) if fmt else str(v)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(name: str, payload: dict, table_md: str, figure, notes: str = "", env: dict | None = None) -> dict[str, Path]:
    """Write JSON (payload + environment), markdown (title, environment, table, notes) and the PNG figure.

    ``env`` keeps the environment of the run that measured the payload (when only re-rendering it)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    env = env or environment()
    payload = {"benchmark": name, "environment": env, **payload}
    paths = {ext: RESULTS / f"{name}.{ext}" for ext in ("json", "md", "png")}
    paths["json"].write_text(json.dumps(payload, indent=2) + "\n")
    env_lines = "\n".join(f"- {k}: {v}" for k, v in env.items())
    paths["md"].write_text(f"# {name}\n\n{table_md}\n\n{notes}\n\n## Environment\n{env_lines}\n")
    figure.savefig(paths["png"], dpi=120, bbox_inches="tight")
    return paths


def training_parser(doc: str, lr: dict):
    """The arguments every training benchmark shares: ``--steps``, ``--batch-size``, ``--seeds``, ``--lr METHOD=LR``
    (repeatable), ``--from-json`` (re-render only) and the hidden ``--worker`` / ``--seed`` of one subprocess run."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--seeds", default="0,1,2", help="seeds (data order, adapter init) to average over")
    ap.add_argument(
        "--lr",
        action="append",
        default=[],
        metavar="METHOD=LR",
        help=f"override a method's learning rate (repeatable); defaults {lr}",
    )
    ap.add_argument("--from-json", metavar="PATH", help="only rebuild the table and plot from a results JSON")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    return ap


def apply_lr_overrides(items: list[str], lr: dict) -> None:
    """``--lr METHOD=LR`` items into ``lr`` (in place); a clear exit on a bad item."""
    for item in items:
        method, _, value = item.partition("=")
        if method not in lr or not value:
            raise SystemExit(f"--lr {item!r}: use METHOD=LR with METHOD one of {list(lr)}")
        lr[method] = float(value)


def rerender(path: str, name: str, render) -> dict[str, Path]:
    """Rebuild ``name``'s table and plot from a committed results JSON, keeping the environment that measured it."""
    payload = json.load(open(path))
    env = payload.pop("environment")
    payload.pop("benchmark", None)
    table, fig, notes = render(payload)
    return write(name, payload, table, fig, notes, env=env)


def trailing_mean(values: list[float], window: int) -> list[float]:
    """The mean of the last ``window`` values at every position (fewer at the start)."""
    out, acc = [], []
    for x in values:
        acc = (acc + [x])[-window:]
        out.append(sum(acc) / len(acc))
    return out


def summarize_curve(row: dict, window: int) -> None:
    """A training run's row gets ``smoothed`` (trailing mean of ``losses``), ``final`` and ``seconds`` (the last
    entry of ``times``)."""
    row["smoothed"] = trailing_mean(row["losses"], window)
    row["final"] = row["smoothed"][-1]
    row["seconds"] = row["times"][-1]


def bars_by_link(panels, rows: list[dict]) -> tuple[list, list]:
    """Grouped bars of the rows of a links x methods benchmark: for each ``(ax, key, title)`` in ``panels``, one group
    per method and one bar per link (labelled, for a legend), the methods as x tick labels. Returns (links, methods)
    in the rows' order."""
    links = list(dict.fromkeys(r["link"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    width = 0.8 / len(links)
    for j, link in enumerate(links):
        sub = {r["method"]: r for r in rows if r["link"] == link}
        xs = [i + (j - (len(links) - 1) / 2) * width for i in range(len(methods))]
        for ax, key, _ in panels:
            ax.bar(xs, [sub[m][key] for m in methods], width, label=link)
    for ax, _, title in panels:
        ax.set_xticks(range(len(methods)), methods, rotation=30, ha="right")
        ax.set_title(title)
    return links, methods


def ratios_per_link(rows: list[dict], baseline: str, suffix: str) -> None:
    """In place: each row's step time, bytes and loss as ratios to the ``baseline`` method's row on the same link
    (keys ``step_time_vs_<suffix>``, ``bytes_vs_<suffix>``, ``loss_vs_<suffix>``)."""
    for r in rows:
        ref = next(x for x in rows if x["link"] == r["link"] and x["method"] == baseline)
        r[f"step_time_vs_{suffix}"] = r["step_time_median_s"] / ref["step_time_median_s"]
        r[f"bytes_vs_{suffix}"] = r["bytes_per_step"] / ref["bytes_per_step"]
        r[f"loss_vs_{suffix}"] = r["loss_last10"] / ref["loss_last10"]
