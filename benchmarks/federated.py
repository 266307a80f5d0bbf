"""Federated fine-tuning (hf_dtrain.federated) on the embedded default model and task.

1. Uplink: 100 clients (Dirichlet 0.5 over the task's labels), 10 per round, LoRA-FA adapters; FedAvg of full fp32
   deltas against the int8 and low-rank uplinks with error feedback: uplink bytes per round and the final eval loss.
   Goal: <= 0.25x the fp32 bytes at an eval loss within 1% of the uncompressed run.
2. Simulation wall time of the same federation: Parrot (clients trained one after another in 2 long-lived processes,
   local then global aggregation) against one process per client per round (each client a fresh process that loads
   the model, as a simulator without virtual clients runs them) and against Flower's simulation engine (Ray; when
   ``flwr[simulation]`` is installed), the same client code in each.

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
from _report import markdown_table, write

UPLINKS = [("none", None), ("int8", None), ("int4", None), ("lowrank", 2), ("lowrank", 1)]


def fed_run(base_path, out, rounds, uplink="none", rank=4):
    from hf_dtrain.jobs.fed import run_fed_simulate

    return run_fed_simulate(_config(base_path, out, rounds, uplink=uplink, rank=rank))


def _config(base_path, out, rounds, clients=100, per_round=10, local_steps=5, uplink="none", rank=4):
    from hf_dtrain.federated import FederatedConfig
    from hf_dtrain.jobs.fed import FedSimulateConfig
    from hf_dtrain.jobs.sft.config import FinetuneConfig

    job = FinetuneConfig.from_dict(
        dict(
            method="lorafa",
            model=base_path,
            train_size=4000,
            eval_size=200,
            output_dir=out,
            progress=False,
            report=False,
            lorafa={"optimizer": False},
        )
    )
    return FedSimulateConfig(
        job=job,
        fed=FederatedConfig(
            clients=clients,
            per_round=per_round,
            rounds=rounds,
            local_steps=local_steps,
            batch_size=8,
            uplink=uplink,
            uplink_rank=rank,
        ),
    )


def client_process(argv):
    """One client's round in a fresh process (the one-process-per-client simulation): build the federation, load
    the global adapter, train the client, write its delta."""
    import torch
    from safetensors.torch import load_file, save_file

    from hf_dtrain.federated import FederatedSimulation
    from hf_dtrain.jobs.fed import build_federation, client_config

    base_path, global_path, client, out, state_dir = argv
    torch.set_num_threads(1)
    cfg = _config(base_path, None, 1)
    model, _, clients, collator, _, _ = build_federation(cfg)
    sim = FederatedSimulation(model, clients, collator, client_config(cfg), state_dir=state_dir)
    sim.global_state = dict(load_file(global_path).items())
    delta, _, weight, sent, _ = sim.train_client(int(client))
    save_file(
        {
            **{f"d.{n}": v.contiguous() for n, v in delta.items()},
            "weight": torch.tensor([weight]),
            "bytes": torch.tensor([float(sent)]),
        },
        out,
    )


def per_client_processes(base_path, rounds, tmp, concurrency=2) -> float:
    """Wall seconds of ``rounds`` rounds simulated with one fresh process per client (``concurrency`` at a time)."""
    from safetensors.torch import load_file, save_file

    from hf_dtrain.federated import FederatedSimulation, global_average, local_aggregate
    from hf_dtrain.jobs.fed import build_federation, client_config

    cfg = _config(base_path, None, rounds)
    model, _, clients, collator, _, _ = build_federation(cfg)
    sim = FederatedSimulation(model, clients, collator, client_config(cfg), state_dir=os.path.join(tmp, "states"))
    t0 = time.perf_counter()
    for r in range(rounds):
        gpath = os.path.join(tmp, "global.safetensors")
        save_file({n: v.contiguous() for n, v in sim.global_state.items()}, gpath)
        sampled, outs, running = sim.sample(r), [], []
        for c in sampled:
            out = os.path.join(tmp, f"delta{c}.safetensors")
            outs.append(out)
            running.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--client-process",
                        base_path,
                        gpath,
                        str(c),
                        out,
                        os.path.join(tmp, "states"),
                    ],
                    env=dict(os.environ, OMP_NUM_THREADS="1"),
                )
            )
            if len(running) >= concurrency:
                running.pop(0).wait()
        for p in running:
            p.wait()
        deltas, weights = [], []
        for out in outs:
            t = load_file(out)
            deltas.append({n[2:]: v for n, v in t.items() if n.startswith("d.")})
            weights.append(float(t["weight"]))
        avg = global_average([local_aggregate(deltas, weights)])
        for n in sim.global_state:
            sim.global_state[n] += avg[n]
    return time.perf_counter() - t0


def parrot_processes(base_path, rounds, tmp, nproc=2) -> tuple[float, float]:
    """(wall seconds of the whole launch, seconds in the rounds) of the same federation under torchrun, Parrot."""
    from hf_dtrain.testing import free_port

    out = os.path.join(tmp, "parrot")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(free_port()),
        "-m",
        "hf_dtrain.cli",
        "fed",
        "simulate",
        "--method",
        "lorafa",
        "--model",
        base_path,
        "--train-size",
        "4000",
        "--eval-size",
        "200",
        "--clients",
        "100",
        "--per-round",
        "10",
        "--rounds",
        str(rounds),
        "--local-steps",
        "5",
        "--fed.batch-size",
        "8",
        "--lorafa.optimizer",
        "false",
        "--output-dir",
        out,
        "--progress",
        "false",
        "--report",
        "false",
    ]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True)
    wall = time.perf_counter() - t0
    with open(os.path.join(out, "fed.json")) as f:
        rounds_s = sum(r["seconds"] for r in json.load(f)["rounds"])
    return wall, rounds_s


_FLOWER_SIM = {}  # one federation per Ray worker process (built on its first client), as Flower users cache a model


def _flower_sim(base_path, state_dir):
    if "sim" not in _FLOWER_SIM:
        import torch

        from hf_dtrain.federated import FederatedSimulation
        from hf_dtrain.jobs.fed import build_federation, client_config

        torch.set_num_threads(1)
        cfg = _config(base_path, None, 1)
        model, _, clients, collator, _, _ = build_federation(cfg)
        _FLOWER_SIM["sim"] = FederatedSimulation(model, clients, collator, client_config(cfg), state_dir=state_dir)
    return _FLOWER_SIM["sim"]


def flower_simulation(base_path, rounds, tmp, workers=2) -> float:
    """Wall seconds of the same federation in Flower's simulation engine (``flwr.simulation.run_simulation``, Ray
    backend, ``workers`` actors of one CPU each): a ``NumPyClient`` per virtual client that trains it with the same
    client code (``FederatedSimulation.train_client``), Flower's ``FedAvg`` sampling 10 of 100 clients per round."""
    import numpy as np
    import torch
    from flwr.client import ClientApp, NumPyClient
    from flwr.common import Context, ndarrays_to_parameters
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import run_simulation

    from hf_dtrain.federated import FederatedSimulation
    from hf_dtrain.jobs.fed import build_federation, client_config

    state_dir = os.path.join(tmp, "flower-states")
    cfg = _config(base_path, None, rounds)
    model, _, clients, collator, _, _ = build_federation(cfg)
    names = sorted(FederatedSimulation(model, clients, collator, client_config(cfg), state_dir=state_dir).global_state)
    init = FederatedSimulation(model, clients, collator, client_config(cfg), state_dir=state_dir).global_state
    initial = ndarrays_to_parameters([init[n].numpy() for n in names])

    class Client(NumPyClient):
        def __init__(self, cid):
            self.cid = cid

        def fit(self, parameters, config):
            sim = _flower_sim(base_path, state_dir)
            sim.global_state = {n: torch.from_numpy(np.array(a)) for n, a in zip(names, parameters)}
            delta, _, weight, _, _ = sim.train_client(self.cid)
            return [(sim.global_state[n] + delta[n]).numpy() for n in names], int(weight), {}

    def client_fn(context: Context):
        return Client(int(context.node_config["partition-id"])).to_client()

    def server_fn(context: Context):
        strategy = FedAvg(
            fraction_fit=0.1,
            fraction_evaluate=0.0,
            min_fit_clients=10,
            min_available_clients=100,
            initial_parameters=initial,
        )
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=rounds))

    t0 = time.perf_counter()
    run_simulation(
        server_app=ServerApp(server_fn=server_fn),
        client_app=ClientApp(client_fn=client_fn),
        num_supernodes=100,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": workers}},
    )
    return time.perf_counter() - t0


