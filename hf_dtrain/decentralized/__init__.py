"""Decentralized and straggler-tolerant training: topologies with doubly stochastic mixing, neighbour gossip on
torch.distributed, and optimizers built on them (D-PSGD, DecentLaM, LSGD, AL-DSGD), the DiLoCo baseline with an optional
1-bit outer exchange, and Non-blocking SGD with a straggler injector."""

from .aldsgd import ALDSGD
from .config import DiLoCoConfig, GossipConfig
from .decentlam import DecentLaM
from .diloco import DiLoCo
from .dpsgd import DPSGD
from .gossip import consensus_distance, exchange, gossip
from .lsgd import LSGD
from .nonblocking import NonBlockingSGD, Straggler
from .topology import MatchaTopology, Topology, metropolis_weights

__all__ = [
    "ALDSGD",
    "DPSGD",
    "LSGD",
    "DecentLaM",
    "DiLoCo",
    "DiLoCoConfig",
    "GossipConfig",
    "MatchaTopology",
    "NonBlockingSGD",
    "Straggler",
    "Topology",
    "consensus_distance",
    "exchange",
    "gossip",
    "metropolis_weights",
]
