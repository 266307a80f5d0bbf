"""Composing hf_dtrain's parts in one run: the switches ``hf-dtrain pretrain`` and ``hf-dtrain finetune`` share, the
check that refuses combinations that clash (naming the clash and the fix), and the builders both jobs use.

    opts = ComposeOptions(comm_hook="acp_sgd", delta_budget=0.5, fault_tolerance=True)
    opts.check(world_size=4, engine="accelerate")          # ValueError naming any clash
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Optional

OPTIMIZERS = ("adamw", "eva", "onebit_lamb", "dpsgd", "decentlam")
# optimizers that exchange gradients or parameters themselves (DDP runs its noop hook under them)
EXCHANGING = ("onebit_lamb", "dpsgd", "decentlam")
ENGINES = ("accelerate", "trainer")


@dataclass
class ComposeOptions:
    """Switches for the parts of hf_dtrain; every field is a flag of ``pretrain`` and ``finetune`` and a YAML key."""

    comm_hook: Optional[str] = field(default=None, metadata={
        "help": "Gradient communication under DDP (hf_dtrain.comm): acp_sgd, s2_reducer, dear, embrace or allreduce "
                "(dense, counted); None: DDP's own all-reduce. Needs >= 2 processes."})
    comm_rank: int = field(default=4, metadata={"help": "acp_sgd: rank of the P/Q factors."})
    comm_start_iter: int = field(default=10, metadata={"help": "acp_sgd: uncompressed all-reduce steps first (>= 2)."})
    optimizer: str = field(default="adamw", metadata={
        "help": f"One of {', '.join(OPTIMIZERS)}: eva preconditions AdamW; onebit_lamb, dpsgd and decentlam exchange "
                "gradients/parameters themselves (>= 2 processes)."})
    topology: str = field(default="ring", metadata={"help": "dpsgd/decentlam: ring, torus, exponential or complete."})
    onebit_freeze_step: int = field(default=20, metadata={"help": "onebit_lamb: LAMB warm-up steps before 1-bit."})
    eva_damping: float = field(default=1e-6, metadata={"help": "eva: damping (1e-6 for transformers, see docs)."})
    delta_budget: Optional[float] = field(default=None, metadata={
        "help": "DELTA memory budget for saved activations: a fraction in (0, 1] of the no-saving bytes, or bytes "
                "(> 1); None: off."})
    delta_granularity: str = field(default="layer", metadata={"help": "DELTA planning unit: layer or submodule."})
    fault_tolerance: bool = field(default=False, metadata={
        "help": "In-memory snapshots held by a snapshot process per node, erasure coded across nodes; a relaunched "
                "run resumes from them."})
    ft_every: int = field(default=1, metadata={"help": "Snapshot every N optimizer steps."})
    ft_parity: int = field(default=1, metadata={"help": "Lost nodes to survive (erasure coding across nodes)."})
    ft_persist_every: int = field(default=0, metadata={"help": "Also write every N-th snapshot to disk (0: never)."})
    ft_dir: Optional[str] = field(default=None, metadata={"help": "Directory of the snapshot processes."})
    hetero_speeds: Optional[list[float]] = field(default=None, metadata={
        "help": "Heterogeneity-aware sampler: relative speed of each rank (one per process); None: even shards."})
    deepspeed: Optional[str] = field(default=None, metadata={
        "help": "DeepSpeed config JSON (finetune: passed to the Trainer); checked against the other switches."})

    def compose_fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(ComposeOptions)}

    def deepspeed_stage(self) -> Optional[int]:
        if not self.deepspeed:
            return None
        with open(self.deepspeed) as f:
            cfg = json.load(f)
        return int(cfg.get("zero_optimization", {}).get("stage", 0))

    def validate(self) -> None:
        """Checks that need no world: names, ranges."""
        from hf_dtrain.comm import METHODS as COMM_METHODS

        if self.comm_hook is not None and self.comm_hook not in COMM_METHODS:
            raise ValueError(f"comm_hook={self.comm_hook!r} is unknown; set --comm-hook to one of "
                             f"{', '.join(COMM_METHODS)} (or leave it out).")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r} is unknown; set --optimizer to one of "
                             f"{', '.join(OPTIMIZERS)}.")
        if self.delta_budget is not None and not self.delta_budget > 0:
            raise ValueError(f"delta_budget must be > 0 (a fraction in (0, 1] or bytes), got {self.delta_budget!r}.")
        if self.delta_granularity not in ("layer", "submodule"):
            raise ValueError(f"delta_granularity must be layer or submodule, got {self.delta_granularity!r}.")
        for name in ("ft_every", "comm_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}.")
        if self.ft_parity < 0 or self.ft_persist_every < 0:
            raise ValueError("ft_parity and ft_persist_every must be >= 0.")
        if isinstance(self.hetero_speeds, str):
            self.hetero_speeds = [float(s) for s in self.hetero_speeds.split(",") if s.strip()]

    def check(self, world_size: int, engine: str, lorafa_optimizer: bool = False) -> None:
        """Refuse combinations that clash, with a ``ValueError`` naming both sides and what to change."""
        self.validate()
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        clashes = []
        if self.comm_hook is not None and self.optimizer in EXCHANGING:
            clashes.append(f"optimizer={self.optimizer} exchanges gradients/parameters itself (DDP runs the noop "
                           f"hook) and comm_hook={self.comm_hook} would be a second exchange: drop --comm-hook, or use "
                           "--optimizer adamw/eva with the hook")
        if world_size < 2:
            if self.comm_hook is not None:
                clashes.append(f"comm_hook={self.comm_hook} needs >= 2 processes; this run has 1 (accelerate "
                               "launch / torchrun, or leave --comm-hook out)")
            if self.optimizer in EXCHANGING:
                clashes.append(f"optimizer={self.optimizer} needs >= 2 processes; this run has 1")
        if lorafa_optimizer and self.optimizer != "adamw":
            clashes.append(f"two optimizers: --method lorafa builds its own (create_lorafa_optimizer) and "
                           f"--optimizer {self.optimizer} would replace it; set --lorafa-optimizer false to use "
                           f"{self.optimizer}")
        if self.fault_tolerance and self.comm_hook == "dear":
            clashes.append("comm_hook=dear defers each update into the next forward, so a snapshot at the step "
                           "boundary would miss it: use another hook with --fault-tolerance")
        if self.hetero_speeds is not None:
            if engine == "trainer":
                clashes.append("hetero_speeds: the Trainer shards its loader again through Accelerate, so the "
                               "heterogeneity-aware sampler cannot be used with it; use hf-dtrain pretrain (an "
                               "Accelerate loop) or drop --hetero-speeds")
            elif len(self.hetero_speeds) != world_size:
                clashes.append(f"hetero_speeds has {len(self.hetero_speeds)} values for {world_size} processes; "
                               "give one speed per process")
        stage = self.deepspeed_stage()
        if stage is not None:
            if engine != "trainer":
                clashes.append("deepspeed: hf-dtrain pretrain runs DDP through Accelerate; DeepSpeed configs are "
                               "taken by hf-dtrain finetune (the Trainer)")
            if self.comm_hook is not None:
                clashes.append(f"comm_hook={self.comm_hook} is a DDP communication hook and DeepSpeed ZeRO-{stage} "
                               "replaces DDP (its own reduce/reduce-scatter): drop --comm-hook, or use "
                               "hf_dtrain.comm.register_deepspeed with ZeRO stage 0 from Python")
            if self.optimizer in EXCHANGING:
                clashes.append(f"optimizer={self.optimizer} needs DDP's noop hook; DeepSpeed ZeRO-{stage} does its "
                               "own gradient exchange")
            if self.optimizer == "eva" and stage >= 1:
                clashes.append(f"optimizer=eva keeps per-layer vectors for full parameters; DeepSpeed ZeRO-{stage} "
                               "partitions the optimizer (not supported)")
            if self.delta_budget is not None and stage == 3:
                clashes.append("delta_budget with DeepSpeed ZeRO-3: ZeRO-3 gathers parameters in module hooks that "
                               "DELTA's recompute would run again (not supported)")
            if self.fault_tolerance and stage >= 1:
                clashes.append(f"fault_tolerance with DeepSpeed ZeRO-{stage}: snapshotting partitioned optimizer state "
                               "is not supported yet; use DDP (no --deepspeed) or ZeRO stage 0")
        if clashes:
            raise ValueError("These switches cannot be combined: " + "; ".join(clashes) + ".")


def build_optimizer(opts: ComposeOptions, model, lr: float, weight_decay: float = 0.0):
    """The torch optimizer for ``opts.optimizer`` on ``model``'s trainable parameters (``model`` unwrapped)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if opts.optimizer == "adamw":
        import torch

        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if opts.optimizer == "eva":
        from hf_dtrain.optim import Eva

        return Eva(params, model=model, base_optimizer="adamw", lr=lr, damping=opts.eva_damping,
                   weight_decay=weight_decay)
    if opts.optimizer == "onebit_lamb":
        from hf_dtrain.optim import OneBitLamb

        return OneBitLamb(params, lr=lr, freeze_step=opts.onebit_freeze_step, weight_decay=weight_decay)
    if opts.optimizer == "dpsgd":
        from hf_dtrain.decentralized import DPSGD

        return DPSGD(params, topology=opts.topology, base_optimizer="adamw", lr=lr, weight_decay=weight_decay)
    from hf_dtrain.decentralized import DecentLaM

    return DecentLaM(params, lr=lr, topology=opts.topology, weight_decay=weight_decay)


def wire_bytes(comm_state=None, optimizer=None) -> Optional[dict]:
    """Bytes per step of whatever exchanged gradients: the comm hook's state or an exchanging optimizer."""
    stats = getattr(comm_state, "stats", None) or getattr(optimizer, "stats", None)
    if stats is None:
        return None
    steps = list(stats.steps)
    return {"steps": len(steps), "bytes_per_step_mean": sum(steps) / max(1, len(steps)),
            "bytes_last_step": steps[-1] if steps else None}
