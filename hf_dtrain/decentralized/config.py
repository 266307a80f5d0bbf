"""``GossipConfig``: the settings the jobs pass to the decentralized optimizers (``--gossip.<field>``, YAML section
``gossip:``); D-PSGD and DecentLaM take them as keywords too."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from hf_dtrain.settings import check_choice, check_fields

OUTER_EXCHANGES = ("none", "int8", "1bit")  # DiLoCo's outer exchange (diloco.py)


TOPOLOGIES = ("ring", "torus", "exponential", "fully_connected", "matcha")
MODES = ("atc", "cta")


@dataclass
class GossipConfig:
    """Decentralized optimizer settings (validated on construction)."""

    section_key: ClassVar[str] = "gossip"  # flags --gossip.<field>, YAML gossip:

    topology: str = field(
        default="ring",
        metadata={
            "help": "Communication graph: ring, torus, exponential, fully_connected, or matcha (time-varying matchings "
            "of a torus)."
        },
    )
    momentum: float = field(default=0.9, metadata={"min": 0, "lt": 1, "help": "decentlam: momentum beta in [0, 1)."})
    mode: str = field(
        default="atc",
        metadata={"help": "dpsgd: atc (adapt, then combine with the neighbours) or cta (combine, then adapt)."},
    )

    asynchronous: bool = field(
        default=False,
        metadata={
            "help": "dpsgd / decentlam: asynchronous gossip (AD-PSGD style): each rank mixes the newest values its "
            "neighbours have sent and waits only for one older than max_staleness of its own steps, so a "
            "straggler slows only itself (static topologies)."
        },
    )
    max_staleness: int = field(
        default=4,
        metadata={
            "min": 1,
            "help": "asynchronous gossip: the most steps of this rank a neighbour's value may be old before it waits.",
        },
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

    sync_every: int = field(
        default=16,
        metadata={"min": 1, "help": "H: inner steps between two outer steps (one model-sized exchange per H steps)."},
    )
    outer_lr: float = field(default=0.7, metadata={"gt": 0, "help": "The outer SGD's learning rate (the paper's 0.7)."})
    outer_momentum: float = field(
        default=0.9,
        metadata={
            "min": 0,
            "lt": 1,
            "help": "The outer SGD's Nesterov momentum (the paper's 0.9; 0: plain averaging step).",
        },
    )
    outer_exchange: str = field(
        default="none",
        metadata={
            "help": "none (fp32 all-reduce of the pseudo-gradient: DiLoCo as published), int8 (int8 with a scale per "
            "2048 values, error feedback) or 1bit (1-bit LAMB's compressed all-reduce, error feedback)."
        },
    )

    def __post_init__(self):
        check_fields(self)
        check_choice(self, "outer_exchange", OUTER_EXCHANGES, "diloco.outer_exchange")
