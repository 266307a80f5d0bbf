"""Scale on paper: what each communication method and the in-memory snapshots cost per step at 8, 64, 512 and 4096
GPUs on 100 and 400 Gbit/s links, for the LLaMA-2 7B and 70B shapes, from the byte formulas our tests check against
the measured wire bytes (``acp_sgd_step_bytes``, ``onebit_lamb_step_bytes``, the gossip and snapshot sizes) and
stated hardware assumptions. No GPU is used: the model shapes come from a meta-device model.

    python benchmarks/scaling.py        # seconds; writes benchmarks/results/scaling.{json,md,png}
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

GPUS = [8, 64, 512, 4096]
LINKS_GBIT = [100, 400]
MODELS = ["llama2-7b", "llama2-70b"]
A = dict(
    peak_tflops=989.0,  # H100 SXM bf16 dense
    mfu=0.40,  # model FLOPs utilisation of the compute
    tokens_per_gpu=4 * 4096,  # micro-batch 4 x 4096 tokens per GPU per step (weak scaling)
    grad_bytes=2,  # bf16 gradients and gossip
    link_efficiency=0.8,  # achieved fraction of the link rate
    hop_latency_s=10e-6,  # per ring hop (NCCL-like)
    state_bytes_per_param=14,  # bf16 params + fp32 master + two fp32 Adam moments
    pcie_gbyte_s=25.0,  # device-to-host copy of the snapshot
    gpus_per_node=8,
    parity_group=(4, 1),  # k data + m parity nodes
    disk_gbyte_s_per_node=2.0,  # a checkpoint to shared storage, per node
    acp_rank=4,
)


def shapes(preset: str):
    import torch
    from transformers import LlamaForCausalLM

    from hf_dtrain.models import llama_config

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(preset))
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def costs(named_shapes, n_gpus: int, link_gbit: float) -> dict:
    """Seconds per step for compute and for each method's exchange (exposed part, after the overlap it allows)."""
    from hf_dtrain.comm.acp_sgd import ACPSGDState, acp_sgd_step_bytes
    from hf_dtrain.optim.onebit_lamb import onebit_lamb_step_bytes

    P = sum(math.prod(s) for _, s in named_shapes)
    compute = 6 * P * A["tokens_per_gpu"] / (A["peak_tflops"] * 1e12 * A["mfu"])
    backward, forward = compute * 2 / 3, compute / 3
    bw = link_gbit * 1e9 / 8 * A["link_efficiency"]
    ring = 2 * (n_gpus - 1) / n_gpus
    latency = 2 * (n_gpus - 1) * A["hop_latency_s"]
    dense_bytes = ring * A["grad_bytes"] * P
    t_dense = dense_bytes / bw + latency
    state = ACPSGDState(rank=A["acp_rank"])
    acp_payload = (
        acp_sgd_step_bytes(state, named_shapes, A["grad_bytes"], True)
        + acp_sgd_step_bytes(state, named_shapes, A["grad_bytes"], False)
    ) / 2
    t_acp = ring * acp_payload / bw + latency
    onebit = onebit_lamb_step_bytes(P, n_gpus) * (n_gpus - 1) / n_gpus
    t_onebit = onebit / bw + 2 * (n_gpus - 1) * A["hop_latency_s"]
    t_gossip = 2 * A["grad_bytes"] * P / bw + 2 * A["hop_latency_s"]  # ring topology: two neighbours
    # in-memory snapshot every step: the rank's shard of the training state (sharded as ZeRO/FSDP), copied to host
    # (overlaps the next forward and backward) and its parity sent to one peer node (m/k of the node's shards)
    shard = A["state_bytes_per_param"] * P / n_gpus
    k, m = A["parity_group"]
    t_d2h = shard / (A["pcie_gbyte_s"] * 1e9)
    t_parity = shard * m / k * (k + m) / k / bw  # each piece to m holders, spread over the group
    t_disk = shard * A["gpus_per_node"] / (A["disk_gbyte_s_per_node"] * 1e9)
    return {
        "params": P,
        "compute_s": compute,
        "dense_ddp": max(0.0, t_dense - backward),  # DDP overlaps the all-reduce with backward
        "acp_sgd": max(0.0, t_acp - backward),  # compressed, same overlap
        "dear": max(0.0, t_dense - backward - forward),  # reduce-scatter in backward, all-gather in next forward
        "onebit_lamb": t_onebit,  # exchanged inside step(): no overlap
        "gossip": t_gossip,  # D-PSGD / DecentLaM on a ring, inside step()
        "snapshot_every_step": max(0.0, t_d2h + t_parity - compute),
        "disk_checkpoint": t_disk,
        "raw": {
            "dense": t_dense,
            "acp": t_acp,
            "onebit": t_onebit,
            "gossip": t_gossip,
            "d2h": t_d2h,
            "parity": t_parity,
        },
    }


