"""``GossipConfig``: the settings the jobs pass to the decentralized optimizers (``--gossip.<field>``, YAML section
``gossip:``); D-PSGD and DecentLaM take them as keywords too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hf_dtrain.settings import check_choice, check_fields, setting

OUTER_EXCHANGES = ("none", "int8", "1bit")  # DiLoCo's outer exchange (diloco.py)


TOPOLOGIES = ("ring", "torus", "exponential", "fully_connected", "matcha")
MODES = ("atc", "cta")


@dataclass
class GossipConfig:
    """Decentralized optimizer settings (validated on construction)."""

    section_key: ClassVar[str] = "gossip"  # flags --gossip.<field>, YAML gossip:

    topology: str = setting(
        "ring",
        "Communication graph: ring, torus, exponential, fully_connected, or matcha (time-varying matchings "
        "of a torus).",
    )
    momentum: float = setting(0.9, "decentlam: momentum beta in [0, 1).", min=0, lt=1)
    mode: str = setting("atc", "dpsgd: atc (adapt, then combine with the neighbours) or cta (combine, then adapt).")

    asynchronous: bool = setting(
        False,
        "dpsgd / decentlam: asynchronous gossip (AD-PSGD style): each rank mixes the newest values its "
        "neighbours have sent and waits only for one older than max_staleness of its own steps, so a "
        "straggler slows only itself (static topologies).",
    )
    max_staleness: int = setting(
        4, "asynchronous gossip: the most steps of this rank a neighbour's value may be old before it waits.", min=1
    )

    def __post_init__(self):
        check_fields(self)
        check_choice(self, "topology", TOPOLOGIES, "gossip.topology")
        check_choice(self, "mode", MODES, "gossip.mode")


@dataclass
class DiLoCoConfig:
    """DiLoCo's settings (``--diloco.<field>``, YAML section ``diloco:``); the inner optimizer is the job's AdamW at
    its learning rate."""

    section_key: ClassVar[str] = "diloco"

    sync_every: int = setting(
        16, "H: inner steps between two outer steps (one model-sized exchange per H steps).", min=1
    )
    outer_lr: float = setting(0.7, "The outer SGD's learning rate (the paper's 0.7).", gt=0)
    outer_momentum: float = setting(
        0.9, "The outer SGD's Nesterov momentum (the paper's 0.9; 0: plain averaging step).", min=0, lt=1
    )
    outer_exchange: str = setting(
        "none",
        "none (fp32 all-reduce of the pseudo-gradient: DiLoCo as published), int8 (int8 with a scale per "
        "2048 values, error feedback) or 1bit (1-bit LAMB's compressed all-reduce, error feedback).",
    )

    def __post_init__(self):
        check_fields(self)
        check_choice(self, "outer_exchange", OUTER_EXCHANGES, "diloco.outer_exchange")
