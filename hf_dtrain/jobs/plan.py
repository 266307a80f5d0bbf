"""``hf-dtrain plan``: every legal parallelism plan of a model on a machine, ranked by the planner of
:mod:`hf_dtrain.parallel.planner`, with the best plan's ``pretrain`` flags and ``accelerate launch`` config."""

from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import dataclass
from datetime import timedelta

from hf_dtrain.parallel.config import ACTIVATION_POLICIES
from hf_dtrain.run.config import JobConfig
from hf_dtrain.settings import SettingsError, check_choice, parse_bytes, setting


def _calibrate(rank: int, world: int, port: int, out: str) -> None:
    """One rank of ``hf-dtrain plan --calibrate`` (``torch.multiprocessing.spawn``): a process group on this host,
    the machine profile measured with every rank at once, written by rank 0."""
    import torch
    import torch.distributed as dist

    from hf_dtrain.parallel.planner import measure_profile

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
    import torch.multiprocessing as mp

    from hf_dtrain.parallel.planner import MachineProfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "profile.json")
    mp.spawn(_calibrate, args=(ranks, port, out), nprocs=ranks, join=True)
    return MachineProfile.from_json(open(out).read())


@dataclass
class PlanConfig(JobConfig):
    """``hf-dtrain plan``: the model, the machine and the batch to plan for; every field is a flag."""

    job = "plan"

    world_size: int | None = setting(None, "Devices (processes) of the run.", min=1)
    preset: str = setting("tiny", "LlamaConfig preset (hf_dtrain.models.PRESETS).")
    model_config: str | None = setting(
        None,
        "A Hugging Face config.json (or its directory), or a GGUF file (its metadata: no weights read), instead of a "
        "preset.",
    )
    global_batch: int | None = setting(None, "Sequences per optimizer step (default 8 x world size).", min=1)
    seq_len: int = setting(4096, "Tokens per sequence.", min=1)
    profile: str = setting("h100", "h100 (datasheet figures) or a JSON from --save-profile.")
    calibrate: bool = setting(
        False,
        "Measure this machine's profile first (spawns --calibrate-ranks gloo / NCCL processes here) and plan with it.",
    )
    calibrate_ranks: int | None = setting(
        None,
        "Processes for --calibrate: as many as the run puts on one node (default: --world-size, at most "
        "8), so the cores or GPUs are shared as in training.",
        min=1,
    )
    save_profile: str | None = setting(None, "Write the profile used to this JSON.")
    device_memory: str | None = setting(None, "Per-device memory, e.g. 80GB (overrides the profile's).")
    ranks_per_node: int | None = setting(None, "Devices per node (overrides the profile's).", min=1)
    intra_bandwidth: float | None = setting(None, "GB/s per device inside a node (overrides the profile's).", gt=0)
    inter_bandwidth: float | None = setting(None, "GB/s per device across nodes (overrides the profile's).", gt=0)
    activation: str = setting("none,checkpoint", "Activation policies to consider.")
    top: int = setting(15, "Rows of the table.", min=1)
    trace: int | None = setting(
        None,
        "Rows whose memory is traced (each plan's step through the real layout on fake tensors, about 5 s a plan at "
        "the tiny preset and 15-50 s at 7B x 4096 tokens on 2 cores) instead of the per-token arithmetic, and "
        "whether they fit with it. Default: --top; 0: the arithmetic alone.",
        min=0,
    )
    trace_seconds: float = setting(
        5.0,
        "Time the memory traces may take (seconds): once it is spent no new trace starts (the first always does) and "
        "the rows left keep the arithmetic, said under the table. 0: no limit.",
        min=0,
    )
    mixed_precision: str = setting(
        "bf16", "The run's precision (Accelerate's --mixed_precision: bf16 or no): the trace's and the config's."
    )

    def check_own(self) -> None:
        if self.world_size is None:
            raise SettingsError("--world-size is required: the devices (processes) of the run to plan.")
        if self.device_memory is not None:
            parse_bytes(self.device_memory)
        policies = self.policies()
        bad = [p for p in policies if p not in ACTIVATION_POLICIES]
        if bad or not policies:
            raise SettingsError(f"--activation {bad}: choose from {ACTIVATION_POLICIES}.")
        check_choice(self, "mixed_precision", ("bf16", "no"), "mixed-precision")

    def policies(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.activation.split(",") if p.strip())


