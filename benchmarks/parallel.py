"""Every legal parallelism plan of the tiny and small presets on 4 CPU ranks (gloo), measured, beside the planner's
prediction from a machine profile measured in the same run; and the Optimus-style 2D tensor parallelism rows
(activation bytes per rank and bytes on the wire per step against 1D TP and TP+SP at the same world size).

    python benchmarks/parallel.py            # ~20 minutes on 2 cores
    python benchmarks/parallel.py --from-json benchmarks/results/parallel.json   # re-render only

For each plan (pp, dp_replicate, dp_shard, tp, micro-batches; schedule 1F1B or Interleaved1F1B): the step time (the
slowest rank's) in 3 interleaved rounds (every plan once a round, the plans in a new order each round, 1 warm-up and
3 timed steps a visit), the plan's time the median of all its timed steps, each round's median beside it (the spread
of one plan's repeated measurement on this host); and per rank the bytes of parameters + gradients + AdamW state it
holds plus the peak of the activation bytes autograd keeps alive (saved tensors, counted by storage while they
live). Reported: Spearman's rank correlation of predicted vs measured step time per preset, and how far the
planner's first choice is from the measured best, over all rounds and in each round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time
import weakref

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

WORLD, SEQ, GLOBAL_BATCH = 4, 128, 8
PRESETS = ("tiny", "small")
WARMUP, TIMED = 1, 3  # per plan and round
ROUNDS = 3  # every plan measured once a round, the plans in a new order each round (the same order on every rank)


class LiveSavedBytes:
    """Peak bytes of the tensors autograd saves for backward while they are alive (unique storages)."""

    def __init__(self, exclude=()):
        from torch.distributed.tensor import DTensor

        self.exclude = {(t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr() for t in exclude}
        self.count: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.live = self.peak = 0

    def _release(self, ptr):
        self.count[ptr] -= 1
        if self.count[ptr] == 0:
            self.live -= self.size.pop(ptr)
            del self.count[ptr]

    def pack(self, t):
        from torch.distributed.tensor import DTensor

        local = t._local_tensor if isinstance(t, DTensor) else t
        try:
            st = local.untyped_storage()
            ptr = st.data_ptr()
        except (RuntimeError, NotImplementedError):  # meta / fake tensors (the pipeline's shape inference)
            return t
        if ptr not in self.exclude and st.nbytes():
            if ptr not in self.count:
                self.count[ptr], self.size[ptr] = 0, st.nbytes()
                self.live += st.nbytes()
                self.peak = max(self.peak, self.live)
            self.count[ptr] += 1
            weakref.finalize(t, self._release, ptr)
        return t

    @staticmethod
    def unpack(t):
        return t


def _local_bytes(tensors):
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def _slowest(t0: float) -> float:
    """This step's wall time on the slowest rank (the step waits for it)."""
    import torch.distributed as dist

    elapsed = torch.tensor(time.perf_counter() - t0)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _per_rank(values: list[float], world: int) -> list[list[float]]:
    """``values`` of every rank (all-gathered), as rows."""
    import torch.distributed as dist

    mine = torch.tensor(values, dtype=torch.float64)
    rows = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine)
    return [r.tolist() for r in rows]


