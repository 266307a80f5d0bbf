"""The profile under the communication benchmarks: how long gloo's collectives take on the emulated links, for a
buffer of the default model's size (3.1M fp32 values, 12 MB) on 4 namespaced hosts. A dense all-reduce against
DeAR's two halves (an all-to-all, which is its reduce-scatter on gloo, plus an all-gather of the shards), gloo's own
reduce-scatter, and the 1-bit exchange's messages. Best of 3 per collective.

    python benchmarks/collectives.py                 # about 2 minutes
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

NUMEL = 3_100_000
WORLD = 4


def worker(rank: int, world: int, addr: str, port: str) -> None:
    import torch
    import torch.distributed as dist

    from hf_dtrain.distributed.collectives import all_gather_single, reduce_scatter_single
    from hf_dtrain.testing import gloo_group

    with gloo_group(rank, world, addr, port, timeout_s=300):
        x = torch.randn(NUMEL // world * world)
        shard = torch.empty(x.numel() // world)
        out = {}
        cases = {
            "all_reduce (DDP, ring)": lambda: dist.all_reduce(x),
            "all_to_all (DeAR's reduce-scatter on gloo)": lambda: dist.all_to_all_single(torch.empty_like(x), x),
            "all_gather of the shards (DeAR's second half)": lambda: all_gather_single(torch.empty_like(x), shard),
            "reduce_scatter (gloo's own)": lambda: reduce_scatter_single(shard, x),
            "1-bit messages (signs, phase 1 all_to_all)": lambda: dist.all_to_all_single(
                torch.empty(x.numel() // 8, dtype=torch.uint8), torch.zeros(x.numel() // 8, dtype=torch.uint8)
            ),
        }
        for name, fn in cases.items():
            times = []
            for _ in range(3):
                dist.barrier()
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            out[name] = min(times)
        if rank == 0:
            print("RESULT " + json.dumps(out), flush=True)


def main():
    import argparse

    from _report import write

    from hf_dtrain.testing import free_port
    from hf_dtrain.testing.netns import emulated_hosts, run_on_hosts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--links", default="100mbit,1gbit")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        rank, world, addr, port = args.worker.split(":")
        worker(int(rank), int(world), addr, port)
        return
    rows = []
    for link in args.links.split(","):
        port = str(free_port())
        with emulated_hosts(WORLD, rate=link) as hosts:
            outs = run_on_hosts(
                hosts,
                lambda r, h: [sys.executable, __file__, "--worker", f"{r}:{WORLD}:{h[0].address}:{port}"],
                timeout=900,
            )
        result = json.loads(next(line for line in outs[0].splitlines() if line.startswith("RESULT "))[7:])
        ref = result["all_reduce (DDP, ring)"]
        for name, seconds in result.items():
            rows.append({"link": link, "collective": name, "seconds": seconds, "vs_all_reduce": seconds / ref})
        rows.append(
            {
                "link": link,
                "collective": "DeAR's halves together",
                "seconds": result["all_to_all (DeAR's reduce-scatter on gloo)"]
                + result["all_gather of the shards (DeAR's second half)"],
                "vs_all_reduce": (
                    result["all_to_all (DeAR's reduce-scatter on gloo)"]
                    + result["all_gather of the shards (DeAR's second half)"]
                )
                / ref,
            }
        )
    from _report import markdown_table

    table = markdown_table(
        rows,
        [
            ("link", "link", ""),
            ("collective", "collective", ""),
            ("seconds", "seconds (best of 3)", ".3f"),
            ("vs_all_reduce", "/ all-reduce", ".2f"),
        ],
    )
    notes = (
        f"{WORLD} network namespaces (veth + tc tbf each way), one gloo rank each; a buffer of {NUMEL:,} fp32 values "
        "(the default model's gradient). all_to_all and all_gather move the same bytes per rank as the "
        "reduce-scatter and all-gather halves of a ring all-reduce."
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    links = list(dict.fromkeys(r["link"] for r in rows))
    names = list(dict.fromkeys(r["collective"] for r in rows))
    for j, link in enumerate(links):
        vals = [next(r["seconds"] for r in rows if r["link"] == link and r["collective"] == n) for n in names]
        ax.barh([i + 0.4 * j for i in range(len(names))], vals, 0.4, label=link)
    ax.set_yticks([i + 0.2 for i in range(len(names))], names, fontsize=7)
    ax.set_xlabel("seconds")
    ax.legend()
    fig.tight_layout()
    paths = write("collectives", {"rows": rows, "args": vars(args)}, table, fig, notes)
    print(table)
    print("\n".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    main()
