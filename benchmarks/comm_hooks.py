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
from _report import emit_result, parse_result

METHODS = ["allreduce", "fp16", "powersgd", "acp_sgd", "dear", "diloco_h8", "diloco_h32", "diloco_h8_1bit"]
OURS = ("allreduce", "acp_sgd", "s2_reducer", "dear", "embrace", "embrace_sharded")
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


# DiLoCo variants: (inner steps per sync H, outer exchange)
DILOCO = {
    "diloco_h8": (8, "none"),
    "diloco_h32": (32, "none"),
    "diloco_h8_1bit": (8, "1bit"),
    "diloco_h32_int8": (32, "int8"),
    "diloco_h32_1bit": (32, "1bit"),
    "diloco_h16_int8": (16, "int8"),
}
LOW_COMM = ("powersgd", "acp_sgd", "onebit_lamb", *DILOCO)
ONEBIT_LR = 2e-3  # cheap per step: they run LONGER x the steps, to reach the target


# the embedding-heavy model: the default tiny LLaMA's layers at hidden 128 with a 16,384-row vocabulary (untied): the
# input table is 43% of the 4.9M parameters and the batches touch a few dozen of its rows
HEAVY = dict(vocab_size=16384, hidden_size=128, intermediate_size=256)
MODEL = "tiny"  # --model
EVAL_EVERY = 5  # steps between held-out evaluations (outside the timed steps)
BUCKET_MB = 25.0  # --bucket-cap-mb


def worker(
    rank: int, world: int, addr: str, port: str, method: str, steps: int, batch: int, lr: float, seed: int = 0
) -> dict:
    from hf_dtrain.testing import gloo_group

    with gloo_group(rank, world, addr, port, timeout_s=300):  # DDP lives in _train only: freed before the group
        return _train(rank, world, method, steps, batch, lr, seed)


def _hook_config(method: str) -> dict:
    """``embrace_sharded`` is EmbRace with the paper's sharded tables; the rest by name."""
    if method == "embrace_sharded":
        return {"method": "embrace", "exchange": "sharded"}
    return {"method": method, "rank": RANK, "start_iter": START}


