"""How fast the console script answers, beside ``accelerate --help`` on the same machine in the same run: the top-level
help, every job's ``--help`` and a bad flag (refused before anything loads), each the median of
``--repeats`` runs taken in interleaved rounds (every command once per round, so a busy spell of the machine falls on
all of them alike). For each hf-dtrain command, which heavy modules it imported (one extra run under
``-X importtime``): torch, transformers, peft, and the optional backends TRL, ``datasets``, DeepSpeed, bitsandbytes,
HQQ.

    python benchmarks/cli_startup.py        # about a minute; writes benchmarks/results/cli_startup.{json,md,png}
    python benchmarks/cli_startup.py --from-json benchmarks/results/cli_startup.json   # re-render only
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "peft", "accelerate", "trl", "datasets", "deepspeed", "bitsandbytes", "hqq")
# (label, arguments, exit status expected)
COMMANDS = [
    ("hf-dtrain --help", ["--help"], 0),
    ("hf-dtrain finetune --help", ["finetune", "--help"], 0),
    ("hf-dtrain plan --help", ["plan", "--help"], 0),
    ("hf-dtrain pretrain --help", ["pretrain", "--help"], 0),
    ("hf-dtrain sweep --help", ["sweep", "--help"], 0),
    ("hf-dtrain fed simulate --help", ["fed", "simulate", "--help"], 0),
    ("hf-dtrain elastic --help", ["elastic", "--help"], 0),
    ("hf-dtrain finetune --no-such-flag", ["finetune", "--no-such-flag"], 2),
]
BASELINE = "accelerate --help"


def _script(name: str, module: str) -> list[str]:
    """The console script as users run it, or ``python -m`` where it is not installed next to this Python."""
    found = Path(sys.executable).parent / name
    if found.exists():
        return [str(found)]
    return [shutil.which(name)] if shutil.which(name) else [sys.executable, "-m", module]


def _time(argv: list[str], expect: int) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - t0
    if proc.returncode != expect:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode} (expected {expect}):\n{proc.stderr[-2000:]}")
    return seconds


def _heavy_imports(args: list[str]) -> list[str]:
    """The top-level packages of HEAVY that ``python -m hf_dtrain.cli <args>`` imported."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "hf_dtrain.cli", *args], capture_output=True, text=True, cwd=ROOT
    )
    names = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return [m for m in HEAVY if m in names]


def measure(repeats: int) -> dict:
    hf = _script("hf-dtrain", "hf_dtrain.cli")
    accelerate = _script("accelerate", "accelerate.commands.accelerate_cli")
    runs = {label: [] for label, _, _ in COMMANDS} | {BASELINE: []}
    for _ in range(repeats):
        for label, args, expect in COMMANDS:
            runs[label].append(_time([*hf, *args], expect))
        runs[BASELINE].append(_time([*accelerate, "--help"], 0))
    base = statistics.median(runs[BASELINE])
    rows = []
    for label, args, _ in [*COMMANDS, (BASELINE, None, 0)]:
        median = statistics.median(runs[label])
        rows.append(
            {
                "command": label,
                "median_s": median,
                "runs_s": runs[label],
                "vs_accelerate_help": median / base,
                "heavy_imports": None if args is None else _heavy_imports(args),
            }
        )
    return {"repeats": repeats, "script": " ".join(hf), "baseline": BASELINE, "rows": rows}


def render(payload: dict):
    from _report import markdown_table

    rows = [
        {**r, "imports": "(baseline)" if r["heavy_imports"] is None else ", ".join(r["heavy_imports"]) or "none"}
        for r in payload["rows"]
    ]
    columns = [
        ("command", "command", ""),
        ("median_s", f"median of {payload['repeats']} (s)", ".3f"),
        ("vs_accelerate_help", "/ accelerate --help", ".2f"),
        ("imports", "heavy modules imported", ""),
    ]
    table = markdown_table(rows, columns)
    ours = [r for r in rows if r["heavy_imports"] is not None]
    slowest = max(ours, key=lambda r: r["median_s"])
    loaded = sorted({m for r in ours for m in r["heavy_imports"]})
    notes = (
        f"Every command ran {payload['repeats']} times in interleaved rounds ({payload['script']} and "
        f"`{payload['baseline']}` as installed); the ratio is each median over `{payload['baseline']}`'s median in "
        f"the same run. The slowest hf-dtrain command here, `{slowest['command']}`, took "
        f"{slowest['vs_accelerate_help']:.2f}x as long as the baseline. Heavy modules: which of {', '.join(HEAVY)} "
        "each command loaded (one extra run under `python -X importtime`); "
        + (f"loaded by some: {', '.join(loaded)}." if loaded else "none of these commands loaded any of them.")
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    labels = [r["command"] for r in rows]
    colors = ["tab:gray" if r["heavy_imports"] is None else "tab:blue" for r in rows]
    ax.barh(labels, [r["median_s"] for r in rows], color=colors)
    for y, r in enumerate(rows):
        ax.plot(r["runs_s"], [y] * len(r["runs_s"]), "k|", ms=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (bar: median; ticks: each run)")
    ax.set_title("Time to answer: hf-dtrain (blue) vs accelerate --help (grey)")
    fig.tight_layout()
    return table, fig, notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--from-json", metavar="PATH", help="only rebuild the table and plot from a results JSON")
    args = ap.parse_args()
    from _report import rerender, write

    if args.from_json:
        rerender(args.from_json, "cli_startup", render)
        return
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "0")
    payload = measure(args.repeats)
    table, fig, notes = render(payload)
    paths = write("cli_startup", payload, table, fig, notes)
    print(table)
    print("\n".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    main()
