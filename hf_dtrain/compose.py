"""Composing hf_dtrain's parts in one run: the engine configs ``hf-dtrain pretrain`` and ``hf-dtrain finetune``
share (each one the engine's own dataclass, held here as a section and passed down unchanged), the check that refuses
combinations that clash (naming the clash and the fix), and the optimizer table both jobs use.

    opts = ComposeOptions(comm_hook=CommHookConfig(method="acp_sgd", rank=8), delta=DeltaConfig(budget=0.5),
                          fault_tolerance=SnapshotConfig())
    opts.check(world_size=4, engine="accelerate")          # ValueError naming any clash
    ComposeOptions.from_dict({"comm_hook": "acp_sgd", "delta": {"budget": 0.5}})   # YAML / JSON data
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hf_dtrain.comm import register_fsdp
from hf_dtrain.comm.config import CommHookConfig
from hf_dtrain.decentralized import DPSGD, DecentLaM, DiLoCo
from hf_dtrain.decentralized.config import DiLoCoConfig, GossipConfig
from hf_dtrain.fault.config import SnapshotConfig
from hf_dtrain.memory.config import DeltaConfig
from hf_dtrain.optim import Eva, OneBitLamb
from hf_dtrain.optim.config import EvaConfig, OneBitLambConfig
from hf_dtrain.parallel import apply_fsdp, fsdp_mesh
from hf_dtrain.parallel.fsdp import FSDPConfig
from hf_dtrain.parallel.zero import deepspeed_config, zero_stage
from hf_dtrain.settings import build, coerce_section, sections

ENGINES = ("accelerate", "trainer")

# The jobs' defaults where they differ from the engine's own: Eva's damping for transformers (docs/optim.md) and a
# shorter 1-bit LAMB warm-up for short fine-tuning runs.
JOB_EVA = EvaConfig(damping=1e-6)
JOB_ONEBIT_LAMB = OneBitLambConfig(freeze_step=20)


@dataclass
class ComposeOptions:
    """The engine configs of one run; every field of every section is a ``--section.field`` flag of ``pretrain`` and
    ``finetune`` and a key of the YAML section of that name."""

    comm_hook: CommHookConfig | None = field(
        default=None,
        metadata={
            "help": "Gradient communication under DDP (hf_dtrain.comm; >= 2 processes); None: DDP's own all-reduce."
        },
    )
    optimizer: str = field(
        default="adamw",
        metadata={
            "help": "adamw; eva (preconditions AdamW, settings in eva.*); onebit_lamb, dpsgd, decentlam and diloco "
            "exchange gradients/parameters themselves (>= 2 processes; settings in onebit_lamb.* / gossip.* / "
            "diloco.*)."
        },
    )
    eva: EvaConfig = field(
        default_factory=lambda: dataclasses.replace(JOB_EVA),
        metadata={"help": "Eva's settings (used with optimizer=eva)."},
    )
    onebit_lamb: OneBitLambConfig = field(
        default_factory=lambda: dataclasses.replace(JOB_ONEBIT_LAMB),
        metadata={"help": "1-bit LAMB's settings (used with optimizer=onebit_lamb)."},
    )
    gossip: GossipConfig = field(
        default_factory=GossipConfig,
        metadata={"help": "The decentralized optimizers' settings (used with optimizer=dpsgd / decentlam)."},
    )
    diloco: DiLoCoConfig = field(
        default_factory=DiLoCoConfig,
        metadata={
            "help": "DiLoCo's settings (used with optimizer=diloco): H local AdamW steps, then an outer Nesterov step "
            "on the averaged pseudo-gradient."
        },
    )
    delta: DeltaConfig | None = field(
        default=None, metadata={"help": "DELTA memory scheduling (hf_dtrain.memory); None: off."}
    )
    fault_tolerance: SnapshotConfig | None = field(
        default=None,
        metadata={
            "help": "In-memory snapshots held by a snapshot process per node, erasure coded across nodes; a relaunched "
            "run resumes from them (hf_dtrain.fault). None: off."
        },
    )
    hetero_speeds: list[float] | None = field(
        default=None,
        metadata={
            "help": "Heterogeneity-aware sampler: relative speed of each rank (one per process); None: even shards."
        },
    )
    deepspeed: str | None = field(
        default=None,
        metadata={
            "help": "DeepSpeed config for finetune's Trainer: zero2 or zero3 (built-in configs whose 'auto' values the "
            "Trainer fills), or the path of your own JSON; checked against the other switches."
        },
    )
    stop_on_nonfinite_loss: bool = field(
        default=True,
        metadata={
            "help": "Stop the run with an error naming the step when the training or held-out loss becomes NaN or "
            "infinite (false: train on, as the Trainer does)."
        },
    )
    fsdp: FSDPConfig | None = field(
        default=None,
        metadata={
            "help": "Shard the model with FSDP2 (hf_dtrain.parallel.apply_fsdp: decoder layers and root, tuner layers "
            "whole; fsdp.replicate > 1 for HSDP) instead of replicating it with DDP. None: DDP."
        },
    )

    def __post_init__(self):
        self.validate()

    @property
    def asynchronous_gossip(self) -> bool:
        """A gossiping optimizer with ``gossip.asynchronous``: DDP must not broadcast buffers in every forward."""
        return self.optimizer in GOSSIP_OPTIMIZERS and self.gossip.asynchronous

    @property
    def comm_method(self) -> str | None:
        return None if self.comm_hook is None else self.comm_hook.method

    @classmethod
    def from_dict(cls, data: dict | None, where: str | None = None):
        """The config from plain data (a YAML recipe, JSON, the CLI's parsed flags): sections as mappings or their
        short forms, unknown keys refused naming the valid ones."""
        data = {str(k).replace("-", "_"): v for k, v in (data or {}).items()}
        return build(cls, data, where or cls.__name__)

    def validate(self) -> None:
        """Checks that need no world: the sections are built and valid (each validates itself), names are known."""
        for name, _, _ in sections(type(self)):
            coerce_section(self, name)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"optimizer={self.optimizer!r} is unknown; set --optimizer to one of {', '.join(OPTIMIZERS)}."
            )
        if isinstance(self.hetero_speeds, str):
            self.hetero_speeds = [float(s) for s in self.hetero_speeds.split(",") if s.strip()]
        if self.hetero_speeds is not None and (not self.hetero_speeds or min(self.hetero_speeds) <= 0):
            raise ValueError(
                "hetero_speeds must be positive relative speeds, one per process, got "
                f"{self.hetero_speeds!r}; set --hetero-speeds."
            )
        self.deepspeed_stage()  # a missing or unreadable DeepSpeed config is an error now, not after start-up
        unused = [
            (section, chosen)
            for section, chosen, default in (
                ("eva", ("eva",), JOB_EVA),
                ("onebit_lamb", ("onebit_lamb",), JOB_ONEBIT_LAMB),
                ("gossip", GOSSIP_OPTIMIZERS, GossipConfig()),
                ("diloco", ("diloco",), DiLoCoConfig()),
            )
            if getattr(self, section) != default and self.optimizer not in chosen
        ]
        if unused:
            section, chosen = unused[0]
            raise ValueError(
                f"{section}.* settings are given but optimizer={self.optimizer}; set --optimizer "
                f"{' or '.join(chosen)}, or drop the {section} settings."
            )

    def deepspeed_stage(self) -> int | None:

        if not self.deepspeed:
            return None
        return zero_stage(deepspeed_config(self.deepspeed))

    def check(self, world_size: int, engine: str, lorafa_optimizer: bool = False) -> None:
        """Refuse combinations that clash, with a ``ValueError`` naming both sides and what to change."""
        self.validate()
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        clashes = []
        if self.comm_hook is not None and self.optimizer in EXCHANGING:
            clashes.append(
                f"optimizer={self.optimizer} exchanges gradients/parameters itself (DDP runs the noop "
                f"hook) and comm_hook={self.comm_method} would be a second exchange: drop --comm-hook, or use "
                "--optimizer adamw/eva with the hook"
            )
        if world_size < 2:
            if self.comm_hook is not None:
                clashes.append(
                    f"comm_hook={self.comm_method} needs >= 2 processes; this run has 1 (accelerate "
                    "launch / torchrun, or leave --comm-hook out)"
                )
            if self.optimizer in EXCHANGING:
                clashes.append(f"optimizer={self.optimizer} needs >= 2 processes; this run has 1")
        if lorafa_optimizer and self.optimizer != "adamw":
            clashes.append(
                "two optimizers: --method lorafa builds its own (create_lorafa_optimizer) and "
                f"--optimizer {self.optimizer} would replace it; set --lorafa.optimizer false to use "
                f"{self.optimizer}"
            )
        if self.fault_tolerance is not None and self.comm_method == "dear":
            clashes.append(
                "comm_hook=dear defers each update into the next forward, so a snapshot at the step "
                "boundary would miss it: use another hook with --fault-tolerance"
            )
        if self.hetero_speeds is not None:
            if engine == "trainer":
                clashes.append(
                    "hetero_speeds: the Trainer shards its loader again through Accelerate, so the "
                    "heterogeneity-aware sampler cannot be used with it; use hf-dtrain pretrain (an "
                    "Accelerate loop) or drop --hetero-speeds"
                )
            elif len(self.hetero_speeds) != world_size:
                clashes.append(
                    f"hetero_speeds has {len(self.hetero_speeds)} values for {world_size} processes; "
                    "give one speed per process"
                )
        if self.fsdp is not None:
            clashes += self._fsdp_clashes(engine)
        stage = self.deepspeed_stage()
        if stage is not None:
            if engine != "trainer":
                clashes.append(
                    "deepspeed: hf-dtrain pretrain runs DDP through Accelerate; DeepSpeed configs are "
                    "taken by hf-dtrain finetune (the Trainer)"
                )
            if self.comm_hook is not None:
                clashes.append(
                    f"comm_hook={self.comm_method} is a DDP communication hook and DeepSpeed ZeRO-{stage} "
                    "replaces DDP (its own reduce/reduce-scatter): drop --comm-hook, or use "
                    "hf_dtrain.comm.register_deepspeed with ZeRO stage 0 from Python"
                )
            if self.optimizer in EXCHANGING:
                clashes.append(
                    f"optimizer={self.optimizer} needs DDP's noop hook; DeepSpeed ZeRO-{stage} does its "
                    "own gradient exchange"
                )
            if self.optimizer == "eva" and stage >= 1:
                clashes.append(
                    f"optimizer=eva keeps per-layer vectors for full parameters; DeepSpeed ZeRO-{stage} "
                    "partitions the optimizer (not supported)"
                )
            if self.fault_tolerance is not None and stage >= 1:
                clashes.append(
                    f"fault_tolerance with DeepSpeed ZeRO-{stage} under the Trainer: the Trainer resumes "
                    "DeepSpeed through DeepSpeed's own checkpoint loader, which the in-memory snapshots "
                    "do not feed; use DDP or --fsdp (no "
                    "--deepspeed) or ZeRO stage 0 with the Trainer, or SnapshotEngine(engine, "
                    "engine.optimizer) in your own DeepSpeed loop, which snapshots ZeRO-1/2/3 partitions"
                )
        if clashes:
            raise ValueError("These switches cannot be combined: " + "; ".join(clashes) + ".")

    def _fsdp_clashes(self, engine: str) -> list[str]:
        """What cannot run on an FSDP2-sharded model today, each with its reason."""
        out = []
        if self.deepspeed:
            out.append("fsdp and deepspeed are two sharding engines: choose --fsdp (torch FSDP2) or --deepspeed")
        if self.comm_hook is not None:
            from hf_dtrain.comm.fsdp import FSDP_METHODS, FSDP_REFUSALS

            if self.fsdp.replicate < 2:
                out.append(
                    f"comm_hook={self.comm_method} with fsdp: FSDP2 has no DDP hooks, and a comm hook there "
                    "compresses the exchange across HSDP replica groups, which fsdp.replicate=1 does not have: "
                    "set --fsdp.replicate N (N >= 2 groups of processes, e.g. one per node), or drop --comm-hook"
                )
            elif self.comm_method not in FSDP_METHODS:
                out.append(
                    f"comm_hook={self.comm_method} cannot carry FSDP2's replica exchange: "
                    f"{FSDP_REFUSALS.get(self.comm_method, 'not built')}; use --comm-hook "
                    f"{' / '.join(FSDP_METHODS)} with --fsdp.replicate, or drop --comm-hook"
                )
        if self.optimizer in EXCHANGING:
            out.append(
                f"optimizer={self.optimizer} exchanges whole gradients/parameters between replicas; under "
                "FSDP2 each rank holds a shard, not a replica: use --optimizer adamw"
            )
        return out


def shard_with_fsdp(model, fsdp: FSDPConfig, comm_hook=None):
    """Shard ``model`` with FSDP2 (``apply_fsdp``); with a comm hook (HSDP, ``fsdp.replicate >= 2``) shard it on the
    ``dp_shard`` mesh dimension and run the exchange across replica groups through
    ``hf_dtrain.comm.register_fsdp``. Returns that exchange's state (bytes per step), or None."""

    if comm_hook is None:
        apply_fsdp(model, fsdp)
        return None
    if fsdp.replicate < 2:
        raise ValueError(
            "a comm hook with fsdp compresses the exchange across HSDP replica groups: set "
            "fsdp.replicate (--fsdp.replicate) >= 2, or drop the comm hook."
        )

    mesh = fsdp_mesh(fsdp)
    apply_fsdp(model, fsdp, mesh=mesh["dp_shard"])
    return register_fsdp(model, comm_hook, mesh["dp_replicate"].get_group())


def fsdp_from_launcher(fsdp):
    """The job's FSDP2 settings: ``--fsdp`` as given, or, when ``accelerate launch`` was given an Accelerate FSDP
    config on a machine without CUDA, that config's settings. Accelerate enables its FSDP plugin only on GPU-class
    devices (1.15: on CPU it silently falls back to DDP), so there hf_dtrain shards the model itself with them. On
    CUDA the Trainer / Accelerator takes Accelerate's own FSDP2 route."""

    if not FSDPConfig.requested_by_accelerate():
        return fsdp
    if fsdp is not None:
        raise ValueError(
            "Two FSDP settings: --fsdp and an Accelerate FSDP launch config (distributed_type: FSDP) "
            "both shard the model; keep one (drop --fsdp, or launch with a non-FSDP config)."
        )
    if torch.cuda.is_available():
        return None
    config = FSDPConfig.from_accelerate()
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"hf-dtrain: the Accelerate FSDP config runs as FSDP2 on CPU through hf_dtrain.parallel: {config}",
            flush=True,
        )
    return config


