"""The optimizers' settings as typed configs: ``EvaConfig`` and ``OneBitLambConfig``. The optimizers build and
validate one from their keyword arguments (torch style: ``Eva(model, damping=0.03)``); the jobs hold one per
optimizer (``--eva.<field>``, ``--onebit-lamb.<field>``; YAML sections ``eva:`` and ``onebit_lamb:``) and pass it
with ``Eva.from_config`` / ``OneBitLamb.from_config``. Learning rate and weight decay are the job's, not these."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from hf_dtrain.errors import SettingsError
from hf_dtrain.settings import check_choice, check_fields

EVA_METHODS = ("eva", "foof")


@dataclass
class EvaConfig:
    """Eva / vectorized FOOF preconditioning settings (validated on construction)."""

    section_key: ClassVar[str] = "eva"  # flags --eva.<field>, YAML eva:

    damping: float = field(
        default=0.03,
        metadata={
            "gt": 0,
            "why": "the paper uses 0.03",
            "help": "Damping gamma > 0 of the Sherman-Morrison inverse (0.03 in the paper; the jobs use 1e-6 for "
            "transformers, see docs/optim.md).",
        },
    )
    kl_clip: float = field(
        default=0.001,
        metadata={
            "min": 0,
            "why": "0.001 in the paper; 0 rescales to the gradient norm",
            "help": "KL clipping kappa >= 0 of the preconditioned update (0: rescale to the raw gradient's norm).",
        },
    )
    factor_decay: float = field(
        default=0.95,
        metadata={
            "gt": 0,
            "max": 1,
            "why": "the paper uses 0.95",
            "help": "Running-average decay in (0, 1] of the activation and gradient vectors.",
        },
    )
    update_interval: int = field(
        default=1,
        metadata={"min": 1, "why": "1: every step", "help": "Collect the vectors every N steps (reused in between)."},
    )
    method: str = field(default="eva", metadata={"help": "eva or foof (vectorized FOOF: activations only)."})
    exclude: list[str] = field(
        default_factory=lambda: ["lm_head"],
        metadata={"help": "Module names (substrings) left to the wrapped optimizer's plain update."},
    )

    def __post_init__(self):
        check_fields(self)
        check_choice(self, "method", EVA_METHODS, "eva.method")
        self.exclude = list(self.exclude)


@dataclass
class OneBitLambConfig:
    """1-bit LAMB settings (DeepSpeed's defaults, with a shorter ``freeze_step``; validated on construction)."""

    section_key: ClassVar[str] = "onebit_lamb"  # flags --onebit-lamb.<field>, YAML onebit_lamb:

    freeze_step: int = field(
        default=100,
        metadata={
            "min": 1,
            "why": "plain LAMB warm-up steps before the momenta are compressed",
            "help": "Plain LAMB warm-up steps before the momenta are compressed to 1 bit.",
        },
    )
    betas: tuple[float, float] = field(default=(0.9, 0.999), metadata={"help": "Adam moment decays (two numbers)."})
    eps: float = field(default=1e-8, metadata={"help": "Denominator epsilon."})
    max_coeff: float = field(default=10.0, metadata={"help": "Upper clip of the LAMB trust ratio."})
    min_coeff: float = field(default=0.01, metadata={"help": "Lower clip of the LAMB trust ratio."})
    coeff_beta: float = field(default=0.9, metadata={"help": "Decay of the running trust ratio frozen at freeze_step."})
    factor_max: float = field(default=4.0, metadata={"help": "Upper clip of the compression-stage scaling factor."})
    factor_min: float = field(default=0.5, metadata={"help": "Lower clip of the compression-stage scaling factor."})
    factor_threshold: float = field(
        default=0.1, metadata={"help": "Largest relative change of the scaling factor per step."}
    )
    mask_threshold: float = field(
        default=1e-4,
        metadata={"min": 0, "help": "Variance entries below this are not updated in the compression stage (>= 0)."},
    )
    scale_block: int | None = field(
        default=2048,
        metadata={
            "min": 1,
            "why": "one scale per that many elements; None: one per rank's chunk",
            "help": "One 1-bit scale per this many elements; None: one per rank's chunk (DeepSpeed).",
        },
    )

    def __post_init__(self):
        check_fields(self)
        self.betas = tuple(self.betas)
        if len(self.betas) != 2 or not (0 <= self.betas[0] < 1 and 0 <= self.betas[1] < 1):
            raise SettingsError(
                f"OneBitLamb betas must be two numbers in [0, 1), got {self.betas!r}; set onebit_lamb.betas."
            )
        if not 0 < self.min_coeff <= self.max_coeff:
            raise SettingsError(
                f"OneBitLamb needs 0 < min_coeff <= max_coeff, got {self.min_coeff!r}, "
                f"{self.max_coeff!r}; set onebit_lamb.min_coeff / max_coeff."
            )


def config_kwargs(config) -> dict:
    """A config's fields as keyword arguments (for the optimizers' ``from_config``)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
