"""Preemption notices (``fault_tolerance.preempt_deadline``) against what a user has without them, on ``hf-dtrain
pretrain`` under torchrun (2 gloo ranks, one node), the tiny and 100m presets, full training with AdamW:

* **signal to exit**: SIGTERM sent to both ranks at once after the 8th logged step; the seconds until the last rank
  had exited (it finished its step, agreed on it, wrote the step's snapshot to disk), and each rank's own figures
  from its stop line (the bytes written, the seconds the write took); then the node's snapshot processes are killed
  (the node is gone) and the same command relaunched: the step it resumed after and the steps lost;
* **the baseline**: the same with ``--fault-tolerance.preempt-deadline 0`` (the signal ends the ranks at once, as
  before) and a disk copy every 5 steps (``--fault-tolerance.persist-every 5``), the usual periodic checkpoint:
  the steps lost;
* **the per-step cost** of listening: the median step time with the notice handling on, over the same run with it
  off (one small all-reduce per step), from uninterrupted runs in this same invocation.

JSON, markdown and a PNG under ``benchmarks/results/preemption.*``.

    python benchmarks/preemption.py        # about 5 minutes on 2 CPU cores
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import markdown_table, write

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hf_dtrain.testing import free_port, stop_snapshot_processes  # noqa: E402
from hf_dtrain.testing.preempt import run_preempted  # noqa: E402

PRESETS = {"tiny": 24, "100m": 16}  # max steps
SIGNAL_AT = 8  # the logged step after which the notice is sent
COMMON = ["--seq-len", "64", "--per-device-train-batch-size", "2", "--data-bytes", "200000", "--eval-blocks", "2"]
SAVED = re.compile(
    r"rank (\d+) .*? after step (\d+), saved ([\d.]+) MB to .*? in ([\d.]+) s \(([\d.]+) s after the signal"
)


def _env() -> dict:
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )


def _command(preset: str, out: Path, ft: Path, extra=(), steps: int | None = None) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "hf_dtrain.cli",
        "pretrain",
        "--preset",
        preset,
        "--max-steps",
        str(steps or PRESETS[preset]),
        *COMMON,
        "--logging-steps",
        "1",
        "--progress",
        "false",
        "--save-model",
        "false",
        "--output-dir",
        str(out),
        "--fault-tolerance.directory",
        str(ft),
        "--fault-tolerance.parity",
        "0",
        *extra,
    ]


def _history(out: Path) -> list[dict]:
    return [json.loads(line) for line in open(out / "history_rank0.jsonl") if line.strip()]


def _step_times(out: Path) -> list[float]:
    seconds = [h["seconds"] for h in _history(out)]
    return [b - a for a, b in itertools.pairwise(seconds)][2:]  # past the first steps' warm-up


def preempted(preset: str, tmp: Path, extra=()) -> dict:
    """SIGTERM after the ``SIGNAL_AT``-th logged step, the node lost, the relaunch; what it cost."""
    out, ft = tmp / "out", tmp / "ft"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        done = run_preempted(_command(preset, out, ft, extra), _env(), at=[(SIGNAL_AT, signal.SIGTERM)], cwd=ROOT)
        last_logged = max(h["step"] for h in _history(out))
        ranks = [
            {"rank": int(r), "step": int(s), "mb": float(mb), "write_s": float(w), "since_signal_s": float(t)}
            for r, s, mb, w, t in SAVED.findall(done.output)
        ]
        stop_snapshot_processes(ft)  # the node is gone, with its memory
        again = run_preempted(_command(preset, out, ft, extra), _env(), at=[], cwd=ROOT)
        assert again.returncode == 0, again.output[-3000:]
        resumed = json.load(open(out / "results.json"))["fault_tolerance"]["restored"]
        steps = [h["step"] for h in _history(out)]
        return {
            "exit_codes_nonzero": done.returncode != 0,
            "signal_to_exit_s": done.notices[0].seconds_to_exit if done.notices else None,
            "ranks": ranks,
            "last_logged_step": last_logged,
            "resumed_after": None if resumed is None else resumed["step"],
            "resumed_from": None if resumed is None else resumed["source"],
            "steps_lost": last_logged - (resumed["step"] if resumed else 0),
            "steps_run_twice": len(steps) - len(set(steps)),
        }
    finally:
        stop_snapshot_processes(ft)


OVERHEAD_STEPS = {"tiny": 80, "100m": 24}  # a tiny step is short: more of them for a stable median


def overhead(preset: str, tmp: Path) -> dict:
    """Median step time with the notice handling on and off, uninterrupted, in this invocation: on, off, on, off,
    the median of each run, the mean of the two runs of each."""
    times = {"on": [], "off": []}
    for i, (name, extra) in enumerate((("on", ()), ("off", ("--fault-tolerance.preempt-deadline", "0"))) * 2):
        d = tmp / f"overhead-{name}-{i}"
        shutil.rmtree(d, ignore_errors=True)
        try:
            command = _command(preset, d / "out", d / "ft", extra, steps=OVERHEAD_STEPS[preset])
            done = run_preempted(command, _env(), at=[], cwd=ROOT)
            assert done.returncode == 0, done.output[-3000:]
            times[name].append(statistics.median(_step_times(d / "out")))
        finally:
            stop_snapshot_processes(d / "ft")
    on, off = statistics.mean(times["on"]), statistics.mean(times["off"])
    return {"step_s_on": on, "step_s_off": off, "runs": times, "ratio": on / off}


def main() -> None:
    rows, raw = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for preset in PRESETS:
            ours = preempted(preset, tmp / f"{preset}-ours")
            base = preempted(
                preset,
                tmp / f"{preset}-base",
                ("--fault-tolerance.preempt-deadline", "0", "--fault-tolerance.persist-every", "5"),
            )
            cost = overhead(preset, tmp)
            raw[preset] = {"notice": ours, "baseline": base, "overhead": cost}
            mb = max((r["mb"] for r in ours["ranks"]), default=None)
            write_s = max((r["write_s"] for r in ours["ranks"]), default=None)
            node_gb = sum(r["mb"] for r in ours["ranks"]) / 1e3
            rows.append(
                {
                    "preset": preset,
                    "mb": mb,
                    "exit": ours["signal_to_exit_s"],
                    "write": write_s,
                    "per_gb": None if not node_gb or write_s is None else write_s / node_gb,
                    "resumed": f"{ours['resumed_after']} ({ours['resumed_from']})",
                    "lost": ours["steps_lost"],
                    "twice": ours["steps_run_twice"],
                    "base_lost": base["steps_lost"],
                    "base_resumed": f"{base['resumed_after']} ({base['resumed_from']})",
                    "ratio": cost["ratio"],
                }
            )
    columns = [
        ("preset", "preset", ""),
        ("mb", "state per rank (MB)", ".1f"),
        ("exit", "signal to exit (s)", ".2f"),
        ("write", "its disk write (s)", ".2f"),
        ("per_gb", "write s per GB of node state", ".2f"),
        ("resumed", "relaunch resumed after (from)", ""),
        ("lost", "steps lost", "d"),
        ("twice", "steps run twice", "d"),
        ("base_resumed", "without notices, persist every 5: resumed after", ""),
        ("base_lost", "its steps lost", "d"),
        ("ratio", "step time, notices on / off", ".3f"),
    ]
    notes = (
        f"SIGTERM to both ranks after the {SIGNAL_AT}th logged step; the node's snapshot processes are then killed "
        "(the node is gone) and the same command relaunched, so the relaunch reads the disk copy. 'steps lost': the "
        "newest step logged before the exit minus the step the relaunch resumed after. The write time is the disk "
        "copy of both the rank's slot and its resharding (DCP) copy; per GB of node state it is the figure to scale by "
        "for a larger model (a node's ranks write in parallel to the same disk here). Step-time ratio: median over "
        "uninterrupted runs of the same command with the handling on and off, alternated twice (80 steps for tiny, 24 "
        "for 100m), in this invocation (this machine is noisy: within a few percent is no difference)."
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["lost"] for r in rows], 0.4, label="notice (ours)")
    ax.bar([i + 0.2 for i in x], [r["base_lost"] for r in rows], 0.4, label="no notice, persist every 5")
    ax.set_xticks(list(x), [f"{r['preset']}\nexit {r['exit']:.1f} s" for r in rows])
    ax.set_ylabel("steps lost to a preemption")
    ax.legend()
    paths = write("preemption", {"rows": rows, "raw": raw}, markdown_table(rows, columns), fig, notes)
    print(paths["md"].read_text())


if __name__ == "__main__":
    main()
