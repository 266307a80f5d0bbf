"""Four emulated hosts on one machine (network namespaces joined by rate-limited veth links,
``hf_dtrain.testing.netns``) running ``hf-dtrain pretrain`` with several parts at once:

1. **ACP-SGD + DELTA + in-memory fault tolerance** (parity 1 across the 4 hosts), 1 Gbit/s links: host 2 is lost
   after step 12 (its trainer SIGKILLed and its snapshot process killed, as when a machine disappears); the other
   trainers are stopped as an elastic agent would, all four relaunched, and the run continues from the snapshots,
   host 2's rebuilt from the peers' parity.
2. **DecentLaM (decentralized, ring) on 1 Gbit/s links, then with host 3 slowed to 100 Mbit/s.**

Each rank is its own host with its own snapshot process, listening on the host's address. Writes the per-rank logs
and results under ``benchmarks/results/multihost/``, and ``multihost.json`` / ``.md`` / ``.png`` (loss against wall
time) under ``benchmarks/results/``.

    python benchmarks/multihost.py        # root (network namespaces); about 6 minutes on 2 CPU cores
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "multihost"
STEPS = 24
JOB = [
    "pretrain",
    "--preset",
    "tiny",
    "--max-steps",
    str(STEPS),
    "--per-device-train-batch-size",
    "4",
    "--seq-len",
    "64",
    "--data-bytes",
    "400000",
    "--save-model",
    "false",
    "--learning-rate",
    "2e-3",
    "--warmup-steps",
    "2",
    "--progress",
    "false",
    "--logging-steps",
    "4",
]


def _run_hosts(name: str, job: list[str], rates: list[str], fault=None, lose_host=None) -> dict:
    """One run on 4 emulated hosts; with ``fault`` ("rank:step") that rank dies there and, with ``lose_host``, its
    snapshot process too; then every host is relaunched. Returns the per-rank results and the launches' times."""
    from hf_dtrain.testing import elastic_launch, stop_snapshot_processes
    from hf_dtrain.testing.netns import emulated_hosts

    out = OUT / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    ft_dir = Path(tempfile.mkdtemp(prefix="hf_dtrain_multihost_"))
    argv = [sys.executable, "-m", "hf_dtrain.cli", *job, "--output-dir", str(out)]
    if any(a.startswith("--fault-tolerance") for a in job):  # a --fault-tolerance.* flag alone would turn it on
        argv += ["--fault-tolerance.directory", str(ft_dir)]
    launches = []
    with emulated_hosts(4, rates=rates) as hosts:

        def per_rank_env(rank):
            return {
                "GLOO_SOCKET_IFNAME": hosts[rank].interface,
                "HF_DTRAIN_SMP_HOST": hosts[rank].address,
                "ACCELERATE_USE_CPU": "true",
            }

        def launch(command):
            t0 = time.time()
            codes = elastic_launch(
                command,
                4,
                timeout=900,
                log_dir=str(out),
                per_rank_env=per_rank_env,
                per_rank_argv=lambda rank, a: hosts[rank].command(a),
                master_addr=hosts[0].address,
            )
            launches.append({"start": t0, "end": time.time(), "codes": codes})
            return codes

        try:
            if fault:
                # the same job under the testing fault injector (hf_dtrain.testing.fault): rank:step[:seconds]
                codes = launch([sys.executable, "-m", "hf_dtrain.testing.fault", fault, *argv[2:]])
                assert codes[int(fault.split(":")[0])] == -9, codes
                if lose_host is not None:
                    info = json.load(open(ft_dir / f"node{lose_host}" / "smp.json"))
                    import os
                    import signal

                    os.kill(info["pid"], signal.SIGKILL)  # the host's memory is gone with it
            codes = launch(argv)
            assert codes == [0, 0, 0, 0], (codes, (out / "rank0.out").read_text()[-3000:])
        finally:
            stop_snapshot_processes(ft_dir)
            for log in ft_dir.glob("node*/smp.log"):  # the snapshot processes' own logs (rebuilds, exchanges)
                shutil.copy(log, out / f"smp_{log.parent.name}.log")
            shutil.rmtree(ft_dir, ignore_errors=True)
    ranks = [json.load(open(out / f"results_rank{r}.json")) for r in range(4)]
    for r, res in enumerate(ranks):
        res.pop("config", None)
        # every step of every launch, with wall-clock time (the results file has the last launch's steps only)
        res["steps_log"] = [json.loads(line) for line in open(out / f"history_rank{r}.jsonl")]
    t_first = launches[0]["start"]
    return {
        "name": name,
        "rates": rates,
        "fault": fault,
        "lost_host": lose_host,
        "t0": t_first,
        "launches": [
            {"start_s": l["start"] - t_first, "end_s": l["end"] - t_first, "codes": l["codes"]} for l in launches
        ],
        "ranks": ranks,
    }


