"""Re-render every committed result that has a render path from its JSON, into a scratch folder, and compare the
markdown, JSON and PNG with the committed files byte for byte: the check that a change to the code the results
depend on (a benchmark's render, the planner's predictions) left them as they were.

    python benchmarks/rerender.py   # about two minutes; exit 1 if any result differs; writes results/rerender.*
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from hf_dtrain import processes

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
# result -> (script, extra arguments); the JSON is passed with --from-json
RENDERED = {
    **{
        name: (f"{name}.py", [])
        for name in (
            "async_gossip",
            "cli_startup",
            "decentralized",
            "eva_muon",
            "fault_tolerance",
            "federated",
            "fused",
            "hsdp_exchange",
            "memory",
            "multihost",
            "optimizers",
            "parallel",
            "peft_methods",
            "peft_real",
            "quantized_adapters",
            "quantized_adapters_lr_sweep",
            "scaling",
            "sharded",
            "comm_hooks",
        )
    },
    "estimate": ("estimate.py", ["--only", "check"]),
    "estimates": ("estimate.py", ["--only", "large"]),
    "comm_dear": ("comm_hooks.py", ["--name", "comm_dear", "--loss-basis", "training"]),
    "comm_embedding": ("comm_hooks.py", ["--name", "comm_embedding"]),
}


def main() -> int:
    missing = sorted(p.stem for p in RESULTS.glob("*.json") if p.stem not in RENDERED and p.stem != "rerender")
    rows, bad = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, HF_DTRAIN_BENCH_RESULTS=tmp, MPLBACKEND="Agg")
        for name, (script, extra) in RENDERED.items():
            source = RESULTS / f"{name}.json"
            if not source.exists():
                continue
            shutil.copy(source, Path(tmp) / f"{name}.json")
            argv = [sys.executable, script, "--from-json", str(Path(tmp) / f"{name}.json"), *extra]
            proc = processes.run(argv, cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                rows.append((name, f"FAILED: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}"))
                bad += 1
                continue
            differ = [
                ext
                for ext in ("json", "md", "png")
                if (RESULTS / f"{name}.{ext}").read_bytes() != (Path(tmp) / f"{name}.{ext}").read_bytes()
            ]
            bad += bool(differ)
            rows.append((name, "identical" if not differ else "differs: " + ", ".join(differ)))
    for folder in sorted((RESULTS / "gpu").glob("*/")):  # the GPU leases' gpu_check reports (markdown only)
        from hf_dtrain.testing.gpu_check import report_markdown

        data = json.loads((folder / "gpu_check.json").read_text())
        same = report_markdown(data["steps"], data["environment"]) == (folder / "gpu_check.md").read_text()
        bad += not same
        rows.append((f"gpu/{folder.name}/gpu_check", "identical (md)" if same else "differs: md"))
    for name, verdict in rows:
        print(f"{name:32} {verdict}")
    if missing:
        print(f"no render path (not checked): {', '.join(missing)}")
    report(rows, missing)
    return 1 if bad else 0


def report(rows: list[tuple[str, str]], missing: list[str]) -> None:
    """results/rerender.{json,md,png}: each result's verdict, and the results it has no render path for."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, str(HERE))
    from _report import markdown_table, write

    table = [{"result": name, "verdict": verdict} for name, verdict in rows]
    same = sum(verdict.startswith("identical") for _, verdict in rows)
    fig, ax = plt.subplots(figsize=(6, 2.5))
    ax.barh(["identical", "differs or failed", "no render path"], [same, len(rows) - same, len(missing)])
    ax.set_xlabel("committed results")
    fig.tight_layout()
    notes = (
        f"{same} of {len(rows)} committed results re-rendered from their JSON identical byte for byte (markdown, "
        f"JSON and PNG; the GPU gpu_check reports: markdown). No render path, not checked: {', '.join(missing)}."
    )
    write(
        "rerender",
        {"rows": table, "identical": same, "checked": len(rows), "no_render_path": missing},
        markdown_table(table, [("result", "result", ""), ("verdict", "verdict", "")]),
        fig,
        notes,
    )


if __name__ == "__main__":
    sys.exit(main())
