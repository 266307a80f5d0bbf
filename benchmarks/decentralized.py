"""Decentralized and straggler-tolerant training on the default model, 4 gloo ranks on loopback, one run each:
all-reduce SGD (DDP), D-PSGD (ring), DecentLaM (ring), LSGD (2 nodes of 2), AL-DSGD (MATCHA ring, budget 0.5), each
without and with one rank slowed down 3x; under the straggler also all-reduce SGD with the heterogeneity-aware
partitioner, Non-blocking SGD (all-reduce), and Non-blocking D-PSGD and DecentLaM (gossip). Plus CRAIG against random
subsets of the same size (one process).

Full fine-tuning on the addition task, batch 16 per rank (4 micro-batches of 4 for the non-blocking runs), SGD with
momentum 0.9 for every method. Reports the training loss against wall time (PNG), the time to a target loss as a
ratio to all-reduce SGD under the same condition (the target: all-reduce SGD's final smoothed loss without a
straggler, times ``--target-factor``), bytes each rank sends per step, the final consensus distance between the
replicas, and CRAIG's held-out loss and gradient error against random subsets.

    python benchmarks/decentralized.py                  # about 15 minutes on 2 CPU cores
    python benchmarks/decentralized.py --steps 100 --methods allreduce,dpsgd
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit_result, parse_result

LR = {
    "allreduce": 0.01,
    "dpsgd": 0.01,
    "decentlam": 0.01,
    "lsgd": 0.01,
    "aldsgd": 0.01,
    "partition": 0.01,
    "nonblocking": 0.01,
    "nb_dpsgd": 0.01,
    "nb_decentlam": 0.01,
    "craig": 0.01,
}
BLOCKING = ["allreduce", "dpsgd", "decentlam", "lsgd", "aldsgd"]
STRAGGLER_ONLY = ["partition", "nonblocking", "nb_dpsgd", "nb_decentlam"]
WORLD, SLOW_RANK, SLOWDOWN, MICRO = 4, 3, 3.0, 4
SMOOTH = 20


def worker(rank: int, world: int, port: str, method: str, straggle: bool, steps: int, batch: int, lr: float) -> dict:
    from hf_dtrain.testing import gloo_group

    with gloo_group(rank, world, port=port, timeout_s=600):  # DDP lives in _train only: freed before the group
        return _train(rank, world, method, straggle, steps, batch, lr)


def _optimizer(method: str, params, model, lr: float):
    import torch

    from hf_dtrain.decentralized import ALDSGD, DPSGD, LSGD, DecentLaM

    if method in ("allreduce", "partition", "nonblocking"):
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if method in ("dpsgd", "nb_dpsgd"):
        return DPSGD(params, topology="ring", lr=lr, momentum=0.9)
    if method in ("decentlam", "nb_decentlam"):
        return DecentLaM(params, topology="ring", lr=lr, momentum=0.9)
    if method == "lsgd":
        return LSGD(params, model=model, lr=lr, momentum=0.9, local_period=4, global_period=16, ranks_per_node=2)
    if method == "aldsgd":
        return ALDSGD(params, model=model, topology="matcha", lr=lr, momentum=0.9)
    raise ValueError(method)


def _train(rank: int, world: int, method: str, straggle: bool, steps: int, batch: int, lr: float) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    from hf_dtrain.comm import register
    from hf_dtrain.data import HeterogeneityAwareSampler, tasks
    from hf_dtrain.decentralized import NonBlockingSGD, Straggler
    from hf_dtrain.models import load_model_and_tokenizer

    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(None, progress=False)
    ddp = DDP(model)
    if method != "allreduce" and method != "partition" and method != "nonblocking":
        register(ddp, "noop")  # decentralized: gradients stay local, the optimizer gossips
    elif method == "nonblocking":
        register(ddp, "noop")  # NonBlockingSGD all-reduces the gradient sums itself
    opt = _optimizer(method, ddp.parameters(), ddp, lr)
    straggler = Straggler({SLOW_RANK: SLOWDOWN} if straggle else {}, rank=rank)
    n_train = steps * batch * world
    data = tasks.make_task_dataset(tok, n_train, seed=100, split="train")
    collate = tasks.task_collator(tok)
    scale = 1.0
    if method == "partition":  # shards and batches sized to the measured speeds (the slow rank: a third)
        speeds = [1.0 / SLOWDOWN if r == SLOW_RANK else 1.0 for r in range(world)]
        global_batch = batch * world
        sampler = HeterogeneityAwareSampler(
            None, speeds, rank=rank, num_samples=n_train, seed=0, global_batch_size=global_batch
        )
        loader = DataLoader(data, batch_size=sampler.batch_size_for(global_batch), sampler=sampler, collate_fn=collate)
        scale = sampler.loss_scale(global_batch)
    else:
        shard = list(range(rank, n_train, world))
        loader = DataLoader(torch.utils.data.Subset(data, shard), batch_size=batch, collate_fn=collate)
    nb = None
    if method.startswith("nb_") or method == "nonblocking":
        nb = NonBlockingSGD(
            ddp,
            opt,
            deadline="fastest",
            average="allreduce" if method == "nonblocking" else "local",
            straggler=straggler,
        )
    losses, times, counts = [], [], []
    dist.barrier()
    t0 = time.perf_counter()
    for step, full in enumerate(loader):
        if step == steps:
            break
        if nb is not None:
            micro = [{k: v[i::MICRO] for k, v in full.items()} for i in range(MICRO)]
            record = nb.step(micro)
            losses.append(record["loss"])
            counts.append(record["count"])
        else:
            start = time.perf_counter()
            loss = ddp(**full).loss
            # slow compute: the straggler's extra time (its forward + backward ~ 3 forwards) before the backward's
            # all-reduce, so its peers wait in the collective as they would for a slow GPU
            straggler.after_compute(3 * (time.perf_counter() - start))
            (loss * scale).backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    # the global training loss per step (mean over ranks), in one all-reduce after the run
    mean = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean)
    stats = getattr(opt, "stats", None)
    sent = list(stats.steps) if stats is not None else []
    if nb is not None:
        sent = [a + (sent[i] if i < len(sent) else 0) for i, a in enumerate(nb.stats.steps)]
    elif method in ("allreduce", "partition"):
        sent = [sum(p.numel() * p.element_size() for p in model.parameters())] * len(losses)  # DDP's payload
    params = list(model.parameters())
    from hf_dtrain.decentralized import consensus_distance

    return {
        "method": method,
        "straggler": straggle,
        "losses": (mean / world).tolist(),
        "times": times,
        "bytes_steps": sent,
        "consensus": consensus_distance(params),
        "counts": counts,
        "rank": rank,
    }


def run_world(method: str, straggle: bool, steps: int, batch: int, lr: float, world: int) -> dict:
    from hf_dtrain.testing import free_port
    from hf_dtrain.testing.netns import run_ranks

    port = str(free_port())
    argv = [
        [
            sys.executable,
            __file__,
            "--worker",
            f"{r}:{world}:{port}:{method}:{int(straggle)}",
            "--steps",
            str(steps),
            "--batch-size",
            str(batch),
            "--lr",
            f"{method}={lr}",
        ]
        for r in range(world)
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    outs = run_ranks(argv, [env] * world, timeout=3600)
    rows = [parse_result(o) for o in outs]
    row = rows[0]
    row["counts_by_rank"] = [r["counts"] for r in rows]
    return row


def run_craig(steps: int, batch: int, lr: float, fraction: float) -> list[dict]:
    """One process: CRAIG's weighted subset against random subsets of the same size, on the default model."""
    import torch
    from torch.utils.data import DataLoader

    from hf_dtrain.data import craig_select, lm_gradient_proxies, tasks
    from hf_dtrain.models import load_model_and_tokenizer

    torch.manual_seed(0)
    base, tok = load_model_and_tokenizer(None, progress=False)
    n = 2000
    pool = tasks.make_task_dataset(tok, n, seed=200, split="train")
    collate = tasks.task_collator(tok)
    held_out = tasks.make_task_dataset(tok, 256, seed=7, split="eval")
    proxies = lm_gradient_proxies(base, DataLoader(pool, batch_size=64, collate_fn=collate))
    k = int(fraction * n)
    subsets = {"craig": craig_select(proxies, k)}
    for s in range(3):
        pick = torch.randperm(n, generator=torch.Generator().manual_seed(s))[:k].tolist()
        subsets[f"random_{s}"] = (pick, torch.full((k,), n / k, dtype=torch.float64))
    full_proxy = proxies.double().sum(0)
    rows = []
    for name, (indices, weights) in subsets.items():
        err = float((proxies[indices].double().T @ weights - full_proxy).norm() / full_proxy.norm())
        model, _ = load_model_and_tokenizer(None, progress=False)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        w = (weights / weights.mean()).float()  # per-example loss weights, mean 1
        order = torch.randperm(k, generator=torch.Generator().manual_seed(0))
        for step in range(steps):
            pos = order[(torch.arange(batch) + step * batch) % k]
            b = collate([pool[indices[int(p)]] for p in pos])
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
            target = b["labels"][:, 1:]
            per_tok = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), target, ignore_index=-100, reduction="none"
            )
            per_ex = per_tok.sum(1) / (target != -100).sum(1).clamp(min=1)
            (per_ex * w[pos]).mean().backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            loss = sum(model(**hb).loss.item() for hb in DataLoader(held_out, batch_size=64, collate_fn=collate)) / 4
        rows.append({"subset": name, "size": k, "proxy_gradient_error": err, "held_out_loss": loss})
    return rows


