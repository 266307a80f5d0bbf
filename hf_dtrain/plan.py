"""``hf-dtrain plan``: every legal parallelism plan of a model on a machine, ranked by the planner of
:mod:`hf_dtrain.parallel.planner`, with the best plan's ``pretrain`` flags and ``accelerate launch`` config."""

from __future__ import annotations

import argparse
import math
import os
import socket
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_dtrain.models import llama_config
from hf_dtrain.parallel.planner import (
    ACTIVATION_POLICIES,
    GiB,
    MachineProfile,
    format_table,
    measure_profile,
    rank_plans,
)
from hf_dtrain.settings import SettingsError, parse_bytes


def _calibrate(rank: int, world: int, port: int, out: str) -> None:
    """One rank of ``hf-dtrain plan --calibrate`` (``torch.multiprocessing.spawn``): a process group on this host,
    the machine profile measured with every rank at once, written by rank 0."""

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    try:
        profile = measure_profile(name=f"this machine, {world} ranks")
        if rank == 0:
            with open(out, "w") as f:
                f.write(profile.to_json())
    finally:
        dist.destroy_process_group()


def calibrate(ranks: int):
    """The machine profile measured by ``ranks`` local processes (``hf-dtrain plan --calibrate``)."""

    from hf_dtrain.parallel.planner import MachineProfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "profile.json")
    mp.spawn(_calibrate, args=(ranks, port, out), nprocs=ranks, join=True)
    return MachineProfile.from_json(open(out).read())


def plan_main(argv=None) -> int:
    """``hf-dtrain plan``: rank every legal plan of a model on a machine and print the best's flags."""

    ap = argparse.ArgumentParser(prog="hf-dtrain plan", description=plan_main.__doc__)
    ap.add_argument("--preset", default="tiny", help="LlamaConfig preset (hf_dtrain.models.PRESETS)")
    ap.add_argument("--model-config", help="a Hugging Face config.json (or its directory) instead of a preset")
    ap.add_argument("--world-size", type=int, required=True, help="devices (processes) of the run")
    ap.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step (default 8 x world)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--profile", default="h100", help="h100 (datasheet figures) or a JSON from --save-profile")
    ap.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine's profile first (spawns "
        "--calibrate-ranks gloo / NCCL processes here) and plan with it",
    )
    ap.add_argument(
        "--calibrate-ranks",
        type=int,
        default=None,
        help="processes for --calibrate: as many as the run puts on one node (default: --world-size, at "
        "most 8), so the cores or GPUs are shared as in training",
    )
    ap.add_argument("--save-profile", help="write the profile used to this JSON")
    ap.add_argument("--device-memory", help="per-device memory, e.g. 80GB (overrides the profile's)")
    ap.add_argument("--ranks-per-node", type=int, help="devices per node (overrides the profile's)")
    ap.add_argument("--intra-bandwidth", type=float, help="GB/s per device inside a node (overrides the profile's)")
    ap.add_argument("--inter-bandwidth", type=float, help="GB/s per device across nodes (overrides the profile's)")
    ap.add_argument("--activation", default="none,checkpoint", help="activation policies to consider")
    ap.add_argument("--top", type=int, default=15, help="rows of the table")
    ns = ap.parse_args(argv)
    for flag, value in (
        ("--world-size", ns.world_size),
        ("--seq-len", ns.seq_len),
        ("--global-batch", ns.global_batch),
        ("--calibrate-ranks", ns.calibrate_ranks),
        ("--ranks-per-node", ns.ranks_per_node),
        ("--top", ns.top),
    ):
        if value is not None and value < 1:
            raise SettingsError(f"{flag} must be a whole number >= 1, got {value}.")
    for flag, value in (("--intra-bandwidth", ns.intra_bandwidth), ("--inter-bandwidth", ns.inter_bandwidth)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise SettingsError(f"{flag} must be a positive number of GB/s, got {value}.")

    try:
        if ns.model_config:
            from transformers import AutoConfig

            try:
                config = AutoConfig.from_pretrained(ns.model_config)
            except (OSError, ValueError) as e:
                raise SettingsError(f"--model-config {ns.model_config} does not load as a config: {e}") from None
        else:
            config = llama_config(ns.preset)
        if ns.calibrate:
            profile = calibrate(ns.calibrate_ranks or min(ns.world_size, 8))
        elif ns.profile.endswith(".json"):
            if not os.path.isfile(ns.profile):
                raise SettingsError(f"--profile {ns.profile}: no such file; give h100 or a JSON from --save-profile.")
            profile = MachineProfile.from_json(open(ns.profile).read())
        else:
            profile = MachineProfile.preset(ns.profile)
        if ns.device_memory:
            profile.device_memory = parse_bytes(ns.device_memory)
        if ns.ranks_per_node:
            profile.ranks_per_node = ns.ranks_per_node
        if ns.intra_bandwidth:
            profile.intra_sec_per_byte = 1 / (ns.intra_bandwidth * 1e9)
        if ns.inter_bandwidth:
            profile.inter_sec_per_byte = 1 / (ns.inter_bandwidth * 1e9)
        policies = tuple(p.strip() for p in ns.activation.split(",") if p.strip())
        bad = [p for p in policies if p not in ACTIVATION_POLICIES]
        if bad:
            raise ValueError(f"--activation {bad}: choose from {ACTIVATION_POLICIES}.")
        batch = ns.global_batch or 8 * ns.world_size
        plans = rank_plans(config, ns.world_size, profile, batch, ns.seq_len, activations=policies)
    except (ValueError, OSError) as e:
        raise SystemExit(f"hf-dtrain plan: {e}") from None
    if ns.save_profile:
        with open(ns.save_profile, "w") as f:
            f.write(profile.to_json())
    print(
        f"{len(plans)} legal plans for {ns.model_config or ns.preset} on {ns.world_size} devices "
        f"({profile.name}), global batch {batch} x {ns.seq_len} tokens:\n"
    )
    print(format_table(plans, ns.top))
    best = plans[0]
    if not best.fits:
        raise SystemExit(
            f"\nno plan fits in {profile.device_memory / GiB:.1f} GiB per device: the smallest "
            f"needs {min(sum(p.memory.values()) for p in plans) / GiB:.1f} GiB ({best.overflow}). "
            "Add devices, shorten --seq-len or lower --global-batch."
        )
    print(
        f"\nbest: {best.key}, predicted {best.step_time:.4g} s per step, "
        f"{sum(best.memory.values()) / GiB:.2f} GiB per device"
    )
    print(f"  hf-dtrain pretrain {best.flags()}")
    print("  accelerate config:\n    " + best.accelerate_config(ns.world_size).replace("\n", "\n    "))
    return 0
