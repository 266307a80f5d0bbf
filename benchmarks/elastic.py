"""Elastic training (hf_dtrain.elastic) on emulated hosts: one host leaves, two join, training goes on.

Four network namespaces joined by 100 Mbit/s links (tc tbf): hosts A and B (B three times slower) start the run;
B is lost (every process of it killed at once); later C and D join. The same run with A and B throughout is the
reference loss curve. Reported: the loss curves, each membership change's recovery time (from the change to the
next step logged) and recomputed steps, throughput per membership, and the batch split by measured speed.

    python benchmarks/elastic.py            # ~3 minutes, needs root (network namespaces)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import markdown_table, write


def run(hosts, out, steps, scenario, rate_note):
    from hf_dtrain.jobs.elastic import ElasticConfig
    from hf_dtrain.testing import free_port
    from hf_dtrain.testing.elastic_hosts import kill_strays, launch_host, lose_host, wait_for_log

    port = free_port()
    endpoint, run_id = f"{hosts[0].address}:{port}", f"bench-{port}"
    base = dict(output_dir=out, steps=steps, global_batch_size=16, min_nodes=1, max_nodes=4, collective_timeout=30.0)
    os.makedirs(out + ".logs", exist_ok=True)
    logs = {n: open(os.path.join(out + ".logs", f"{n}.log"), "w") for n in "ABCD"}
    procs, events = {}, []
    try:
        procs["A"] = launch_host(
            ElasticConfig(**base),
            endpoint,
            run_id,
            logs["A"],
            wrap=hosts[0].command,
            env=dict(GLOO_SOCKET_IFNAME=hosts[0].interface),
            local_addr=hosts[0].address,
            store_host=True,
        )
        time.sleep(2)
        procs["B"] = launch_host(
            ElasticConfig(**base, slowdown=3.0),
            endpoint,
            run_id,
            logs["B"],
            wrap=hosts[1].command,
            env=dict(GLOO_SOCKET_IFNAME=hosts[1].interface),
            local_addr=hosts[1].address,
            store_host=False,
        )
        if scenario == "elastic":
            wait_for_log(
                out,
                lambda log: sum(r["world_size"] == 2 for r in log) >= steps // 6,
                300,
                procs.values(),
                "A and B training",
            )
            lose_host(procs["B"])
            events.append(("B lost", time.time()))
            wait_for_log(
                out,
                lambda log: log[-1]["world_size"] == 1 and log[-1]["step"] >= steps // 3,
                300,
                procs.values(),
                "A alone",
            )
            procs["C"] = launch_host(
                ElasticConfig(**base),
                endpoint,
                run_id,
                logs["C"],
                wrap=hosts[2].command,
                env=dict(GLOO_SOCKET_IFNAME=hosts[2].interface),
                local_addr=hosts[2].address,
                store_host=False,
            )
            procs["D"] = launch_host(
                ElasticConfig(**base),
                endpoint,
                run_id,
                logs["D"],
                wrap=hosts[3].command,
                env=dict(GLOO_SOCKET_IFNAME=hosts[3].interface),
                local_addr=hosts[3].address,
                store_host=False,
            )
            events.append(("C, D started", time.time()))
        log = wait_for_log(out, lambda log: log[-1]["step"] == steps - 1, 600, procs.values(), "the last step")
        for p in procs.values():
            if p.poll() is None:
                p.wait(timeout=120)
    finally:
        for p in procs.values():
            if p.poll() is None:
                lose_host(p)
        for f in logs.values():
            f.close()
        kill_strays(out)
    return log, events


def summarize(log, events):
    phases, cur = [], None
    for r in log:
        if cur is None or r["generation"] != cur["generation"]:
            cur = dict(
                generation=r["generation"],
                world_size=r["world_size"],
                first_step=r["step"],
                restored_from=r.get("restored_from"),
                batch_sizes=r["batch_sizes"],
                speeds=r["speeds"],
                t0=r["time"],
                steps=0,
            )
            phases.append(cur)
        cur["steps"] += 1
        cur["t1"] = r["time"]
    for ph in phases:
        ph["steps_per_s"] = (ph["steps"] - 1) / (ph["t1"] - ph["t0"]) if ph["steps"] > 1 else None
    changes = []
    by_gen = {ph["generation"]: ph for ph in phases}
    for name, t in events:
        nxt = next((ph for ph in phases if ph["t0"] > t), None)
        if nxt is None:
            continue
        prev = by_gen.get(nxt["generation"] - 1)
        last_before = max((r["step"] for r in log if r["time"] < t), default=-1)
        changes.append(
            dict(
                event=name,
                recovery_s=nxt["t0"] - t if name == "B lost" else None,
                join_s=nxt["t0"] - t if name != "B lost" else None,
                resumed_at=nxt["first_step"],
                restored_from=nxt["restored_from"],
                recomputed=max(0, last_before - nxt["first_step"] + 1) if prev else 0,
                world=f"{prev['world_size'] if prev else '?'} -> {nxt['world_size']}",
            )
        )
    return phases, changes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--rate", default="100mbit")
    args = ap.parse_args()
    from hf_dtrain.testing.netns import available, emulated_hosts

    ok, why = available()
    if not ok:
        raise SystemExit(f"benchmarks/elastic.py needs network namespaces: {why}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp, emulated_hosts(4, rate=args.rate) as hosts:
        for scenario in ("elastic", "fixed"):
            out = os.path.join(tmp, scenario)
            t0 = time.time()
            log, events = run(hosts, out, args.steps, scenario, args.rate)
            phases, changes = summarize(log, events)
            results[scenario] = dict(log=log, phases=phases, changes=changes, wall_s=time.time() - t0)
            print(scenario, json.dumps(changes), flush=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    fixed = results["fixed"]["log"]
    ax.plot([r["step"] for r in fixed], [r["loss"] for r in fixed], color="gray", lw=1, label="A + B throughout")
    colors = {1: "tab:red", 2: "tab:blue", 3: "tab:green", 4: "tab:purple"}
    el = results["elastic"]["log"]
    for ph in results["elastic"]["phases"]:
        pts = [r for r in el if r["generation"] == ph["generation"]]
        ax.plot(
            [r["step"] for r in pts],
            [r["loss"] for r in pts],
            color=colors[ph["world_size"]],
            lw=1.2,
            label=f"elastic, {ph['world_size']} host(s) from step {ph['first_step']}",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (global batch 16)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    rows = []
    for ph in results["elastic"]["phases"]:
        rows.append(
            dict(
                phase=f"{ph['world_size']} host(s)",
                steps=f"{ph['first_step']}-{ph['first_step'] + ph['steps'] - 1}",
                restored=ph["restored_from"] or "",
                batch=str(ph["batch_sizes"]),
                speeds=str([round(s) for s in ph["speeds"]]),
                sps=ph["steps_per_s"] or 0.0,
            )
        )
    table = markdown_table(
        rows,
        [
            ("phase", "membership", ""),
            ("steps", "steps", ""),
            ("restored", "restored from", ""),
            ("batch", "batch per host", ""),
            ("speeds", "measured seq/s per host", ""),
            ("sps", "steps/s", ".1f"),
        ],
    )
    crow = [
        dict(
            event=c["event"],
            world=c["world"],
            s=(c["recovery_s"] if c["recovery_s"] is not None else c["join_s"]),
            resumed=c["resumed_at"],
            recomputed=c["recomputed"],
        )
        for c in results["elastic"]["changes"]
    ]
    table += "\n\nMembership changes:\n\n" + markdown_table(
        crow,
        [
            ("event", "event", ""),
            ("world", "hosts", ""),
            ("s", "seconds to the next step", ".1f"),
            ("resumed", "resumed at step", ""),
            ("recomputed", "steps recomputed", ""),
        ],
    )
    last = lambda log: sum(r["loss"] for r in log[-20:]) / 20  # noqa: E731
    table += (
        f"\n\nMean loss of the last 20 steps: elastic {last(el):.4f}, A + B throughout {last(fixed):.4f} "
        f"(ratio {last(el) / last(fixed):.3f}). Wall time: elastic {results['elastic']['wall_s']:.0f} s, "
        f"fixed {results['fixed']['wall_s']:.0f} s."
    )
    write(
        "elastic",
        dict(steps=args.steps, rate=args.rate, **{k: dict(v.items()) for k, v in results.items()}),
        table,
        fig,
        notes=f"4 network namespaces with {args.rate} links; the test LLaMA preset, AdamW 3e-3, global batch 16 "
        "dealt by measured speed; B runs 3x slower (--slowdown 3); snapshots every step with a persisted "
        "(resharding) copy every step.",
    )
    print(table)


if __name__ == "__main__":
    main()