def main():
    from _report import apply_lr_overrides, rerender, training_parser

    ap = training_parser(__doc__, LR)
    ap.add_argument("--target-factor", type=float, default=1.05)
    ap.add_argument("--methods", default=",".join(BLOCKING + STRAGGLER_ONLY))
    ap.add_argument("--craig-fraction", type=float, default=0.1)
    ap.add_argument("--craig-steps", type=int, default=150)
    ap.set_defaults(steps=250)
    args = ap.parse_args()
    apply_lr_overrides(args.lr, LR)
    if args.from_json:
        rerender(args.from_json, "decentralized", render)
        return
    if args.worker:
        rank, world, port, method, straggle = args.worker.split(":")
        emit_result(
            worker(int(rank), int(world), port, method, bool(int(straggle)), args.steps, args.batch_size, LR[method])
        )
        return
    from tqdm import tqdm

    from hf_dtrain.models import build_default_model

    build_default_model("tiny", progress=True)
    methods = args.methods.split(",")
    runs = [(m, False) for m in BLOCKING if m in methods] + [
        (m, True) for m in BLOCKING + STRAGGLER_ONLY if m in methods
    ]
    rows = []
    for method, straggle in tqdm(runs, desc="decentralized"):
        rows.append(run_world(method, straggle, args.steps, args.batch_size, LR[method], WORLD))
    craig = run_craig(args.craig_steps, args.batch_size, LR["craig"], args.craig_fraction)
    payload = {"rows": rows, "craig": craig, "args": vars(args)}
    from _report import write

    table, fig, notes = render(payload)
    paths = write("decentralized", payload, table, fig, notes)
    print(table)
    print("\n".join(str(p) for p in paths.values()))