def main():
    import argparse

    from hf_dtrain.testing import netns

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from-json")
    args = ap.parse_args()
    if args.from_json:
        from _report import rerender

        rerender(args.from_json, "multihost", render)
        return
    ok, why = netns.available()
    if not ok:
        raise SystemExit(f"multihost benchmark needs network namespaces: {why}")
    fast = ["1gbit"] * 4
    runs = [
        _run_hosts(
            "acp_delta_ft_lost_host",
            JOB
            + [
                "--comm-hook",
                "acp_sgd",
                "--comm-hook.rank",
                "2",
                "--comm-hook.start-iter",
                "4",
                "--delta.budget",
                "0.5",
                "--fault-tolerance.parity",
                "1",
            ],
            fast,
            fault="2:12:3",
            lose_host=2,
        ),
        _run_hosts("decentlam", JOB + ["--optimizer", "decentlam", "--learning-rate", "0.05"], fast),
        _run_hosts(
            "decentlam_slow_host",
            JOB + ["--optimizer", "decentlam", "--learning-rate", "0.05"],
            ["1gbit", "1gbit", "1gbit", "100mbit"],
        ),
    ]
    payload = {"runs": runs, "steps": STEPS, "hosts": 4}
    from _report import write

    table, fig, notes = render(payload)
    paths = write("multihost", payload, table, fig, notes)
    print(table)
    print("\n".join(str(p) for p in paths.values()))


def render(payload: dict):
    from _report import markdown_table

    rows = []
    for run in payload["runs"]:
        r0 = run["ranks"][0]
        ft = r0.get("fault_tolerance") or {}
        restored = {r["rank"]: (r.get("fault_tolerance") or {}).get("restored") for r in run["ranks"]}
        hist = r0["history"]
        wall = run["launches"][-1]["end_s"]
        rows.append(
            {
                "run": run["name"],
                "links": ", ".join(sorted(set(run["rates"]), key=run["rates"].index))
                + (" (host 3 slowed)" if len(set(run["rates"])) > 1 else ""),
                "failure": f"host {run['lost_host']} lost after step {run['fault'].split(':')[1]}"
                if run["fault"]
                else "none",
                "restore": (
                    "; ".join(
                        f"host {k}: step {v['step']} from {v['source']}"
                        for k, v in restored.items()
                        if v and (k in (0, run["lost_host"]))
                    )
                )
                if run["fault"]
                else "n/a",
                "first_loss": hist[0]["loss"] if r0["first_step"] == 1 else None,
                "final_loss": hist[-1]["loss"],
                "held_out": r0["held_out_loss"],
                "wall_s": wall,
                "bytes_per_step": (r0.get("wire") or {}).get("bytes_per_step_mean"),
                "snapshots": ft.get("snapshots"),
                "delta_max_saved": max((r0.get("delta") or {}).get("saved_bytes") or [0]) or None,
            }
        )
    table = markdown_table(
        rows,
        [
            ("run", "run", ""),
            ("links", "links", ""),
            ("failure", "failure", ""),
            ("restore", "restored", ""),
            ("final_loss", "final loss (rank 0)", ".4f"),
            ("held_out", "held-out loss", ".4f"),
            ("wall_s", "wall time (s)", ".0f"),
            ("bytes_per_step", "bytes/step (rank 0)", ",.0f"),
            ("snapshots", "snapshots (rank 0, last launch)", ""),
            ("delta_max_saved", "DELTA max saved bytes", ",d"),
        ],
    )
    notes = (
        f"{payload['hosts']} emulated hosts (network namespaces, veth + tc tbf), one rank each, gloo; "
        f"hf-dtrain pretrain of the tiny LLaMA for {payload['steps']} steps, batch 4 x 64 tokens per rank. "
        "The lost-host run: host 2's trainer SIGKILLed after step 12 and its snapshot process killed; the other "
        "trainers stopped (elastic agent); all relaunched; host 2's state rebuilt from the peers' parity. "
        "Logs and per-rank results: benchmarks/results/multihost/."
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for run in payload["runs"]:
        log = run["ranks"][0]["steps_log"]
        t_first = run["t0"]
        (line,) = ax.plot([h["time"] - t_first for h in log], [h["loss"] for h in log], marker=".", label=run["name"])
        if run["fault"]:
            relaunch = run["launches"][-1]["start_s"]
            ax.axvline(relaunch, color=line.get_color(), ls=":", lw=1)
            ax.annotate(
                f"host {run['lost_host']} lost: relaunch",
                (relaunch, 0.98),
                xycoords=("data", "axes fraction"),
                fontsize=8,
                rotation=90,
                va="top",
            )
    ax.set_xlabel("wall time since the first launch (s)")
    ax.set_ylabel("training loss (rank 0)")
    ax.set_title("hf-dtrain pretrain on 4 emulated hosts")
    ax.legend(fontsize=8)
    return table, fig, notes


if __name__ == "__main__":
    main()