def keep_sharded(model) -> None:
    """Let the Trainer / Accelerator use a model FSDP2 has already sharded: ``prepare`` would otherwise wrap it in
    DDP (on a device where its FSDP plugin is off), which refuses DTensor parameters. A model Accelerate marks as
    prepared is used as it is; FSDP2 does the gradient reduction itself."""
    model._is_accelerate_prepared = True


def _adamw(opts, model, params, lr, weight_decay):

    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def _eva(opts, model, params, lr, weight_decay):

    return Eva.from_config(params, opts.eva, model=model, base_optimizer="adamw", lr=lr, weight_decay=weight_decay)


def _onebit_lamb(opts, model, params, lr, weight_decay):

    return OneBitLamb.from_config(params, opts.onebit_lamb, lr=lr, weight_decay=weight_decay)


def _dpsgd(opts, model, params, lr, weight_decay):

    return DPSGD(
        params,
        topology=opts.gossip.topology,
        mode=opts.gossip.mode,
        base_optimizer="adamw",
        lr=lr,
        weight_decay=weight_decay,
        asynchronous=opts.gossip.asynchronous,
        max_staleness=opts.gossip.max_staleness,
    )


def _decentlam(opts, model, params, lr, weight_decay):

    return DecentLaM(
        params,
        lr=lr,
        momentum=opts.gossip.momentum,
        topology=opts.gossip.topology,
        weight_decay=weight_decay,
        asynchronous=opts.gossip.asynchronous,
        max_staleness=opts.gossip.max_staleness,
    )