SPLIT_RANKS = [None, 64, 16, 4]
SPLIT_STEPS = 150


def split_worker(argv):
    """One side of split fine-tuning on an emulated host: rank 0 the edge, rank 1 the cloud."""
    import torch
    import torch.distributed as dist
    from peft import get_peft_model

    from hf_dtrain import tasks
    from hf_dtrain.jobs.sft.config import FinetuneConfig
    from hf_dtrain.models import load_model_and_tokenizer
    from hf_dtrain.split import SplitCloud, SplitConfig, SplitEdge

    rank, base_path, spec, out = int(argv[0]), argv[1], argv[2], argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=__import__("datetime").timedelta(seconds=120))
    model, tok = load_model_and_tokenizer(base_path)
    torch.manual_seed(0)
    model = get_peft_model(model, FinetuneConfig(method="lorafa").build_peft_config(model))
    cfg = SplitConfig(cut_layer=2, rank=None if spec == "full" else int(spec))
    side = (SplitEdge if rank == 0 else SplitCloud)(model.get_base_model(), cfg)
    opt = torch.optim.AdamW(side.parameters(), lr=4e-3)
    collate = tasks.task_collator(tok)
    train = tasks.make_task_dataset(tok, SPLIT_STEPS * 16, seed=0, split="train")
    evalset = tasks.make_task_dataset(tok, 256, seed=0, split="eval")
    dist.barrier()
    t0 = time.perf_counter()
    for s in range(SPLIT_STEPS):
        b = collate([train[i] for i in range(16 * s, 16 * s + 16)])
        side.step(b["input_ids"], b["labels"]) if rank == 0 else side.step()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    seconds = time.perf_counter() - t0
    total, rows = 0.0, 0
    for s in range(0, 256, 64):
        b = collate([evalset[i] for i in range(s, s + 64)])
        if rank == 0:
            side.evaluate(b["input_ids"], b["labels"])
        else:
            loss, n = side.evaluate()
            total, rows = total + loss * n, rows + n
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(
            dict(
                seconds=seconds,
                sent=side.bytes_sent,
                received=side.bytes_received,
                eval_loss=total / rows if rows else None,
            ),
            f,
        )
    dist.destroy_process_group()