def _plan_rank(rank, world, preset, plans, out, round_=0, warmup=WARMUP, timed=TIMED):
    """One round: every plan once, in this round's order (the same on every rank); the memory in round 0."""
    import torch.distributed as dist

    from hf_dtrain.estimate import trace_step
    from hf_dtrain.models import build_llama
    from hf_dtrain.parallel import PipelineConfig
    from hf_dtrain.parallel.mesh import apply_parallelism, build_mesh, data_parallel, laid_out_step
    from hf_dtrain.parallel.planner import measure_profile

    results = {"plans": {key: {"round_times": []} for key in plans}}
    if preset == PRESETS[0] and round_ == 0:
        results["profile"] = json.loads(measure_profile(PRESETS, name="this machine, 4 gloo ranks").to_json())
    vocab = build_llama(preset).config.vocab_size
    order = list(plans)  # interleaved: the host's drift over the run falls on every plan alike
    random.Random(round_).shuffle(order)
    meshes = {}  # one mesh per layout, kept (a new one each visit made new gloo groups)
    for key in order:
        plan = plans[key]
        degrees = {k: plan[k] for k in ("pp", "dp_replicate", "dp_shard", "tp")}
        layout = tuple(degrees.values())
        if layout not in meshes:
            meshes[layout] = build_mesh(degrees, "cpu")
        mesh = meshes[layout]
        dp_rank, dp_size = data_parallel(mesh)
        per_replica = GLOBAL_BATCH // dp_size
        model = build_llama(preset, seed=0)
        pipeline = (
            PipelineConfig(
                schedule=plan["schedule"], stages_per_rank=plan["stages_per_rank"], microbatches=plan["microbatches"]
            )
            if plan["pp"] > 1
            else None
        )
        pipe, trained = apply_parallelism(model, mesh, batch_size=per_replica, seq_len=SEQ, pipeline=pipeline)
        opt = torch.optim.AdamW(trained.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(dp_rank)
        counter = LiveSavedBytes(exclude=list(trained.parameters()))
        times = []
        for step in range(warmup + timed):
            ids = torch.randint(0, vocab, (per_replica, SEQ), generator=g)
            dist.barrier()
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                loss = laid_out_step(pipe, trained, ids, contextlib.nullcontext())
            opt.step()
            opt.zero_grad()
            elapsed = _slowest(t0)
            if step >= warmup:
                times.append(elapsed)
        got = results["plans"][key]
        got["round_times"].append(times)
        if round_ > 0:  # the memory once, in the first round
            del model, trained, pipe, opt
            continue
        state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        params = list(trained.parameters())
        saved_peak = counter.peak

        def step_untimed(pipe=pipe, trained=trained, opt=opt, ids=ids):
            laid_out_step(pipe, trained, ids, contextlib.nullcontext())
            opt.step()
            opt.zero_grad(set_to_none=True)

        # after the timed steps, two more under torch's MemTracker: the peak of live tensor storage, which the
        # planner's traced memory is checked against
        peak = trace_step(trained, opt, step_untimed, steps=2, flops=False).peak
        per_rank = _per_rank([_local_bytes(params) * 2 + _local_bytes(state), saved_peak, peak], world)
        got.update(
            {
                "loss": float(loss.detach()),
                "state_bytes": [float(x[0]) for x in per_rank],
                "activation_bytes": [float(x[1]) for x in per_rank],
                "peak_bytes": [float(x[2]) for x in per_rank],
                "layer_cut": pipe.bounds if pipe is not None else None,
            }
        )
        del model, trained, pipe, opt, step_untimed
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


class WireBytes:
    """Bytes each rank sends in the functional collectives DTensor issues (ring algorithms: all-gather (n - 1) x
    its shard, reduce-scatter and all-reduce (n - 1) / n and 2 (n - 1) / n x the tensor), by op."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.record(func, args)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.by_op: dict[str, float] = {}

    def record(self, func, args):
        from torch.distributed.distributed_c10d import _resolve_process_group

        name = getattr(func, "__name__", str(func)).split(".")[0]
        if name not in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"):
            return
        if "_c10d_functional" not in str(getattr(func, "namespace", "")) and "c10d_functional" not in str(func):
            return
        t = args[0]
        n = _resolve_process_group(args[-1]).size()
        nbytes = t.numel() * t.element_size()
        sent = {
            "all_gather_into_tensor": (n - 1) * nbytes,
            "reduce_scatter_tensor": (n - 1) / n * nbytes,
            "all_reduce": 2 * (n - 1) / n * nbytes,
        }[name]
        self.by_op[name] = self.by_op.get(name, 0.0) + sent

    @property
    def total(self) -> float:
        return sum(self.by_op.values())


LAYOUTS = ("tp_1d", "tp_sp", "optimus_2d")


def _optimus_rank(rank, world, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hf_dtrain.models import build_llama
    from hf_dtrain.parallel import TensorParallelConfig, apply_tensor_parallel
    from hf_dtrain.parallel.optimus import apply_2d_tensor_parallel, optimus_loss_scale
    from hf_dtrain.parallel.tensor import tensor_parallel_loss

    results = {}
    preset = PRESETS[0]
    for name in LAYOUTS:
        model = build_llama(preset, seed=0)
        vocab = model.config.vocab_size
        if name == "optimus_2d":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("row", "col"))
            apply_2d_tensor_parallel(model, mesh)
            row = mesh["row"].get_local_rank()
            part = slice(row * GLOBAL_BATCH // 2, (row + 1) * GLOBAL_BATCH // 2)
            scale = optimus_loss_scale(model)
        else:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
            apply_tensor_parallel(model, mesh, TensorParallelConfig(sequence_parallel=name == "tp_sp"))
            part, scale = slice(None), 1.0
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(0)
        times = []
        for step in range(WARMUP + TIMED):
            ids = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=g)[part]
            counter, wire = LiveSavedBytes(exclude=list(model.parameters())), WireBytes()
            dist.barrier()
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack), wire.mode:
                with tensor_parallel_loss(model):
                    loss = model(input_ids=ids, labels=ids).loss
                    (loss * scale).backward()
            opt.step()
            opt.zero_grad()
            elapsed = _slowest(t0)
            if step >= WARMUP:
                times.append(elapsed)
        gathered = _per_rank([counter.peak, wire.total], world)
        results[name] = {
            "step_time": sorted(times)[len(times) // 2],
            "activation_bytes": [float(x[0]) for x in gathered],
            "wire_bytes": [float(x[1]) for x in gathered],
            "wire_by_op_rank0": wire.by_op,
        }
        del model, opt
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def measure_optimus(out_dir: str) -> dict:
    from hf_dtrain.testing import run_distributed

    out = os.path.join(out_dir, "optimus.json")
    run_distributed(_optimus_rank, WORLD, args=(out,), timeout=1200, pg_timeout_s=600)
    return json.load(open(out))


def measure(preset: str, out_dir: str, rounds: int = ROUNDS, warmup: int = WARMUP, timed: int = TIMED) -> dict:
    from hf_dtrain.models import llama_config
    from hf_dtrain.parallel.planner import legal_plans
    from hf_dtrain.testing import run_distributed

    plans = {
        p.key: {
            "pp": p.pp,
            "dp_replicate": p.dp_replicate,
            "dp_shard": p.dp_shard,
            "tp": p.tp,
            "microbatches": p.microbatches,
            "schedule": p.schedule,
            "stages_per_rank": p.stages_per_rank,
        }
        for p in legal_plans(llama_config(preset), WORLD, GLOBAL_BATCH, activations=("none",))
    }
    t0 = time.perf_counter()
    data = None
    for round_ in range(rounds):  # each round in fresh processes: the ranks' heaps grew with every plan visited
        out = os.path.join(out_dir, f"{preset}_{round_}.json")
        run_distributed(
            _plan_rank, WORLD, args=(preset, plans, out, round_, warmup, timed), timeout=3000, pg_timeout_s=600
        )
        got = json.load(open(out))
        if data is None:
            data = got
        else:
            for key, plan in got["plans"].items():
                data["plans"][key]["round_times"] += plan["round_times"]
        print(f"{preset}: round {round_ + 1} of {rounds}, {time.perf_counter() - t0:.0f} s", flush=True)
    for plan in data["plans"].values():  # the median of every timed step of every round
        every = sorted(t for r in plan["round_times"] for t in r)
        plan["step_time"] = every[len(every) // 2]
    print(f"{preset}: {len(plans)} plans measured in {time.perf_counter() - t0:.0f} s", flush=True)
    data["plan_settings"] = plans
    return data


def _worst(rows: list, key: str) -> float | None:
    """The ratio farthest from 1 (None without rows)."""
    return max((r[key] for r in rows), key=lambda x: abs(x - 1), default=None)


def choice_of(rows: list) -> dict:
    """The planner's first choice among the measured plans: the least predicted step time."""
    return min(rows, key=lambda r: r["predicted_s"])


def analyse(measured: dict) -> dict:
    from scipy.stats import spearmanr

    from hf_dtrain.models import llama_config
    from hf_dtrain.parallel.planner import MachineProfile, Plan, predict, traced_memory

    profile = MachineProfile(**measured[PRESETS[0]]["profile"])
    summary = {}
    for preset in [p for p in PRESETS if p in measured]:
        rows = []
        config = llama_config(preset)
        for key, settings in measured[preset]["plan_settings"].items():
            plan = predict(Plan(**settings, activation="none"), config, profile, GLOBAL_BATCH, SEQ)
            arithmetic = sum(plan.memory.values())
            got = measured[preset]["plans"][key]
            row = {
                "plan": key,
                "predicted_s": plan.step_time,
                "measured_s": got["step_time"],
                "predicted_mem_mib": arithmetic / 2**20,
                "measured_mem_mib": max(a + b for a, b in zip(got["state_bytes"], got["activation_bytes"])) / 2**20,
                "bubble": plan.breakdown["bubble_fraction"],
            }
            rounds = [statistics.median(t) for t in got.get("round_times", [])]
            if len(rounds) > 1:  # the plan's median in each round, and their spread
                row["round_s"] = rounds
                row["spread"] = (max(rounds) - min(rounds)) / statistics.median(rounds)
            if "peak_bytes" in got:  # runs before the planner traced its memory measured no peak
                traced = got.get("traced_bytes")
                if traced is None:  # the planner's traced memory (fake tensors; rank 0, and the last stage's rank)
                    traced = sum(traced_memory(plan, config, WORLD, GLOBAL_BATCH, SEQ).values())
                    got["traced_bytes"] = traced
                row.update(
                    measured_peak_mib=max(got["peak_bytes"]) / 2**20,
                    traced_mib=traced / 2**20,
                    traced_ratio=traced / max(got["peak_bytes"]),
                    arithmetic_ratio=arithmetic / max(got["peak_bytes"]),
                )
            rows.append(row)
        rho = spearmanr([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]).statistic

        def ranked(memory_mib: str) -> float:
            """Spearman of the planner's order (plans that fit the profile's device first, then by predicted time)
            against the measured step times, with this memory column deciding what fits."""
            fits = [r[memory_mib] * 2**20 <= profile.device_memory for r in rows]
            order = sorted(range(len(rows)), key=lambda i: (not fits[i], rows[i]["predicted_s"]))
            position = {i: k for k, i in enumerate(order)}
            return spearmanr([position[i] for i in range(len(rows))], [r["measured_s"] for r in rows]).statistic

        by_trace = ranked("traced_mib") if all("traced_mib" in r for r in rows) else None
        by_arithmetic = ranked("predicted_mem_mib")
        choice = choice_of(rows)
        best = min(rows, key=lambda r: r["measured_s"])
        traced = [r for r in rows if "traced_ratio" in r]
        per_round = []
        for k in range(min((len(r.get("round_s", [])) for r in rows), default=0)):
            best_k = min(r["round_s"][k] for r in rows)
            per_round.append(
                {
                    "spearman": spearmanr([r["predicted_s"] for r in rows], [r["round_s"][k] for r in rows]).statistic,
                    "first_choice_vs_best": choice_of(rows)["round_s"][k] / best_k,
                    "measured_best": min(rows, key=lambda r: r["round_s"][k])["plan"],
                }
            )
        summary[preset] = {
            "rounds": per_round,
            "spread_median": statistics.median(r["spread"] for r in rows) if per_round else None,
            "spread_max": max(r["spread"] for r in rows) if per_round else None,
            "spearman": rho,
            "spearman_ranked_traced": by_trace,
            "spearman_ranked_arithmetic": by_arithmetic,
            "worst_traced_ratio": _worst(traced, "traced_ratio"),
            "worst_arithmetic_ratio": _worst(traced, "arithmetic_ratio"),
            "first_choice": choice["plan"],
            "measured_best": best["plan"],
            "first_choice_vs_best": choice["measured_s"] / best["measured_s"],
            "rows": rows,
        }
    return summary


def render(payload: dict, name: str = "parallel"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from _report import markdown_table, write

    summary = payload["summary"]
    presets = list(summary)
    fig, axes = plt.subplots(1, len(presets), figsize=(6 * len(presets), 5), squeeze=False)
    tables, notes = [], []
    for ax, preset in zip(axes[0], presets):
        s = summary[preset]
        xs = [r["predicted_s"] for r in s["rows"]]
        ys = [r["measured_s"] for r in s["rows"]]
        ax.scatter(xs, ys)
        for r in s["rows"]:
            ax.annotate(r["plan"], (r["predicted_s"], r["measured_s"]), fontsize=6)
        lim = [min(xs + ys) * 0.9, max(xs + ys) * 1.1]
        ax.plot(lim, lim, "k--", lw=0.5)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("predicted step time (s)")
        ax.set_ylabel("measured step time (s)")
        ax.set_title(f"{preset}: Spearman {s['spearman']:.2f}; first choice {s['first_choice_vs_best']:.2f}x best")
        rows = sorted(s["rows"], key=lambda r: r["measured_s"])
        tables.append(
            f"### {preset}\n\n"
            + markdown_table(
                rows,
                [
                    ("plan", "plan", ""),
                    ("measured_s", "measured step (s)", ".4f"),
                    ("spread", "spread over rounds", ".0%"),
                    ("predicted_s", "predicted step (s)", ".4f"),
                    ("bubble", "bubble", ".0%"),
                    ("measured_mem_mib", "measured state+activations / rank (MiB, max rank)", ".1f"),
                    ("measured_peak_mib", "measured peak / rank (MiB, max rank)", ".1f"),
                    ("traced_mib", "traced / rank (MiB, planner)", ".1f"),
                    ("traced_ratio", "traced / measured peak", ".3f"),
                    ("predicted_mem_mib", "arithmetic / rank (MiB)", ".1f"),
                    ("arithmetic_ratio", "arithmetic / measured peak", ".3f"),
                ],
            )
        )
        notes.append(
            f"- {preset}: Spearman rank correlation {s['spearman']:.3f} (goal >= 0.9); the planner's "
            f"first choice {s['first_choice']} measures {s['first_choice_vs_best']:.3f}x the measured "
            f"best {s['measured_best']} (goal <= 1.10)."
            + (
                f" In each of the {len(s['rounds'])} interleaved rounds (every plan once a round, in a new order, "
                f"its median step): Spearman "
                + ", ".join(f"{r['spearman']:.3f}" for r in s["rounds"])
                + "; first choice "
                + ", ".join(f"{r['first_choice_vs_best']:.3f}x" for r in s["rounds"])
                + f" the round's best. One plan's median moves between rounds by {s['spread_median']:.0%} (the "
                f"median plan) and at most {s['spread_max']:.0%}."
                if s.get("rounds")
                else ""
            )
            + (
                f" Memory per rank against the measured peak of live tensor storage (max rank): traced (the "
                f"planner's memory column) worst {s['worst_traced_ratio']:.3f}x, the per-token arithmetic worst "
                f"{s['worst_arithmetic_ratio']:.3f}x."
                if s.get("worst_traced_ratio")
                else ""
            )
            + (
                f" Ranked as the planner ranks (the plans that fit the profile's device first): Spearman "
                f"{s['spearman_ranked_traced']:.3f} with the traced memory deciding what fits, "
                f"{s['spearman_ranked_arithmetic']:.3f} with the arithmetic."
                if s.get("spearman_ranked_traced") is not None
                else ""
            )
        )
    if "optimus" in payload:
        o = payload["optimus"]
        base = o["tp_1d"]
        rows = [
            {
                "layout": {
                    "tp_1d": "1D TP (tp 4, Megatron)",
                    "tp_sp": "TP + SP (tp 4)",
                    "optimus_2d": "Optimus-style 2D (2 x 2)",
                }[k],
                "act": max(v["activation_bytes"]) / 2**20,
                "act_ratio": max(v["activation_bytes"]) / max(base["activation_bytes"]),
                "wire": max(v["wire_bytes"]) / 2**20,
                "wire_ratio": max(v["wire_bytes"]) / max(base["wire_bytes"]),
                "step": v["step_time"],
                "step_ratio": v["step_time"] / base["step_time"],
            }
            for k, v in o.items()
        ]
        payload["optimus_rows"] = dict(zip(o, rows))  # the rendered figures, for the docs' marks
        tables.append(
            f"### Optimus rows ({PRESETS[0]}, global batch {GLOBAL_BATCH} x {SEQ} tokens, 4 ranks)\n\n"
            + markdown_table(
                rows,
                [
                    ("layout", "layout", ""),
                    ("act", "peak activation bytes / rank (MiB)", ".2f"),
                    ("act_ratio", "vs 1D TP", ".2f"),
                    ("wire", "bytes sent / rank / step (MiB)", ".2f"),
                    ("wire_ratio", "vs 1D TP", ".2f"),
                    ("step", "step (s)", ".3f"),
                    ("step_ratio", "vs 1D TP", ".2f"),
                ],
            )
        )
    fig.tight_layout()
    return write(
        name,
        payload,
        "\n\n".join(tables),
        fig,
        notes="\n".join(notes) + "\n\nMachine profile (measured in the same run, all 4 ranks at once):\n"
        f"```\n{json.dumps(payload['profile'], indent=1)}\n```",
        env=payload.get("environment"),  # re-rendered: the environment that measured it
    )


SCALE_WORLDS = (8, 64, 512, 4096)
SCALE_MODELS = ("llama2-7b", "llama2-70b")


def scaling():
    """The planner's choice for the 7B and 70B shapes at 8-4096 H100s (datasheet profile, 8 GPUs per node,
    4 sequences x 4096 tokens per GPU per step): pure arithmetic, written to results/parallel_scaling.*."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from _report import markdown_table, write

    from hf_dtrain.models import llama_config
    from hf_dtrain.parallel.planner import GiB, MachineProfile, rank_plans

    profile = MachineProfile.preset("h100")
    rows = []
    for preset in SCALE_MODELS:
        for world in SCALE_WORLDS:
            plans = rank_plans(llama_config(preset), world, profile, 4 * world, 4096)
            fitting = [p for p in plans if p.fits]
            best = plans[0]
            ddp = next((p for p in plans if (p.tp, p.pp, p.dp_shard, p.activation) == (1, 1, 1, "none")), None)
            fsdp = next((p for p in plans if (p.tp, p.pp, p.dp_replicate, p.activation) == (1, 1, 1, "none")), None)
            rows.append(
                {
                    "model": preset,
                    "gpus": world,
                    "legal": len(plans),
                    "fit": len(fitting),
                    "plan": best.key if best.fits else "none fits",
                    "flags": best.flags() if best.fits else best.overflow,
                    "step_s": best.step_time if best.fits else float("nan"),
                    "mem_gib": sum(best.memory.values()) / GiB,
                    "bubble": best.breakdown["bubble_fraction"],
                    "fsdp_s": fsdp.step_time if fsdp is not None and fsdp.fits else float("nan"),
                    "ddp_fits": bool(ddp is not None and ddp.fits),
                }
            )
    fig, ax = plt.subplots(figsize=(7, 4))
    for preset in SCALE_MODELS:
        r = [x for x in rows if x["model"] == preset]
        ax.plot([x["gpus"] for x in r], [x["step_s"] for x in r], "o-", label=f"{preset}: planner's choice")
        ax.plot([x["gpus"] for x in r], [x["fsdp_s"] for x in r], "x--", label=f"{preset}: plain FSDP2")
    ax.set_xscale("log")
    ax.set_xlabel("GPUs (H100, 8 per node)")
    ax.set_ylabel("predicted step time (s), 16k tokens / GPU")
    ax.legend(fontsize=7)
    table = markdown_table(
        rows,
        [
            ("model", "model", ""),
            ("gpus", "GPUs", ""),
            ("legal", "legal plans", ""),
            ("fit", "fit in 80 GiB", ""),
            ("plan", "chosen", ""),
            ("step_s", "predicted step (s)", ".2f"),
            ("fsdp_s", "plain FSDP2 (s)", ".2f"),
            ("mem_gib", "GiB / GPU", ".1f"),
            ("bubble", "bubble", ".0%"),
        ],
    )
    return write(
        "parallel_scaling",
        {"rows": rows, "profile": json.loads(profile.to_json())},
        table,
        fig,
        notes="Datasheet profile (`MachineProfile.preset('h100')`), not measured here. Flags of each "
        "choice:\n\n" + "\n".join(f"- {r['model']} on {r['gpus']}: `{r['flags']}`" for r in rows),
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from-json", help="re-render from a results JSON")
    ap.add_argument("--scaling", action="store_true", help="only the planner's choices for 7B / 70B at 8-4096 GPUs")
    ap.add_argument("--name", default="parallel", help="results/<name>.{json,md,png}")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved rounds over every plan")
    ap.add_argument("--warmup", type=int, default=WARMUP, help="untimed steps per plan and round")
    ap.add_argument("--timed", type=int, default=TIMED, help="timed steps per plan and round")
    ap.add_argument("--presets", default=",".join(PRESETS), help="a quick look: --presets tiny --rounds 2 --timed 1")
    args = ap.parse_args()
    if args.scaling:
        print(scaling())
        return
    if args.from_json:
        payload = json.load(open(args.from_json))
    else:
        import tempfile

        tmp = tempfile.mkdtemp()
        measured = {
            preset: measure(preset, tmp, args.rounds, args.warmup, args.timed) for preset in args.presets.split(",")
        }
        payload = {
            "world": WORLD,
            "seq_len": SEQ,
            "global_batch": GLOBAL_BATCH,
            "measured": measured,
            "profile": measured[args.presets.split(",")[0]]["profile"],
            "optimus": measure_optimus(tmp),
        }
        from _report import RESULTS

        RESULTS.mkdir(parents=True, exist_ok=True)  # the measurements first: a rendering error loses nothing
        (RESULTS / f"{args.name}.json").write_text(json.dumps(payload, indent=1) + "\n")
    payload["summary"] = analyse(payload["measured"])
    for preset, s in payload["summary"].items():
        print(
            f"{preset}: Spearman {s['spearman']:.3f}, first choice {s['first_choice']} = "
            f"{s['first_choice_vs_best']:.3f}x the measured best {s['measured_best']}"
        )
    print(render(payload, args.name))


if __name__ == "__main__":
    main()
