"""Gradient communication on an emulated slow network: dense all-reduce, torch's PowerSGD and fp16 hooks, ACP-SGD,
S2 Reducer, DeAR and EmbRace, full fine-tuning of the embedded default model with 2 ranks.

Each rank runs as a separate "host" in its own network namespace; the hosts share a bridge through veth pairs limited
with ``tc tbf`` (hf_dtrain.testing.netns). Where namespaces cannot be created the run falls back to loopback and the
table says so. Per (link, method): bytes each rank hands to collectives per step (compressed steps; torch's hooks by
their own compression rule), median step time over the second half of the steps as a ratio to the dense all-reduce on
the same link, and the training loss (mean of the last 10 steps) after the same number of steps.

    python benchmarks/comm_hooks.py                       # 100 Mbit/s and 1 Gbit/s, about 15 minutes
    python benchmarks/comm_hooks.py --steps 40 --links 100mbit
    python benchmarks/comm_hooks.py --links loopback      # no namespaces, no rate limit
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit_result, parse_result  # noqa: E402  (the worker protocol)

METHODS = ["allreduce", "fp16", "powersgd", "acp_sgd", "s2_reducer", "dear", "embrace"]
OURS = ("allreduce", "acp_sgd", "s2_reducer", "dear", "embrace")
RANK = 4  # --rank
START = 10  # --start-iter


def torch_hook_bytes(method: str, model) -> int:
    """Bytes per compressed step of torch's built-in hooks, by their own rules (their collectives are not ours to
    count): fp16 halves every value; PowerSGD sends P and Q of every matrix with (n + m) r * 2 < n m, the rest dense."""
    total = 0
    for p in model.parameters():
        if method == "fp16":
            total += p.numel() * 2
            continue
        if p.dim() > 1:
            n, m = p.shape[0], p.numel() // p.shape[0]
            if (n + m) * RANK * 2 < n * m:
                total += (n + m) * RANK * 4
                continue
        total += p.numel() * 4
    return total


def worker(rank: int, world: int, addr: str, port: str, method: str, steps: int, batch: int, lr: float) -> dict:
    from hf_dtrain.testing import gloo_group

    with gloo_group(rank, world, addr, port, timeout_s=300):  # DDP lives in _train only: freed before the group
        return _train(rank, world, method, steps, batch, lr)


def _train(rank: int, world: int, method: str, steps: int, batch: int, lr: float) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    import hf_dtrain.comm as comm
    from hf_dtrain import tasks
    from hf_dtrain.models import load_model_and_tokenizer

    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(None, progress=False)
    if method == "embrace":
        comm.exclude_embeddings(model)  # before DDP wraps the model
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=lr)
    state = None
    if method in OURS:
        state = comm.register(ddp, {"method": method, "rank": RANK, "start_iter": START}, optimizer=opt)
    elif method == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        ddp.register_comm_hook(None, fp16_compress_hook)
    elif method == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

        ddp.register_comm_hook(PowerSGDState(None, matrix_approximation_rank=RANK, start_powerSGD_iter=START,
                                             min_compression_rate=2, use_error_feedback=True, warm_start=True),
                               powerSGD_hook)
    data = tasks.make_task_dataset(tok, steps * batch, seed=100 + rank, split="train")
    loader = DataLoader(data, batch_size=batch, collate_fn=tasks.task_collator(tok))
    times, losses = [], []
    for b in loader:
        t0 = time.perf_counter()
        loss = ddp(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    if method == "dear":
        state.flush()  # the last update is deferred to a next forward that does not come
    if state is not None:
        sent = state.stats.steps[-1]
    else:
        sent = torch_hook_bytes(method, model)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    return {"method": method, "bytes_per_step": sent, "dense_bytes": sum(p.numel() * 4 for p in model.parameters()),
            "step_time_median_s": statistics.median(times[len(times) // 2:]),
            "loss_last10": statistics.mean(losses[-10:]),
            "replicas_identical": all(torch.equal(gathered[0], g) for g in gathered)}


def run_config(link: str, method: str, steps: int, batch: int, world: int, extra: list[str]) -> tuple[dict, str]:
    from hf_dtrain.testing import free_port
    import os

    from hf_dtrain.testing.netns import available, emulated_hosts, run_on_hosts, run_ranks

    port = str(free_port())

    def argv(rank, hosts):
        addr = hosts[0].address if hosts else "127.0.0.1"
        return [sys.executable, __file__, "--worker", f"{rank}:{world}:{addr}:{port}:{method}", "--steps", str(steps),
                "--batch-size", str(batch)] + extra

    ok, why = available() if link != "loopback" else (False, "--links loopback asked for it")
    if ok:
        with emulated_hosts(world, rate=link) as hosts:
            outs = run_on_hosts(hosts, argv, timeout=3600)
        where = f"{world} network namespaces, veth + tc tbf {link} each way"
    else:  # loopback: same processes, no rate limit
        outs = run_ranks([argv(r, None) for r in range(world)], [dict(os.environ)] * world, timeout=3600)
        where = f"loopback, no rate limit ({why})"
    result = parse_result(outs[0])
    return result, where


def main():
    global RANK, START
    from _report import rerender, training_parser

    ap = training_parser(__doc__, {})
    ap.add_argument("--links", default="100mbit,1gbit")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--name", default="comm_hooks", help="results file name under benchmarks/results/")
    ap.add_argument("--rank", type=int, default=RANK, help="rank of PowerSGD's and ACP-SGD's factors")
    ap.add_argument("--start-iter", type=int, default=START, help="dense warm-up steps of the compressing hooks")
    ap.add_argument("--learning-rate", type=float, default=5e-4, help="AdamW learning rate (every method)")
    ap.set_defaults(steps=60)
    args = ap.parse_args()
    RANK, START = args.rank, args.start_iter
    if "allreduce" not in args.methods.split(","):
        ap.error("--methods must include allreduce: every ratio is taken against it")
    if args.from_json:
        rerender(args.from_json, args.name, render)
        return
    if args.worker:
        rank, world, addr, port, method = args.worker.split(":")
        emit_result((worker(int(rank), int(world), addr, port, method, args.steps, args.batch_size,
                                            args.learning_rate)))
        return
    from tqdm import tqdm

    from hf_dtrain.models import build_default_model

    build_default_model("tiny", progress=True)
    rows = []
    for link, method in tqdm([(l, m) for l in args.links.split(",") for m in args.methods.split(",")],
                             desc="link x method"):
        extra = ["--rank", str(args.rank), "--start-iter", str(args.start_iter), "--learning-rate", str(args.learning_rate)]
        result, where = run_config(link, method, args.steps, args.batch_size, args.world, extra)
        rows.append(dict(result, link=link, network=where))
    from _report import ratios_per_link

    ratios_per_link(rows, "allreduce", "dense")
    payload = {"rows": rows, "args": vars(args), "rank": args.rank, "start_iter": args.start_iter}
    from _report import write

    table, fig, notes = render(payload)
    paths = write(args.name, payload, table, fig, notes)
    print(table)
    print("\n".join(str(p) for p in paths.values()))


def render(payload: dict):
    from _report import markdown_table

    rows, args = payload["rows"], payload["args"]
    for r in rows:
        r["MiB_per_step"] = r["bytes_per_step"] / 2**20
    table = markdown_table(rows, [
        ("link", "link", ""), ("method", "method", ""), ("MiB_per_step", "MiB per step per rank", ".3f"),
        ("bytes_vs_dense", "bytes / dense", ".3f"), ("step_time_median_s", "median step (s)", ".3f"),
        ("step_time_vs_dense", "step time / dense", ".2f"), ("loss_last10", "train loss (last 10 steps)", ".3f"),
        ("loss_vs_dense", "loss / dense", ".3f"), ("replicas_identical", "replicas identical", ""),
    ])
    where = sorted({r["network"] for r in rows})
    notes = (f"Full fine-tuning of the embedded default model (tiny LLaMA, 3.1M parameters), {args['world']} ranks, "
             f"{args['steps']} AdamW steps (lr {args.get('learning_rate', 5e-4)}) of batch {args['batch_size']} per rank on the addition task, gloo. "
             f"Network: {'; '.join(where)}. Compressing hooks: rank {payload['rank']}, {payload['start_iter']} dense "
             "warm-up steps. Bytes: what each rank hands to collectives in one compressed step (ours counted by "
             "hf_dtrain.distributed.WireStats; torch's fp16 and PowerSGD by their compression rules). Step time: "
             "median over the second half of the steps, as a ratio to the dense all-reduce on the same link. Full fine-tuning "
             "gives dense gradients, so S2 Reducer falls back to the dense all-reduce on every bucket (plus its 1-bit "
             "bitmap), and EmbRace saves only the embedding's share of the bytes. DeAR moves a dense all-reduce's bytes "
             "(on gloo its reduce-scatter is an all-to-all plus a local sum) and wins only where the all-gather can hide "
             "behind the next forward; on these links the communication is many times the compute.")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from _report import bars_by_link

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    links, _ = bars_by_link([(axes[0], "MiB_per_step", "MiB per step per rank (log)"),
                             (axes[1], "step_time_vs_dense", "step time / dense all-reduce"),
                             (axes[2], "loss_last10", "train loss, last 10 steps")], rows)
    axes[0].set_yscale("log")
    axes[1].axhline(1.0, color="gray", lw=0.8, ls="--")
    losses = [r["loss_last10"] for r in rows]
    axes[2].set_ylim(0.9 * min(losses), 1.05 * max(losses))
    axes[1].legend(title="link", loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(links))
    fig.suptitle("Gradient communication on an emulated network (network namespaces + tc tbf)")
    return table, fig, notes


if __name__ == "__main__":
    main()