def unsplit_reference(base_path) -> float:
    """The same fine-tuning in one process, unsplit: its eval loss (the centralized reference)."""
    import torch
    from peft import get_peft_model

    from hf_dtrain import tasks
    from hf_dtrain.jobs.sft.config import FinetuneConfig
    from hf_dtrain.models import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(base_path)
    torch.manual_seed(0)
    model = get_peft_model(model, FinetuneConfig(method="lorafa").build_peft_config(model))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=4e-3)
    collate = tasks.task_collator(tok)
    train = tasks.make_task_dataset(tok, SPLIT_STEPS * 16, seed=0, split="train")
    evalset = tasks.make_task_dataset(tok, 256, seed=0, split="eval")
    for s in range(SPLIT_STEPS):
        b = collate([train[i] for i in range(16 * s, 16 * s + 16)])
        model(input_ids=b["input_ids"], labels=b["labels"]).loss.backward()
        opt.step()
        opt.zero_grad()
    total = 0.0
    with torch.no_grad():
        for s in range(0, 256, 64):
            b = collate([evalset[i] for i in range(s, s + 64)])
            total += float(model(input_ids=b["input_ids"], labels=b["labels"]).loss) * 64
    return total / 256


def split_part(base_path, rate="100mbit") -> list[dict]:
    """Split fine-tuning on two emulated hosts joined by ``rate`` links, by the link's rank."""
    from hf_dtrain.testing import free_port
    from hf_dtrain.testing.netns import emulated_hosts, run_on_hosts

    rows = []
    with tempfile.TemporaryDirectory() as tmp, emulated_hosts(2, rate=rate) as hosts:
        for spec in SPLIT_RANKS:
            name = "full" if spec is None else str(spec)
            out = os.path.join(tmp, name)
            port = free_port()
            run_on_hosts(
                hosts,
                lambda r, hs: [sys.executable, __file__, "--split-worker", str(r), base_path, name, out],
                timeout=900,
                env=dict(
                    MASTER_ADDR=hosts[0].address,
                    MASTER_PORT=str(port),
                    OMP_NUM_THREADS="1",
                    PYTHONPATH=str(Path(__file__).resolve().parents[1]),
                ),
            )
            edge, cloud = (json.load(open(f"{out}.{r}.json")) for r in (0, 1))
            rows.append(
                dict(
                    rank=name,
                    bytes_per_step=(edge["sent"] + cloud["sent"]) / SPLIT_STEPS,
                    seconds_per_step=max(edge["seconds"], cloud["seconds"]) / SPLIT_STEPS,
                    eval_loss=cloud["eval_loss"],
                )
            )
            print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--from-json", metavar="PATH", help="only rebuild the table and plot from a results JSON")
    ap.add_argument("--client-process", nargs=5, help=argparse.SUPPRESS)
    ap.add_argument("--sim-rounds", type=int, default=3, help="rounds of the wall-time comparison")
    ap.add_argument("--split-worker", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--only-split", action="store_true", help="run only the split fine-tuning part")
    ap.add_argument(
        "--only-sim",
        action="store_true",
        help="rerun only the simulators' wall-time comparison (one "
        "process per client, Parrot, Flower) and rewrite the results with it",
    )
    args = ap.parse_args()
    if args.from_json:  # the measured run's figures and environment, drawn again
        data = json.load(open(args.from_json))
        return render(
            data["rows"],
            data["rounds"],
            data["simulation"],
            data["split"],
            data["unsplit_eval_loss"],
            env=data["environment"],
        )
    if args.client_process:
        return client_process(args.client_process)
    if args.split_worker:
        return split_worker(args.split_worker)
    if args.only_split:
        from hf_dtrain.models import build_default_model

        base = build_default_model("tiny", progress=True)
        print(split_part(base), unsplit_reference(base))
        return
    import torch

    from hf_dtrain.models import build_default_model

    torch.set_num_threads(2)
    base_path = build_default_model("tiny", progress=True)
    if args.only_sim:  # the wall-time comparison alone, all three simulators in this run; the rest kept
        from _report import RESULTS

        data = json.loads((RESULTS / "federated.json").read_text())
        sim = simulation_part(base_path, args.sim_rounds)
        return render(
            data["rows"],
            data["rounds"],
            sim,
            data["split"],
            data["unsplit_eval_loss"],
            env={
                **data["environment"],
                "command (simulation part)": "python benchmarks/federated.py " + " ".join(sys.argv[1:]),
            },
        )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for uplink, rank in UPLINKS:
            t0 = time.perf_counter()
            r = fed_run(base_path, os.path.join(tmp, f"{uplink}{rank}"), args.rounds, uplink, rank or 4)
            rows.append(
                dict(
                    uplink=uplink + (f" r={rank}" if rank else ""),
                    bytes_per_round=r["uplink_bytes"] / args.rounds,
                    eval_loss=r["eval_loss_final"],
                    seconds=time.perf_counter() - t0,
                    curve=[h["eval_loss"] for h in r["rounds"]],
                )
            )
            print(rows[-1], flush=True)
    full = rows[0]
    for row in rows:
        row["bytes_vs_fp32"] = row["bytes_per_round"] / full["bytes_per_round"]
        row["eval_loss_vs_fp32"] = row["eval_loss"] / full["eval_loss"]
    sim = simulation_part(base_path, args.sim_rounds)
    split_rows = split_part(base_path)
    central = unsplit_reference(base_path)
    for row in split_rows:
        row["bytes_vs_full"] = row["bytes_per_step"] / split_rows[0]["bytes_per_step"]
        row["eval_loss_vs_unsplit"] = row["eval_loss"] / central
    render(rows, args.rounds, sim, split_rows, central)


def simulation_part(base_path, rounds) -> dict:
    """Wall seconds of the same federation in three simulators, in this run: one process per client, Parrot on 2
    processes, Flower's simulation engine (Ray, 2 actors) where ``flwr[simulation]`` is installed."""
    with tempfile.TemporaryDirectory() as tmp:
        naive = per_client_processes(base_path, rounds, tmp)
        parrot_wall, parrot_rounds = parrot_processes(base_path, rounds, tmp)
        try:
            import flwr

            flower, flower_version = flower_simulation(base_path, rounds, tmp), flwr.__version__
        except ImportError as e:
            flower, flower_version = None, f"not installed ({e}): pip install 'flwr[simulation]'"
    sim = dict(
        rounds=rounds,
        per_client_process_s=naive,
        parrot_wall_s=parrot_wall,
        parrot_rounds_s=parrot_rounds,
        speedup_wall=naive / parrot_wall,
        speedup_rounds=naive / parrot_rounds,
        flower_s=flower,
        flower=flower_version,
        speedup_vs_flower=flower / parrot_wall if flower else None,
    )
    print(sim, flush=True)
    return sim


def render(rows, rounds, sim, split_rows, central, env=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for row in rows:
        ax.plot(
            range(1, len(row["curve"]) + 1), row["curve"], label=f"{row['uplink']} ({row['bytes_vs_fp32']:.3f}x bytes)"
        )
    ax.set_xlabel("round")
    ax.set_ylabel("eval loss of the global adapter")
    ax.legend(fontsize=8)
    cols = [
        ("uplink", "uplink", ""),
        ("bytes_per_round", "bytes / round", ",.0f"),
        ("bytes_vs_fp32", "vs fp32", ".3f"),
        ("eval_loss", "final eval loss", ".4f"),
        ("eval_loss_vs_fp32", "vs fp32", ".4f"),
        ("seconds", "wall s", ".1f"),
    ]
    table = markdown_table(rows, cols)
    table += (
        f"\n\nSimulation wall time of {sim['rounds']} rounds (100 clients, 10 per round, 2 CPU cores): one "
        f"process per client {sim['per_client_process_s']:.1f} s; Parrot on 2 processes {sim['parrot_wall_s']:.1f} s "
        f"with start-up ({sim['speedup_wall']:.1f}x faster), {sim['parrot_rounds_s']:.1f} s in the rounds "
        f"({sim['speedup_rounds']:.1f}x)."
    )
    if sim.get("flower_s"):
        table += (
            f" Flower {sim['flower']} (`flwr.simulation.run_simulation`, Ray backend, 2 actors of 1 CPU, the "
            f"same client code, its FedAvg): {sim['flower_s']:.1f} s, {sim['speedup_vs_flower']:.1f}x Parrot's "
            "wall time with start-up."
        )
    elif sim.get("flower"):
        table += f" Flower: {sim['flower']}."
    scols = [
        ("rank", "link rank", ""),
        ("bytes_per_step", "bytes / step", ",.0f"),
        ("bytes_vs_full", "vs full", ".3f"),
        ("seconds_per_step", "s / step (100 Mbit/s)", ".3f"),
        ("eval_loss", "eval loss", ".4f"),
        ("eval_loss_vs_unsplit", "vs unsplit", ".4f"),
    ]
    table += (
        f"\n\nSplit fine-tuning (cut after layer 2 of 4, LoRA-FA, {SPLIT_STEPS} steps of batch 16) on two emulated "
        f"hosts joined by 100 Mbit/s links; unsplit eval loss {central:.4f}:\n\n" + markdown_table(split_rows, scols)
    )
    write(
        "federated",
        dict(rows=rows, rounds=rounds, simulation=sim, split=split_rows, unsplit_eval_loss=central),
        table,
        fig,
        env=env,
        notes="100 clients (Dirichlet 0.5 over the first operand's leading digit), 10 per round, 5 local AdamW "
        "steps of batch 8, LoRA-FA r=8 (its optimizer off), error feedback on the compressed uplinks.",
    )
    print(table)


if __name__ == "__main__":
    main()