def _diloco(opts, model, params, lr, weight_decay):

    d = opts.diloco
    return DiLoCo(
        params,
        base_optimizer="adamw",
        sync_every=d.sync_every,
        outer_lr=d.outer_lr,
        outer_momentum=d.outer_momentum,
        outer_exchange=d.outer_exchange,
        lr=lr,
        weight_decay=weight_decay,
    )


# --optimizer name -> (options, unwrapped model, trainable parameters, lr, weight decay) -> torch optimizer
OPTIMIZER_BUILDERS: dict[str, Callable] = {
    "adamw": _adamw,
    "eva": _eva,
    "onebit_lamb": _onebit_lamb,
    "dpsgd": _dpsgd,
    "decentlam": _decentlam,
    "diloco": _diloco,
}
OPTIMIZERS = tuple(OPTIMIZER_BUILDERS)
# optimizers that exchange gradients or parameters themselves (DDP runs its noop hook under them)
EXCHANGING = ("onebit_lamb", "dpsgd", "decentlam", "diloco")
# optimizers that gossip with neighbours (the gossip.* section; gossip.asynchronous)
GOSSIP_OPTIMIZERS = ("dpsgd", "decentlam")


def build_optimizer(opts: ComposeOptions, model, lr: float, weight_decay: float = 0.0):
    """The torch optimizer for ``opts.optimizer`` on ``model``'s trainable parameters (``model`` unwrapped)."""
    if opts.optimizer not in OPTIMIZER_BUILDERS:
        raise ValueError(f"optimizer={opts.optimizer!r} is unknown; use one of {', '.join(OPTIMIZER_BUILDERS)}.")
    params = [p for p in model.parameters() if p.requires_grad]
    return OPTIMIZER_BUILDERS[opts.optimizer](opts, model, params, lr, weight_decay)


