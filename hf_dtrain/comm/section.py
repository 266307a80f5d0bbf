"""The communication-hook section of the jobs (``--comm-hook.*``): the hook on the DDP model (through the Trainer's
callback, or after Accelerate prepared the model in a plain loop), DDP's noop hook under an optimizer that exchanges
gradients itself, and under HSDP the compressed exchange across FSDP2's replica groups."""

from __future__ import annotations

from dataclasses import field

from hf_dtrain.run.section import Clash, Section, register_section
from hf_dtrain.settings import SettingsError

from .config import FSDP_METHODS, FSDP_REFUSALS, CommHookConfig


def _method(view) -> str | None:
    hook = view.cfg.comm_hook
    return None if hook is None else hook.method


def _second_exchange(view) -> str | None:
    if _method(view) and view.fact("exchanging"):
        return (
            f"optimizer={view.cfg.optimizer} exchanges gradients/parameters itself (DDP runs the noop hook) and "
            f"comm_hook={_method(view)} would be a second exchange: drop --comm-hook, or use --optimizer adamw/eva "
            "with the hook"
        )
    return None


def _alone(view) -> str | None:
    if _method(view) and view.world_size < 2:
        return (
            f"comm_hook={_method(view)} needs >= 2 processes; this run has 1 (accelerate launch / torchrun, or leave "
            "--comm-hook out)"
        )
    return None


def _dear_with_snapshots(view) -> str | None:
    if _method(view) == "dear" and getattr(view.cfg, "fault_tolerance", None) is not None:
        return (
            "comm_hook=dear defers each update into the next forward, so a snapshot at the step boundary would miss "
            "it: use another hook with --fault-tolerance"
        )
    return None


def _fsdp_without_replicas(view) -> str | None:
    fsdp = getattr(view.cfg, "fsdp", None)
    if _method(view) and fsdp is not None and fsdp.replicate < 2:
        return (
            f"comm_hook={_method(view)} with fsdp: FSDP2 has no DDP hooks, and a comm hook there compresses the "
            "exchange across HSDP replica groups, which fsdp.replicate=1 does not have: set --fsdp.replicate N "
            "(N >= 2 groups of processes, e.g. one per node), or drop --comm-hook"
        )
    return None


def _fsdp_cannot_carry(view) -> str | None:
    fsdp = getattr(view.cfg, "fsdp", None)
    method = _method(view)
    if method and fsdp is not None and fsdp.replicate >= 2 and method not in FSDP_METHODS:
        return (
            f"comm_hook={method} cannot carry FSDP2's replica exchange: {FSDP_REFUSALS.get(method, 'not built')}; "
            f"use --comm-hook {' / '.join(FSDP_METHODS)} with --fsdp.replicate, or drop --comm-hook"
        )
    return None


@register_section
class CommHookSection(Section):
    """``--comm-hook``: a DDP communication hook, or the compressed exchange across HSDP's replica groups; also DDP's
    noop hook under an optimizer that exchanges gradients itself (``exchanging``)."""

    name = "comm_hook"
    order = 60
    carries_replica_exchange = True
    clashes = (
        Clash(
            "`--comm-hook` with `--optimizer onebit_lamb\\|dpsgd\\|decentlam\\|diloco`",
            "two gradient exchanges: the optimizer exchanges itself under DDP's noop hook",
            _second_exchange,
        ),
        Clash("`--comm-hook` or an exchanging optimizer in one process", "nothing to exchange with", _alone),
        Clash(
            "`--fault-tolerance` with `--comm-hook dear`",
            "DeAR defers each update into the next forward, so a snapshot at the step boundary would miss it",
            _dear_with_snapshots,
        ),
        Clash(
            "`--fsdp` with a comm hook and `fsdp.replicate` 1",
            "FSDP2 has no DDP to hook; a comm hook compresses the exchange across HSDP replica groups, and there is "
            "none: set `--fsdp.replicate N`",
            _fsdp_without_replicas,
        ),
        Clash(
            "`--fsdp.replicate N` with `--comm-hook dear\\|embrace\\|s2_reducer\\|noop`",
            "FSDP2 already splits the all-reduce as DeAR does; EmbRace needs replicated embedding tables; the S2 "
            "Reducer sketches sparse whole gradients, and the replica exchange carries dense row shards. `allreduce`, "
            "`bf16`, `fp16` and `acp_sgd` are taken ([sharded.md](sharded.md#hsdp-compressing-the-exchange-across-"
            "nodes))",
            _fsdp_cannot_carry,
        ),
    )

    @classmethod
    def settings(cls):
        help = "Gradient communication under DDP (hf_dtrain.comm; >= 2 processes); None: DDP's own all-reduce."
        return [("comm_hook", CommHookConfig | None, field(default=None, metadata={"help": help}))]

    @classmethod
    def active(cls, view) -> bool:
        return view.cfg.comm_hook is not None or bool(view.fact("exchanging"))

    @classmethod
    def empty_results(cls, trainer: bool) -> dict:
        return {"comm" if trainer else "wire": None}

    def __init__(self, run) -> None:
        super().__init__(run)
        # an optimizer that exchanges itself: gradients stay local (DDP's noop hook), its own bytes are reported
        self.hook = self.cfg.comm_hook if self.cfg.comm_hook is not None else "noop"
        self.method = self.cfg.comm_hook.method if self.cfg.comm_hook is not None else "noop"
        self.callback = None  # the Trainer's
        self.hook_state = None  # a plain loop's, or the HSDP exchange's

    def trainer_args(self, given: dict) -> dict:
        if self.method != "dear":
            return {}
        # DeAR averages the gradients after step() is called: clipping the local ones would be wrong
        if given.get("max_grad_norm", 0) not in (0, 0.0, None):
            raise SettingsError(
                f"max_grad_norm={given['max_grad_norm']}: with --comm-hook dear the gradients are not averaged at "
                "clipping time; set --max-grad-norm 0."
            )
        return {"max_grad_norm": 0.0}

    def prepare(self, model) -> None:
        if self.run.replica_group is not None:  # HSDP: FSDP2 sharded within the groups; the exchange runs across
            from .fsdp import register_fsdp

            self.hook_state = register_fsdp(model, self.cfg.comm_hook, self.run.replica_group)

    def attach(self, trainer) -> None:
        if not self.run.sharded:
            from .trainer import CommHookCallback

            self.callback = CommHookCallback.attach(trainer, self.hook)

    def after_prepare(self, model, optimizer) -> None:
        if not self.run.sharded:
            from .hooks import register

            hooked = register(model, self.hook, optimizer=optimizer if self.method != "noop" else None)
            self.hook_state = hooked if self.method != "noop" else None

    def state(self) -> dict:
        holder = self.callback if self.callback is not None else self.hook_state
        return {"comm_hook": holder} if hasattr(holder, "state_dict") else {}

    def results(self) -> dict:
        if self.method == "noop":  # the exchanging optimizer reports its own bytes
            return {}
        from hf_dtrain.distributed.counters import wire_summary

        if not self.run.trainer:
            return {"wire": wire_summary(self.hook_state)}
        if self.callback is not None:
            return {"comm": self.callback.summary()}
        summary = wire_summary(self.hook_state)
        return {"comm": None if summary is None else {"method": self.method, **summary}}