def render(payload: dict):
    from _report import markdown_table, summarize_curve

    rows, args = payload["rows"], payload["args"]
    for r in rows:
        summarize_curve(r, SMOOTH)
        r["label"] = r["method"] + (" (3x straggler)" if r["straggler"] else "")
        r["bytes_per_step"] = round(sum(r["bytes_steps"]) / len(r["bytes_steps"])) if r["bytes_steps"] else None
        r["mean_count"] = (
            sum(sum(c) for c in r["counts_by_rank"]) / max(1, sum(len(c) for c in r["counts_by_rank"]))
            if any(r["counts_by_rank"])
            else None
        )
        r["slow_rank_count"] = (
            sum(r["counts_by_rank"][SLOW_RANK]) / len(r["counts_by_rank"][SLOW_RANK])
            if any(r["counts_by_rank"])
            else None
        )
    base = next(r for r in rows if r["method"] == "allreduce" and not r["straggler"])
    target = base["final"] * args["target_factor"]
    for r in rows:
        i = next((k for k, x in enumerate(r["smoothed"]) if x <= target), None)
        r["time_to_target"] = None if i is None else r["times"][i]
        r["steps_to_target"] = None if i is None else i + 1
    for r in rows:
        ref = next((x for x in rows if x["method"] == "allreduce" and x["straggler"] == r["straggler"]), None)
        r["time_vs_allreduce"] = (
            r["time_to_target"] / ref["time_to_target"]
            if ref and r["time_to_target"] and ref["time_to_target"]
            else None
        )
        r["step_time_ms"] = 1000 * r["seconds"] / len(r["times"])
    table = markdown_table(
        rows,
        [
            ("label", "method", ""),
            ("final", "final loss (smoothed)", ".3f"),
            ("steps_to_target", "steps to target", ""),
            ("time_to_target", "time to target (s)", ".1f"),
            ("time_vs_allreduce", "time / all-reduce SGD (same condition)", ".2f"),
            ("step_time_ms", "ms per step", ".0f"),
            ("bytes_per_step", "bytes sent per rank, mean per step", ""),
            ("consensus", "final consensus distance", ".2e"),
            ("slow_rank_count", "micro-batches per step, slow rank (of 4)", ".2f"),
        ],
    )
    craig = payload.get("craig") or []
    if craig:
        table += "\n\n### CRAIG against random subsets of the same size\n\n" + markdown_table(
            craig,
            [
                ("subset", "subset", ""),
                ("size", "examples", ""),
                ("proxy_gradient_error", "relative error of the weighted proxy gradient", ".3f"),
                ("held_out_loss", "held-out loss after training on it", ".3f"),
            ],
        )
    notes = (
        f"Full fine-tuning of the embedded default model (tiny LLaMA) on the addition task, {WORLD} gloo ranks on "
        f"loopback (one thread each on this machine), {args['steps']} steps of batch {args['batch_size']} per rank, "
        f"SGD momentum 0.9 at lr {LR['allreduce']} for every method. Straggler: rank {SLOW_RANK} sleeps "
        f"{SLOWDOWN - 1:g}x its compute time after each forward (so it computes {SLOWDOWN:g}x slower). D-PSGD and "
        "DecentLaM on a ring; LSGD with 2 nodes of 2 ranks, local pulls every 4 steps and global every 16 "
        "(couplings 0.1); AL-DSGD on MATCHA matchings of a ring (budget 0.5, c1 0.3, c2 0.1, p1 = p2 = 0.2). "
        "Partition: shards and batches sized to the speeds (the slow rank gets a third) with loss scales so every "
        f"sample weighs the same. Non-blocking: {MICRO} micro-batches per step, deadline = the fastest rank's "
        "full-batch time. Loss: mean over ranks of the training loss, mean of the last "
        f"{SMOOTH} steps. Target: all-reduce SGD's final smoothed loss without a straggler x "
        f"{args['target_factor']} = {target:.3f}; ratios against all-reduce SGD under the same condition. "
        "Bytes: what each rank hands to collectives or sends to neighbours, mean per step (DDP: its all-reduce "
        "payload; a ring all-reduce moves 2(N-1)/N = 1.5x that per rank, so D-PSGD's two neighbour messages "
        "are 1.33x a ring all-reduce's traffic here, the same at any world size). Consensus distance: sqrt(mean_i "
        "||x_i - mean x||^2) at the end. CRAIG: "
        f"{args['craig_fraction']:.0%} of a 2,000-example pool selected on the logit-gradient proxies of the "
        f"base model, {args['craig_steps']} steps of batch {args['batch_size']} with the weights as per-example "
        "loss weights; random subsets with uniform weights, three draws."
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    for ax, straggle in zip(axes, (False, True)):
        for r in rows:
            if r["straggler"] == straggle:
                ax.plot(r["times"], r["smoothed"], label=r["method"])
        ax.axhline(target, color="gray", lw=0.8, ls="--")
        ax.set_xlabel("wall time (s)")
        ax.set_title("one rank 3x slower" if straggle else "no straggler")
        ax.legend(fontsize=8)
    axes[0].set_ylabel(f"training loss (mean over ranks, last {SMOOTH} steps)")
    fig.suptitle("Decentralized and straggler-tolerant training, 4 ranks (dashed: target loss)")
    return table, fig, notes


if __name__ == "__main__":
    main()