def _train(rank: int, world: int, method: str, steps: int, batch: int, lr: float, seed: int = 0) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    import hf_dtrain.comm as comm
    from hf_dtrain import tasks
    from hf_dtrain.models import load_model_and_tokenizer

    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(None, progress=False)
    if MODEL == "embedding_heavy":
        from hf_dtrain.models import build_llama

        model = build_llama("tiny", seed=0, **HEAVY)  # fresh weights; the default model's tokenizer
    if method == "embrace":
        comm.exclude_embeddings(model)  # before DDP wraps the model
    elif method == "embrace_sharded":
        comm.shard_embeddings(model)
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    opt = torch.optim.AdamW(ddp.parameters(), lr=lr)
    state = None
    if method == "onebit_lamb":  # its own learning rate (the optimizers benchmark's), LAMB warm-up 15% of the steps
        from hf_dtrain.optim import OneBitLamb

        OneBitLamb.attach_ddp(ddp)
        opt = state = OneBitLamb(ddp.parameters(), lr=ONEBIT_LR, freeze_step=max(1, int(0.15 * steps)))
    elif method in DILOCO:
        from hf_dtrain.decentralized import DiLoCo

        h, exchange = DILOCO[method]
        DiLoCo.attach_ddp(ddp)
        opt = state = DiLoCo(ddp.parameters(), sync_every=h, outer_exchange=exchange, lr=lr)
    elif method in OURS:
        state = comm.register(ddp, _hook_config(method), optimizer=opt)
    elif method == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        ddp.register_comm_hook(None, fp16_compress_hook)
    elif method == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

        ddp.register_comm_hook(
            PowerSGDState(
                None,
                matrix_approximation_rank=RANK,
                start_powerSGD_iter=START,
                min_compression_rate=2,
                use_error_feedback=True,
                warm_start=True,
            ),
            powerSGD_hook,
        )
    data = tasks.make_task_dataset(tok, steps * batch, seed=100 + rank + 1000 * seed, split="train")
    loader = DataLoader(data, batch_size=batch, collate_fn=tasks.task_collator(tok))
    held_out = tasks.task_collator(tok)(list(tasks.make_task_dataset(tok, 64, seed=7, split="eval")))

    @torch.no_grad()
    def evaluate() -> float:
        """Held-out loss of the model the ranks hold together (outside the timed steps, not counted): the average
        of the ranks' weights where they differ (DiLoCo between syncs), else the model itself."""
        from torch.nn.utils import parameters_to_vector, vector_to_parameters

        if method not in DILOCO:
            return model(**held_out).loss.item()
        own = parameters_to_vector(model.parameters()).clone()
        mean = own.clone()
        dist.all_reduce(mean)
        vector_to_parameters(mean / world, model.parameters())
        value = model(**held_out).loss.item()
        vector_to_parameters(own, model.parameters())
        return value

    times, losses, evals = [], [], []
    dist.barrier()
    for i, b in enumerate(loader):
        t0 = time.perf_counter()
        loss = ddp(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        # DeAR's update of this step is applied in the next forward: an evaluation here would move it out of the
        # timed steps; its weights equal the all-reduce run's (tested), so it is not evaluated
        if method != "dear" and ((i + 1) % EVAL_EVERY == 0 or i + 1 == steps):
            evals.append((i + 1, evaluate()))
    if method == "dear":
        state.flush()  # the last update is deferred to a next forward that does not come
    if method == "embrace_sharded":
        comm.unshard_embeddings(model)  # the full tables, for the replicas check
    dense = sum(p.numel() * 4 for p in model.parameters())
    emb_share = model.get_input_embeddings().weight.numel() * 4 / dense
    if state is not None:
        per_step = list(state.stats.steps)
    else:  # torch's hooks: dense until their start iteration (PowerSGD), then their compression rule
        per_step = [
            dense if method == "powersgd" and i < START else torch_hook_bytes(method, model) for i in range(len(times))
        ]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    mean_loss = torch.tensor(losses)
    dist.all_reduce(mean_loss)  # the training loss averaged over the ranks, every step
    return {
        "method": method,
        "seed": seed,
        "bytes_per_step": per_step[-1],
        "bytes_steps": per_step,
        "dense_bytes": dense,
        "embedding_share": emb_share,
        "step_times": times,
        "evals": evals,
        "losses": (mean_loss / world).tolist(),
        "step_time_median_s": statistics.median(times[len(times) // 2 :]),
        "loss_last10": statistics.mean(losses[-10:]),
        "replicas_identical": all(torch.equal(gathered[0], g) for g in gathered),
    }


def run_config(link: str, method: str, steps: int, batch: int, world: int, extra: list[str]) -> tuple[dict, str]:
    import os

    from hf_dtrain.testing import free_port
    from hf_dtrain.testing.netns import available, emulated_hosts, run_on_hosts, run_ranks

    port = str(free_port())

    def argv(rank, hosts):
        addr = hosts[0].address if hosts else "127.0.0.1"
        return [
            sys.executable,
            __file__,
            "--worker",
            f"{rank}:{world}:{addr}:{port}:{method}",
            "--steps",
            str(steps),
            "--batch-size",
            str(batch),
        ] + extra

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
    global RANK, START, MODEL, BUCKET_MB
    from _report import rerender, training_parser

    ap = training_parser(__doc__, {})
    ap.add_argument("--links", default="100mbit,1gbit")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--name", default="comm_hooks", help="results file name under benchmarks/results/")
    ap.add_argument("--rank", type=int, default=RANK, help="rank of PowerSGD's and ACP-SGD's factors")
    ap.add_argument("--start-iter", type=int, default=START, help="dense warm-up steps of the compressing hooks")
    ap.add_argument("--learning-rate", type=float, default=5e-4, help="AdamW learning rate (every method)")
    ap.add_argument(
        "--longer",
        type=float,
        default=2.0,
        help="the low-communication methods run this many times --steps (to reach the target)",
    )
    ap.add_argument(
        "--tolerance", type=float, default=0.01, help="target: all-reduce's final smoothed loss x (1 + this)"
    )
    ap.add_argument(
        "--model",
        default="tiny",
        choices=["tiny", "embedding_heavy"],
        help="tiny: the embedded default; embedding_heavy: a 16,384-row untied vocabulary at hidden 128",
    )
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket size (every method)")
    ap.add_argument(
        "--loss-basis",
        choices=["held_out", "training"],
        default=None,
        help="what the target is measured on: held_out (default; evaluations every 5 steps where a run "
        "has them) or training (the rank-mean training loss of every run: for exact methods)",
    )
    ap.set_defaults(steps=40)
    args = ap.parse_args()
    RANK, START, MODEL, BUCKET_MB = args.rank, args.start_iter, args.model, args.bucket_cap_mb
    if "allreduce" not in args.methods.split(","):
        ap.error("--methods must include allreduce: every ratio is taken against it")
    if args.from_json:
        rerender(
            args.from_json,
            args.name,
            lambda p: render(dict(p, loss_basis=args.loss_basis or p.get("loss_basis", "held_out"))),
        )
        return
    if args.worker:
        rank, world, addr, port, method = args.worker.split(":")
        emit_result(
            worker(
                int(rank), int(world), addr, port, method, args.steps, args.batch_size, args.learning_rate, args.seed
            )
        )
        return
    from tqdm import tqdm

    from hf_dtrain.models import build_default_model

    build_default_model("tiny", progress=True)
    runs, failures = [], []
    methods = args.methods.split(",")
    seeds = [int(x) for x in args.seeds.split(",")]
    for link, seed, method in tqdm(
        [(l, s, m) for l in args.links.split(",") for s in seeds for m in methods], desc="link x seed x method"
    ):
        steps = int(args.steps * args.longer) if method in LOW_COMM else args.steps
        extra = [
            "--rank",
            str(args.rank),
            "--start-iter",
            str(args.start_iter),
            "--learning-rate",
            str(args.learning_rate),
            "--seed",
            str(seed),
            "--model",
            args.model,
            "--bucket-cap-mb",
            str(args.bucket_cap_mb),
        ]
        try:
            result, where = run_config(link, method, steps, args.batch_size, args.world, extra)
        except (RuntimeError, TimeoutError) as e:  # recorded and reported; the other runs go on
            print(f"{link} seed {seed} {method} failed: {e}", file=sys.stderr, flush=True)
            failures.append({"link": link, "seed": seed, "method": method, "error": str(e)[-3000:]})
            continue
        runs.append(dict(result, link=link, network=where))
    payload = {
        "runs": runs,
        "failures": failures,
        "args": vars(args),
        "rank": args.rank,
        "start_iter": args.start_iter,
        "loss_basis": args.loss_basis or "held_out",
    }
    from _report import write

    table, fig, notes = render(payload)
    paths = write(args.name, payload, table, fig, notes)
    print(table)
    print("\n".join(str(p) for p in paths.values()))


def to_target(run: dict, target: float, window: int = 10):
    """(step, seconds, bytes) at which ``run`` first reaches ``target``: its held-out loss where it was evaluated,
    else (DeAR, whose weights are the all-reduce run's) its smoothed rank-mean training loss; None if never."""
    from _report import trailing_mean

    if run.get("evals"):
        for step, value in run["evals"]:
            if value <= target:
                return step, sum(run["step_times"][:step]), sum(run["bytes_steps"][:step])
        return None
    smoothed = trailing_mean(run["losses"], window)
    for i, x in enumerate(smoothed):
        if i + 1 >= window and x <= target:
            return i + 1, sum(run["step_times"][: i + 1]), sum(run["bytes_steps"][: i + 1])
    return None


def final_loss(run: dict, window: int = 10) -> float:
    """The run's last held-out loss (its smoothed training loss where it was not evaluated)."""
    from _report import trailing_mean

    return run["evals"][-1][1] if run.get("evals") else trailing_mean(run["losses"], window)[-1]


def summarize(payload: dict) -> list[dict]:
    """One row per (link, method): per-seed time and bytes to all-reduce's final loss (same link, same seed), as
    ratios to all-reduce's, with the seeds' range."""
    import statistics

    from _report import trailing_mean

    runs, args = payload["runs"], payload["args"]
    if payload.get("loss_basis") == "training":  # every run on its training loss (exact methods: the same curve)
        runs = [dict(r, evals=None) for r in runs]
    tol = args.get("tolerance", 0.01)
    rows = []
    for link in dict.fromkeys(r["link"] for r in runs):
        for method in dict.fromkeys(r["method"] for r in runs):
            per_seed = []
            for run in (r for r in runs if r["link"] == link and r["method"] == method):
                ref = next(
                    (r for r in runs if r["link"] == link and r["method"] == "allreduce" and r["seed"] == run["seed"]),
                    None,
                )
                if ref is None:  # its all-reduce run failed: no reference for this seed
                    continue
                # the target: the all-reduce run's final loss, held-out where both were evaluated
                target = (
                    final_loss(ref)
                    if run.get("evals") or not ref.get("evals")
                    else trailing_mean(ref["losses"], 10)[-1]
                ) * (1 + tol)
                if run.get("evals") or not ref.get("evals"):
                    got, base = to_target(run, target), to_target(ref, target)
                else:  # DeAR (training loss) against all-reduce's training loss
                    got, base = to_target(run, target), to_target(dict(ref, evals=None), target)
                per_seed.append(
                    {
                        "seed": run["seed"],
                        "target": target,
                        "step_time_vs_dense": statistics.median(run["step_times"][len(run["step_times"]) // 2 :])
                        / statistics.median(ref["step_times"][len(ref["step_times"]) // 2 :]),
                        "bytes_vs_dense": (sum(run["bytes_steps"]) / len(run["bytes_steps"]))
                        / (sum(ref["bytes_steps"]) / len(ref["bytes_steps"])),
                        "time_vs_dense": got[1] / base[1] if got else None,
                        "bytes_to_target_vs_dense": got[2] / base[2] if got else None,
                        "seconds_to_target": got[1] if got else None,
                        "steps_to_target": got[0] if got else None,
                        "final": final_loss(run),
                        "final_basis": "held-out" if run.get("evals") else "training",
                        "identical": run["replicas_identical"],
                    }
                )
            if not per_seed:
                continue

            def agg(key):
                vals = [p[key] for p in per_seed if p[key] is not None]
                if len(vals) < len(per_seed):
                    return None, None, None
                return statistics.median(vals), min(vals), max(vals)

            row = {
                "link": link,
                "method": method,
                "seeds": len(per_seed),
                "per_seed": per_seed,
                "reached": sum(p["time_vs_dense"] is not None for p in per_seed),
                "replicas_identical": all(p["identical"] for p in per_seed),
                "final_basis": per_seed[0]["final_basis"],
            }
            for key in (
                "step_time_vs_dense",
                "bytes_vs_dense",
                "time_vs_dense",
                "bytes_to_target_vs_dense",
                "seconds_to_target",
                "final",
            ):
                row[key], row[key + "_min"], row[key + "_max"] = agg(key)
            rows.append(row)
    return rows


def _fmt(row, key, spec):
    v = row.get(key)
    if v is None:
        return (
            f"not reached ({row['reached']}/{row['seeds']} seeds)"
            if key.endswith("_vs_dense") or key == "seconds_to_target"
            else "n/a"
        )
    lo, hi = row.get(key + "_min"), row.get(key + "_max")
    if lo is None or row["seeds"] == 1 or lo == hi:
        return format(v, spec)
    return f"{v:{spec}} ({lo:{spec}}-{hi:{spec}})"


def final_mark(row: dict, mixed: bool) -> str:
    """`` (training)`` on a final loss that is a training loss in a table whose other final losses are held-out
    (``mixed``: a run that was not evaluated), so the column never compares the two bases unmarked."""
    return " (training)" if mixed and row.get("final_basis") == "training" else ""


def render(payload: dict):
    rows = summarize(payload)
    args = payload["args"]
    lines = [
        "| link | method | bytes per step / dense | median step / dense | seconds to target | time to target / "
        "dense | bytes to target / dense | final loss | replicas identical |",
        "|" + "---|" * 9,
    ]
    mixed = len({r.get("final_basis", "held-out") for r in rows}) > 1
    for r in rows:
        lines.append(
            f"| {r['link']} | {r['method']} | {_fmt(r, 'bytes_vs_dense', '.4f')} | "
            f"{_fmt(r, 'step_time_vs_dense', '.2f')} | {_fmt(r, 'seconds_to_target', '.1f')} | "
            f"{_fmt(r, 'time_vs_dense', '.2f')} | {_fmt(r, 'bytes_to_target_vs_dense', '.4f')} | "
            f"{_fmt(r, 'final', '.3f')}{final_mark(r, mixed)} | {r['replicas_identical']} |"
        )
    for f in payload.get("failures", []):
        lines.append(
            f"| {f['link']} | {f['method']} (seed {f['seed']}) | failed: "
            f"{f['error'].strip().splitlines()[-1][:160]} |" + " |" * 6
        )
    table = "\n".join(lines)
    where = sorted({r["network"] for r in payload["runs"]})
    model = (
        "the embedded default model (tiny LLaMA, 3.1M parameters; the input embedding is 8% of them)"
        if args.get("model", "tiny") == "tiny"
        else "an embedding-heavy LLaMA (the tiny one at hidden 128 with a 16,384-row untied vocabulary, fresh "
        "weights: 4.9M parameters, the input embedding 43% of them; the batches touch a few dozen rows)"
    )
    notes = (
        f"Full fine-tuning of {model}, DDP buckets of {args.get('bucket_cap_mb', 25.0):g} MB, {args['world']} ranks "
        f"(one per emulated host), AdamW (lr {args['learning_rate']}) with batch {args['batch_size']} per rank on the "
        f"addition task, gloo; seeds {args['seeds']} (data order); median over seeds, (min-max) in brackets. Network: "
        f"{'; '.join(where)}. Dense-bytes methods run {args['steps']} steps; the low-communication ones (PowerSGD, "
        f"ACP-SGD, DiLoCo) {int(args['steps'] * args.get('longer', 2))}. Loss: held-out loss (64 eval examples) every "
        f"{EVAL_EVERY} steps, outside the timed steps and the byte counts, of the model the ranks hold together "
        "(DiLoCo between syncs: the average of the ranks' weights); DeAR is not evaluated (its weights are the "
        "all-reduce run's, tested; the evaluation would move its deferred update out of the timed steps) and is "
        "compared on the rank-mean training loss (trailing mean of 10); its final loss is marked (training). "
        "Target: the all-reduce run's final loss x "
        f"{1 + args.get('tolerance', 0.01):.2f}, same link and seed; time and bytes to target are cumulative up to the "
        "first evaluation (step) that reaches it, as ratios to all-reduce's own. Bytes: what each rank hands to "
        "collectives (ours counted by hf_dtrain.distributed.WireStats; torch's fp16 and PowerSGD by their compression "
        f"rules), mean per step. PowerSGD / ACP-SGD: rank {payload['rank']}, {payload['start_iter']} dense warm-up "
        "steps. DeAR: per-layer fusion groups of 1 MB. DiLoCo: H inner AdamW steps, outer SGD lr 0.7 Nesterov 0.9 "
        "(the paper's), fp32 all-reduce of the pseudo-gradient (baseline), or hf_dtrain's int8 (a scale per 2048 "
        "values) or 1-bit (1-bit LAMB's exchange) outer exchange, both with error feedback."
        + (
            " This table: every run on its rank-mean training loss (trailing mean of 10), the target the "
            "all-reduce run's final training loss."
            if payload.get("loss_basis") == "training"
            else ""
        )
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(r["link"] for r in rows))
    fig, axes = plt.subplots(1, len(links), figsize=(7 * len(links), 4.5), squeeze=False)
    for ax, link in zip(axes[0], links):
        for run in (r for r in payload["runs"] if r["link"] == link and r["seed"] == payload["runs"][0]["seed"]):
            import itertools

            t = list(itertools.accumulate(run["step_times"]))
            from _report import trailing_mean

            if run.get("evals"):
                ax.plot(
                    [t[s - 1] for s, _ in run["evals"]], [v for _, v in run["evals"]], marker=".", label=run["method"]
                )
            else:
                ax.plot(t, trailing_mean(run["losses"], 10), ls="--", label=run["method"] + " (training loss)")
        ax.set_xscale("log")
        ax.set_xlabel("wall time (s, log)")
        ax.set_ylabel("held-out loss")
        ax.set_title(f"{link}, seed {payload['runs'][0]['seed']}")
        ax.legend(fontsize=7)
    fig.suptitle("Gradient communication on emulated hosts (network namespaces + tc tbf): loss against wall time")
    return table, fig, notes


if __name__ == "__main__":
    main()
