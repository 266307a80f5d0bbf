"""The optimizer section of the jobs (``--optimizer`` and each choice's settings section), and this folder's choices:
AdamW, Eva (``--eva.*``) and 1-bit LAMB (``--onebit-lamb.*``). Other folders register theirs in
:mod:`hf_dtrain.optimizers` (the decentralized optimizers)."""

from __future__ import annotations

from dataclasses import field

from hf_dtrain.optimizers import OPTIMIZER_CHOICES, OptimizerChoice, register_optimizer
from hf_dtrain.run.section import Clash, Section, register_section
from hf_dtrain.settings import SettingsError

from .config import EvaConfig, OneBitLambConfig

# the jobs' defaults where they differ from the engine's own: Eva's damping for transformers (docs/optim.md) and a
# shorter 1-bit LAMB warm-up for short fine-tuning runs
JOB_EVA = EvaConfig(damping=1e-6)
JOB_ONEBIT_LAMB = OneBitLambConfig(freeze_step=20)


def _adamw(settings, model, params, lr, weight_decay):
    import torch

    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def _eva(settings, model, params, lr, weight_decay):
    from .eva import Eva

    return Eva.from_config(params, settings, model=model, base_optimizer="adamw", lr=lr, weight_decay=weight_decay)


def _onebit_lamb(settings, model, params, lr, weight_decay):
    from .onebit_lamb import OneBitLamb

    return OneBitLamb.from_config(params, settings, lr=lr, weight_decay=weight_decay)


register_optimizer(OptimizerChoice("adamw", _adamw, help="adamw", order=0))
register_optimizer(
    OptimizerChoice(
        "eva",
        _eva,
        help="eva (preconditions AdamW, settings in eva.*)",
        settings="eva",
        defaults=JOB_EVA,
        settings_help="Eva's settings (used with optimizer=eva).",
        order=10,
    )
)
register_optimizer(
    OptimizerChoice(
        "onebit_lamb",
        _onebit_lamb,
        help="onebit_lamb (exchanges compressed gradients itself; settings in onebit_lamb.*)",
        settings="onebit_lamb",
        defaults=JOB_ONEBIT_LAMB,
        settings_help="1-bit LAMB's settings (used with optimizer=onebit_lamb).",
        exchanges=True,
        order=20,
    )
)


def _choice(cfg) -> OptimizerChoice:
    return OPTIMIZER_CHOICES[cfg.optimizer]


def _settings_of(cfg, choice: OptimizerChoice):
    return getattr(cfg, choice.settings) if choice.settings else None


def _own_optimizer(view) -> str | None:
    method = view.method
    if method is None or view.cfg.optimizer == "adamw":
        return None
    if not method.owns_optimizer(getattr(view.cfg, method.name, None)):
        return None
    return (
        f"two optimizers: --method {method.name} builds its own and --optimizer {view.cfg.optimizer} would replace "
        f"it; set {method.own_optimizer_off} to use {view.cfg.optimizer}"
    )


def _exchanging_alone(view) -> str | None:
    if view.fact("exchanging") and view.world_size < 2:
        return f"optimizer={view.cfg.optimizer} needs >= 2 processes; this run has 1"
    return None


def _eva_on_zero(view) -> str | None:
    stage = view.fact("zero_stage")
    if view.cfg.optimizer == "eva" and stage is not None and stage >= 1:
        return (
            f"optimizer=eva keeps per-layer vectors for full parameters; DeepSpeed ZeRO-{stage} partitions the "
            "optimizer (not supported)"
        )
    return None