def snapshot_config_for(config: SnapshotConfig, output_dir: str) -> SnapshotConfig:
    """The jobs' one default on top of the user's config: disk snapshots go under ``<output_dir>/snapshots`` when
    ``persist_every`` is set and ``persist_dir`` is not."""

    if config.persist_every and not config.persist_dir:
        return dataclasses.replace(config, persist_dir=os.path.join(output_dir, "snapshots"))
    return config


# job fields (and Trainer settings, in a fine-tuning job's ``training``) that do not change what is trained: left out
# of the run identity a snapshot records
NOT_IDENTITY = (
    "output_dir",
    "logging_steps",
    "progress",
    "report",
    "save_model",
    "fault_tolerance",
    "report_to",
    "disable_tqdm",
    "resume_from_checkpoint",
    "logging_dir",
    "logging_strategy",
    "run_name",
)


def run_identity(cfg) -> dict:
    """What identifies a job for its snapshots: every field of its config except how it reports and where it
    writes (``NOT_IDENTITY``); a restore into a job whose identity differs is refused naming the difference."""
    out = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_IDENTITY}
    if isinstance(out.get("training"), dict):
        out["training"] = {k: v for k, v in out["training"].items() if k not in NOT_IDENTITY}
    return out


def check_local_path(config, name: str, kinds: tuple = (".json", ".jsonl", ".txt", ".csv", ".parquet")) -> None:
    """``config.name`` names a local file or directory (a path separator, ``./``, or a data-file extension) that
    does not exist: a ``ValueError`` naming the field and the path, before anything starts (otherwise it would be
    taken for a hub id and fetched)."""

    value = getattr(config, name)
    if value is None:
        return
    # a hub id is "name" or "org/name"; anything else path-like is a local path
    looks_local = value.startswith(("/", "./", "../", "~")) or value.count("/") > 1 or value.lower().endswith(kinds)
    if looks_local and not os.path.exists(os.path.expanduser(value)):
        raise ValueError(
            f"{type(config).__name__}.{name}: {value} does not exist; set --{name.replace('_', '-')} "
            "to an existing local path or a hub id."
        )


def wire_bytes(comm_state=None, optimizer=None) -> dict | None:
    """Bytes per step of whatever exchanged gradients: the comm hook's state or an exchanging optimizer."""
    stats = getattr(comm_state, "stats", None) or getattr(optimizer, "stats", None)
    if stats is None:
        return None
    steps = list(stats.steps)
    return {
        "steps": len(steps),
        "bytes_per_step_mean": sum(steps) / max(1, len(steps)),
        "bytes_last_step": steps[-1] if steps else None,
    }