def run_plan(cfg: PlanConfig) -> int:
    """Rank every legal plan of a model on a machine and print the best's flags."""
    import torch

    from hf_dtrain.parallel.planner import GiB, format_table, rank_plans

    config = _model_config(cfg)
    profile = _profile(cfg)
    batch = cfg.global_batch or 8 * cfg.world_size
    trace = cfg.top if cfg.trace is None else cfg.trace
    if trace:
        print(f"tracing the memory of the first {trace} plans (fake tensors, the real layout) ...", flush=True)
    try:
        plans = rank_plans(
            config,
            cfg.world_size,
            profile,
            batch,
            cfg.seq_len,
            activations=cfg.policies(),
            trace=trace,
            autocast=torch.bfloat16 if cfg.mixed_precision == "bf16" else None,
            trace_seconds=cfg.trace_seconds or None,
        )
    except ValueError as e:
        raise SettingsError(str(e)) from None
    if cfg.save_profile:
        with open(cfg.save_profile, "w") as f:
            f.write(profile.to_json())
    print(
        f"{len(plans)} legal plans for {cfg.model_config or cfg.preset} on {cfg.world_size} devices "
        f"({profile.name}), global batch {batch} x {cfg.seq_len} tokens:\n"
    )
    print(format_table(plans, cfg.top))
    shown = plans[: min(trace, len(plans))]
    if trace and not all(p.traced for p in shown):
        n = sum(p.traced for p in shown)
        print(
            f"\nmemory traced for {n} of the first {len(shown)} rows; the others by the arithmetic: the traces' time "
            f"(--trace-seconds {cfg.trace_seconds:g}) was spent (0: no limit)."
        )
    best = plans[0]
    if not best.fits:
        raise SettingsError(
            f"no plan fits in {profile.device_memory / GiB:.1f} GiB per device: the smallest needs "
            f"{min(sum(p.memory.values()) for p in plans) / GiB:.1f} GiB ({best.overflow}). Add devices, shorten "
            "--seq-len or lower --global-batch."
        )
    print(
        f"\nbest: {best.key}, predicted {best.step_time:.4g} s per step, "
        f"{sum(best.memory.values()) / GiB:.2f} GiB per device"
    )
    print(f"  hf-dtrain pretrain {best.flags()}")
    config_text = best.accelerate_config(cfg.world_size, cfg.mixed_precision)
    print("  accelerate config:\n    " + config_text.replace("\n", "\n    "))
    return 0


def _model_config(cfg: PlanConfig):
    if not cfg.model_config:
        from hf_dtrain.models import llama_config

        return llama_config(cfg.preset)
    from hf_dtrain.checkpoints import ModelLoadError, model_config

    try:
        return model_config(cfg.model_config)
    except ModelLoadError:
        raise
    except (OSError, ValueError) as e:
        raise SettingsError(f"--model-config {cfg.model_config} does not load as a config: {e}") from None


def _profile(cfg: PlanConfig):
    """The machine profile: measured (--calibrate), read from a JSON, or a preset; with the flags' overrides."""
    from hf_dtrain.parallel.planner import MachineProfile

    if cfg.calibrate:
        profile = calibrate(cfg.calibrate_ranks or min(cfg.world_size, 8))
    elif cfg.profile.endswith(".json"):
        if not os.path.isfile(cfg.profile):
            raise SettingsError(f"--profile {cfg.profile}: no such file; give h100 or a JSON from --save-profile.")
        profile = MachineProfile.from_json(open(cfg.profile).read())
    else:
        try:
            profile = MachineProfile.preset(cfg.profile)
        except ValueError as e:
            raise SettingsError(f"--profile {cfg.profile}: {e}") from None
    if cfg.device_memory:
        profile.device_memory = parse_bytes(cfg.device_memory)
    if cfg.ranks_per_node:
        profile.ranks_per_node = cfg.ranks_per_node
    if cfg.intra_bandwidth:
        profile.intra_sec_per_byte = 1 / (cfg.intra_bandwidth * 1e9)
    if cfg.inter_bandwidth:
        profile.inter_sec_per_byte = 1 / (cfg.inter_bandwidth * 1e9)
    return profile