@register_section
class OptimizerSection(Section):
    """``--optimizer``: the torch optimizer over the trainable parameters (the Trainer builds its own AdamW), or the
    fine-tuning method's own; an optimizer that exchanges gradients itself takes gradient clipping and DDP's buffer
    broadcast off the Trainer's hands."""

    name = "optimizer"
    order = 40
    clashes = (
        Clash(
            "a `--method` that builds its own optimizer (`--method lorafa`) with `--optimizer` other than adamw",
            "two optimizers; the method's own switch (`--lorafa.optimizer false`) picks the other",
            _own_optimizer,
        ),
        Clash("`--comm-hook` or an exchanging optimizer in one process", "nothing to exchange with", _exchanging_alone),
        Clash(
            "`--deepspeed` ZeRO ≥ 1 with Eva",
            "Eva needs whole parameters' gradients; ZeRO partitions the optimizer",
            _eva_on_zero,
        ),
    )

    @classmethod
    def settings(cls):
        names = ", ".join(c.help or c.name for c in OPTIMIZER_CHOICES.values())
        out = [
            (
                "optimizer",
                str,
                field(
                    default="adamw",
                    metadata={
                        "help": f"{names}. The exchanging ones need >= 2 processes (DDP runs its noop hook under them)."
                    },
                ),
            )
        ]
        seen = set()
        for c in OPTIMIZER_CHOICES.values():
            if c.settings and c.settings not in seen:
                seen.add(c.settings)
                default = field(default_factory=c.default_settings, metadata={"help": c.settings_help})
                out.append((c.settings, c.settings_type, default))
        return out

    @classmethod
    def validate(cls, cfg) -> None:
        if cfg.optimizer not in OPTIMIZER_CHOICES:
            raise SettingsError(
                f"optimizer={cfg.optimizer!r} is unknown; set --optimizer to one of {', '.join(OPTIMIZER_CHOICES)}."
            )
        users: dict[str, list[str]] = {}
        for c in OPTIMIZER_CHOICES.values():
            if c.settings:
                users.setdefault(c.settings, []).append(c.name)
        for settings, names in users.items():
            choice = OPTIMIZER_CHOICES[names[0]]
            default = choice.default_settings()
            if getattr(cfg, settings) != default and cfg.optimizer not in names:
                raise SettingsError(
                    f"{settings}.* settings are given but optimizer={cfg.optimizer}; set --optimizer "
                    f"{' or '.join(names)}, or drop the {settings} settings."
                )

    @classmethod
    def facts(cls, cfg) -> dict:
        choice = _choice(cfg)
        return {
            "exchanging": choice.exchanges,
            "asynchronous": bool(choice.asynchronous(_settings_of(cfg, choice))),
        }

    @classmethod
    def active(cls, view) -> bool:
        return True

    def __init__(self, run) -> None:
        super().__init__(run)
        self.choice = _choice(self.cfg)
        self.built = None

    def trainer_args(self, given: dict) -> dict:
        own = self.run.method is not None and self.run.method.owns_optimizer(self.run.method_settings)
        out = {}
        if "optim" in given and (self.cfg.optimizer != "adamw" or own):
            own_name = f"{self.run.method.name}'s own optimizer" if own else ""
            other = f"--optimizer {self.cfg.optimizer}" if self.cfg.optimizer != "adamw" else own_name
            off = f" and {self.run.method.own_optimizer_off}" if own else ""
            raise SettingsError(
                f"--optim {given['optim']} is the Trainer's optimizer, and {other} would replace it silently: drop "
                f"--optim, or use it with --optimizer adamw{off}."
            )
        if self.choice.exchanges:  # it never averages the gradients: clipping local ones would be wrong
            if given.get("max_grad_norm", 0) not in (0, 0.0, None):
                raise SettingsError(
                    f"max_grad_norm={given['max_grad_norm']}: with --optimizer {self.cfg.optimizer} the gradients are "
                    "not averaged at clipping time; set --max-grad-norm 0."
                )
            out["max_grad_norm"] = 0.0
        if self.run.view.fact("asynchronous"):  # a buffer broadcast in every forward would synchronise every step
            out["ddp_broadcast_buffers"] = False
        return out

    def accelerator_kwargs(self) -> list:
        if not self.run.view.fact("asynchronous"):
            return []
        from accelerate.utils import DistributedDataParallelKwargs

        return [DistributedDataParallelKwargs(broadcast_buffers=False)]

    def optimizer(self, model, lr: float, weight_decay: float):
        """The method's own optimizer when it has one on; else ``--optimizer``'s (None for adamw under the Trainer,
        which builds its own)."""
        method = self.run.method
        if method is not None and method.owns_optimizer(self.run.method_settings):
            self.built = method.build_optimizer(self.run.method_settings, model, lr, weight_decay)
        elif self.run.trainer and self.cfg.optimizer == "adamw":
            self.built = None
        else:
            params = [p for p in model.parameters() if p.requires_grad]
            self.built = self.choice.build(_settings_of(self.cfg, self.choice), model, params, lr, weight_decay)
        return self.built

    def end(self) -> None:
        from hf_dtrain.distributed.engines import unwrap_optimizer

        inner = unwrap_optimizer(self.built) if self.built is not None else None
        if hasattr(inner, "finish"):  # asynchronous gossip: the last messages, on every rank
            inner.finish()

    def results(self) -> dict:
        if not self.choice.exchanges:
            return {}
        from hf_dtrain.distributed.counters import wire_summary
        from hf_dtrain.distributed.engines import unwrap_optimizer

        return {self.run.wire_key: wire_summary(unwrap_optimizer(self.built))}
