"""HSDP's replica exchange on an emulated two-node network: FSDP2's native all-reduce against hf_dtrain's replica
exchange in FSDP2's all-reduce hook (bf16, fp16, ACP-SGD on the row shards), full fine-tuning of the embedded default
model on 4 ranks = 2 nodes x 2 ranks.

Each node is a network namespace (hf_dtrain.testing.netns) holding 2 ranks; the nodes share a bridge through veth
pairs limited with ``tc tbf``. The mesh is ``dp_replicate`` x ``dp_shard`` = 2 x 2 with the shard groups inside a
node, so the reduce-scatter stays on the node and only the replica exchange crosses the slow link, as HSDP is laid
out on real clusters. Where namespaces cannot be created the run falls back to loopback and the table says so.

Per (link, method): bytes each rank hands to the replica exchange in one step (steps after the warm-up; native HSDP
counted as the dense all-reduce of its reduce-scatter output, which is what it sends), median step time over the
second half of the steps as a ratio to native HSDP on the same link, and the training loss (mean of the last 10
steps) after the same number of steps.

    python benchmarks/hsdp_exchange.py                      # 100 Mbit/s and 1 Gbit/s, about 10 minutes
    python benchmarks/hsdp_exchange.py --links loopback     # no namespaces, no rate limit
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit_result, parse_result

METHODS = ["native", "bf16", "fp16", "acp_sgd"]
WORLD, RANKS_PER_NODE = 4, 2
RANK = 4  # --rank
START = 10  # --start-iter


def worker(rank: int, addr: str, port: str, method: str, steps: int, batch: int, lr: float) -> dict:
    from hf_dtrain.testing import gloo_group

    with gloo_group(rank, WORLD, addr, port, timeout_s=600):
        return _train(rank, method, steps, batch, lr)


def _train(rank: int, method: str, steps: int, batch: int, lr: float) -> dict:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from hf_dtrain import tasks
    from hf_dtrain.comm import CommHookConfig, fsdp_exchange_step_bytes
    from hf_dtrain.models import load_model_and_tokenizer
    from hf_dtrain.parallel import FSDPConfig
    from hf_dtrain.testing.models import shard_like_the_jobs

    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(None, progress=False)
    exchange = None if method == "native" else CommHookConfig(method=method, rank=RANK, start_iter=START)
    # native: FSDP2's own HSDP all-reduce; the others: the hook on the dp_shard mesh (dense bytes counted for native
    # by the same formula as the "allreduce" hook, which sends exactly what native HSDP sends)
    state = shard_like_the_jobs(model, FSDPConfig(replicate=2), exchange)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    data = tasks.make_task_dataset(tok, steps * batch, seed=100 + rank, split="train")
    loader = DataLoader(data, batch_size=batch, collate_fn=tasks.task_collator(tok))
    times, losses = [], []
    for b in loader:
        t0 = time.perf_counter()
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / WORLD)
    if state is not None:
        sent = statistics.mean(state.stats.steps[START:]) if method == "acp_sgd" else state.stats.steps[-1]
    else:
        from types import SimpleNamespace

        sent = fsdp_exchange_step_bytes(SimpleNamespace(method="allreduce"), model)
    return {
        "method": method,
        "bytes_per_step": sent,
        "step_time_median_s": statistics.median(times[len(times) // 2 :]),
        "loss_last10": statistics.mean(losses[-10:]),
        "losses": losses,
        "n_params": sum(p.numel() for p in model.parameters()),
    }


def run_config(link: str, method: str, steps: int, batch: int, extra: list[str]) -> tuple[dict, str]:
    from hf_dtrain.testing import free_port
    from hf_dtrain.testing.netns import available, emulated_hosts, run_ranks

    port = str(free_port())

    def argv(rank, addr):
        return [
            sys.executable,
            __file__,
            "--worker",
            f"{rank}:{addr}:{port}:{method}",
            "--steps",
            str(steps),
            "--batch-size",
            str(batch),
        ] + extra

    ok, why = available() if link != "loopback" else (False, "--links loopback asked for it")
    if ok:
        with emulated_hosts(WORLD // RANKS_PER_NODE, rate=link) as hosts:
            node = [hosts[r // RANKS_PER_NODE] for r in range(WORLD)]
            outs = run_ranks(
                [node[r].command(argv(r, hosts[0].address)) for r in range(WORLD)],
                [dict(os.environ, GLOO_SOCKET_IFNAME=node[r].interface) for r in range(WORLD)],
                timeout=3600,
            )
        where = (
            f"{WORLD // RANKS_PER_NODE} network namespaces (nodes) of {RANKS_PER_NODE} ranks, veth + tc tbf "
            f"{link} each way"
        )
    else:  # loopback: same processes, no rate limit
        outs = run_ranks([argv(r, "127.0.0.1") for r in range(WORLD)], [dict(os.environ)] * WORLD, timeout=3600)
        where = f"loopback, no rate limit ({why})"
    return parse_result(outs[0]), where


def main():
    global RANK, START
    from _report import rerender, training_parser

    ap = training_parser(__doc__, {})
    ap.add_argument("--links", default="100mbit,1gbit")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--rank", type=int, default=RANK, help="rank of ACP-SGD's factors")
    ap.add_argument("--start-iter", type=int, default=START, help="dense warm-up steps of ACP-SGD")
    ap.add_argument("--learning-rate", type=float, default=5e-4, help="AdamW learning rate (every method)")
    ap.set_defaults(steps=60)
    args = ap.parse_args()
    RANK, START = args.rank, args.start_iter
    if args.from_json:
        rerender(args.from_json, "hsdp_exchange", render)
        return
    if args.worker:
        rank, addr, port, method = args.worker.split(":")
        emit_result(worker(int(rank), addr, port, method, args.steps, args.batch_size, args.learning_rate))
        return
    if "native" not in args.methods.split(","):
        ap.error("--methods must include native: every ratio is taken against it")
    from tqdm import tqdm

    from hf_dtrain.models import build_default_model

    build_default_model("tiny", progress=True)
    rows = []
    for link, method in tqdm(
        [(l, m) for l in args.links.split(",") for m in args.methods.split(",")], desc="link x method"
    ):
        extra = [
            "--rank",
            str(args.rank),
            "--start-iter",
            str(args.start_iter),
            "--learning-rate",
            str(args.learning_rate),
        ]
        result, where = run_config(link, method, args.steps, args.batch_size, extra)
        rows.append(dict(result, link=link, network=where))
    from _report import ratios_per_link

    ratios_per_link(rows, "native", "native")
    payload = {"rows": rows, "args": vars(args), "rank": args.rank, "start_iter": args.start_iter}
    from _report import write

    table, fig, notes = render(payload)
    paths = write("hsdp_exchange", payload, table, fig, notes)
    print(table)
    print("\n".join(str(p) for p in paths.values()))


def render(payload: dict):
    from _report import markdown_table

    rows, args = payload["rows"], payload["args"]
    for r in rows:
        r["MiB_per_step"] = r["bytes_per_step"] / 2**20
    table = markdown_table(
        rows,
        [
            ("link", "link", ""),
            ("method", "replica exchange", ""),
            ("MiB_per_step", "MiB per step per rank", ".3f"),
            ("bytes_vs_native", "bytes / native", ".3f"),
            ("step_time_median_s", "median step (s)", ".3f"),
            ("step_time_vs_native", "step time / native", ".2f"),
            ("loss_last10", "train loss (last 10 steps)", ".4f"),
            ("loss_vs_native", "loss / native", ".3f"),
        ],
    )
    where = sorted({r["network"] for r in rows})
    notes = (
        f"Full fine-tuning of the embedded default model (tiny LLaMA, {rows[0]['n_params'] / 1e6:.1f}M "
        f"parameters) under HSDP, 2 replica groups x 2 shards, {args['steps']} AdamW steps (lr "
        f"{args['learning_rate']}) of batch {args['batch_size']} per rank on the addition task, gloo. Network: "
        f"{'; '.join(where)}. ACP-SGD: rank {payload['rank']}, {payload['start_iter']} dense warm-up steps, "
        "error feedback; its bytes are the mean over the compressed steps (P and Q steps alternate). Bytes: "
        "what each rank hands to the replica all-reduce per step (hf_dtrain.distributed.WireStats; native HSDP "
        "by the dense formula). Step time: median over the second half of the steps, as a ratio to native "
        "HSDP on the same link. DeepSpeed ZeRO++'s quantized gradients (zero_quantized_gradients), the "
        "comparison a DeepSpeed user would make, do not run on this machine: DeepSpeed 0.19's CPU accelerator "
        "has no QuantizerBuilder ('This op had not been implemented on CPU backend')."
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from _report import bars_by_link

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    links, methods = bars_by_link(
        [
            (axes[0], "MiB_per_step", "MiB per step per rank, replica exchange (log)"),
            (axes[1], "step_time_vs_native", "step time / native HSDP"),
        ],
        rows,
    )
    for link in links:
        for m in methods:
            r = next(x for x in rows if x["link"] == link and x["method"] == m)
            axes[2].plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"{link} {m}", lw=0.9)
    axes[0].set_yscale("log")
    axes[1].axhline(1.0, color="gray", lw=0.8, ls="--")
    axes[1].legend(title="link")
    axes[2].set_title("training loss per step")
    axes[2].set_xlabel("step")
    axes[2].legend(fontsize=6)
    fig.suptitle("HSDP replica exchange across two emulated nodes (network namespaces + tc tbf)")
    return table, fig, notes


if __name__ == "__main__":
    main()