def main():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from-json")
    args = ap.parse_args()
    if args.from_json:
        from _report import rerender

        rerender(args.from_json, "scaling", render)
        return
    rows = []
    for preset in MODELS:
        named = shapes(preset)
        for link in LINKS_GBIT:
            for n in GPUS:
                rows.append({"model": preset, "link_gbit": link, "gpus": n, **costs(named, n, link)})
    payload = {"rows": rows, "assumptions": A}
    from _report import write

    table, fig, notes = render(payload)
    paths = write("scaling", payload, table, fig, notes)
    print(table)
    print("\n".join(str(p) for p in paths.values()))


METHODS = [
    ("dense_ddp", "DDP all-reduce"),
    ("acp_sgd", "ACP-SGD r=4"),
    ("dear", "DeAR"),
    ("onebit_lamb", "1-bit LAMB"),
    ("gossip", "D-PSGD/DecentLaM ring"),
    ("snapshot_every_step", "snapshot every step"),
    ("disk_checkpoint", "disk checkpoint (1 save)"),
]


def render(payload: dict):
    from _report import markdown_table

    rows = payload["rows"]
    for r in rows:
        for key, _ in METHODS:
            r[f"{key}_x"] = (r["compute_s"] + r[key]) / r["compute_s"]
    columns = [
        ("model", "model", ""),
        ("link_gbit", "Gbit/s", ""),
        ("gpus", "GPUs", ""),
        ("compute_s", "compute (s)", ".2f"),
    ] + [(f"{k}_x", label, ".2f") for k, label in METHODS]
    table = (
        "Step time as a multiple of the compute time (1.00: the exchange is hidden), per method.\n\n"
        + markdown_table(rows, columns)
    )
    a = payload["assumptions"]
    notes = (
        f"Assumptions: {a['peak_tflops']:.0f} TFLOP/s bf16 peak at MFU {a['mfu']}, {a['tokens_per_gpu']} tokens "
        f"per GPU per step, bf16 gradients ({a['grad_bytes']} bytes), {a['link_efficiency']:.0%} of the link rate "
        f"per GPU (no NVLink shortcut inside a node), {a['hop_latency_s'] * 1e6:.0f} us per ring hop; the training "
        f"state is {a['state_bytes_per_param']} bytes/param sharded over the GPUs (ZeRO/FSDP), copied to host at "
        f"{a['pcie_gbyte_s']:.0f} GB/s, parity groups of {a['parity_group'][0]}+{a['parity_group'][1]} nodes; a "
        f"disk checkpoint writes {a['disk_gbyte_s_per_node']:.0f} GB/s per node of {a['gpus_per_node']} GPUs. "
        "DDP overlaps its all-reduce with backward, DeAR also with the next forward; 1-bit LAMB and gossip "
        "exchange inside step() (no overlap). Byte formulas are the ones the test suite checks against the "
        "measured wire bytes. Convergence differences (compression error, consensus distance) are not in these "
        "numbers: see the measured benchmarks."
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(m, l) for m in MODELS for l in LINKS_GBIT]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.4), squeeze=False)
    for ax, (model, link) in zip(axes[0], panels):
        sub = [r for r in rows if r["model"] == model and r["link_gbit"] == link]
        for key, label in METHODS[:5]:
            ax.plot([r["gpus"] for r in sub], [r[f"{key}_x"] for r in sub], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("step time / compute time")
        ax.set_title(f"{model}, {link} Gbit/s")
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Exchange cost per step on paper (bytes from the tested formulas)")
    fig.tight_layout()
    return table, fig, notes


if __name__ == "__main__":
    main()
