"""The optimizers' settings as typed configs: ``EvaConfig`` and ``OneBitLambConfig``. The optimizers build and
validate one from their keyword arguments (torch style: ``Eva(model, damping=0.03)``); the jobs hold one per
optimizer (``--eva.<field>``, ``--onebit-lamb.<field>``; YAML sections ``eva:`` and ``onebit_lamb:``) and pass it
with ``Eva.from_config`` / ``OneBitLamb.from_config``. Learning rate and weight decay are the job's, not these."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from hf_dtrain.errors import SettingsError
from hf_dtrain.settings import check_choice, check_fields, setting

EVA_METHODS = ("eva", "foof")


@dataclass
class EvaConfig:
    """Eva / vectorized FOOF preconditioning settings (validated on construction)."""

    section_key: ClassVar[str] = "eva"  # flags --eva.<field>, YAML eva:

    damping: float = setting(
        0.03,
        "Damping gamma > 0 of the Sherman-Morrison inverse (0.03 in the paper; the jobs use 1e-6 for "
        "transformers, see docs/optim.md).",
        gt=0,
        why="the paper uses 0.03",
    )
    kl_clip: float = setting(
        0.001,
        "KL clipping kappa >= 0 of the preconditioned update (0: rescale to the raw gradient's norm).",
        min=0,
        why="0.001 in the paper; 0 rescales to the gradient norm",
    )
    factor_decay: float = setting(
        0.95,
        "Running-average decay in (0, 1] of the activation and gradient vectors.",
        gt=0,
        max=1,
        why="the paper uses 0.95",
    )
    update_interval: int = setting(
        1, "Collect the vectors every N steps (reused in between).", min=1, why="1: every step"
    )
    method: str = setting("eva", "eva or foof (vectorized FOOF: activations only).")
    exclude: list[str] = setting(
        help="Module names (substrings) left to the wrapped optimizer's plain update.", factory=lambda: ["lm_head"]
    )

    def __post_init__(self):
        check_fields(self)
        check_choice(self, "method", EVA_METHODS, "eva.method")
        self.exclude = list(self.exclude)


@dataclass
class OneBitLambConfig:
    """1-bit LAMB settings (DeepSpeed's defaults, with a shorter ``freeze_step``; validated on construction)."""

    section_key: ClassVar[str] = "onebit_lamb"  # flags --onebit-lamb.<field>, YAML onebit_lamb:

    freeze_step: int = setting(
        100,
        "Plain LAMB warm-up steps before the momenta are compressed to 1 bit.",
        min=1,
        why="plain LAMB warm-up steps before the momenta are compressed",
    )
    betas: tuple[float, float] = setting((0.9, 0.999), "Adam moment decays (two numbers).")
    eps: float = setting(1e-8, "Denominator epsilon.")
    max_coeff: float = setting(10.0, "Upper clip of the LAMB trust ratio.")
    min_coeff: float = setting(0.01, "Lower clip of the LAMB trust ratio.")
    coeff_beta: float = setting(0.9, "Decay of the running trust ratio frozen at freeze_step.")
    factor_max: float = setting(4.0, "Upper clip of the compression-stage scaling factor.")
    factor_min: float = setting(0.5, "Lower clip of the compression-stage scaling factor.")
    factor_threshold: float = setting(0.1, "Largest relative change of the scaling factor per step.")
    mask_threshold: float = setting(
        1e-4, "Variance entries below this are not updated in the compression stage (>= 0).", min=0
    )
    scale_block: int | None = setting(
        2048,
        "One 1-bit scale per this many elements; None: one per rank's chunk (DeepSpeed).",
        min=1,
        why="one scale per that many elements; None: one per rank's chunk",
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
