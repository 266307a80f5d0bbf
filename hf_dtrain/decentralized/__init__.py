"""Decentralized and straggler-tolerant training: topologies with doubly stochastic mixing, neighbour gossip on
torch.distributed, and optimizers built on them (D-PSGD, DecentLaM, LSGD, AL-DSGD)."""

from .aldsgd import ALDSGD
from .decentlam import DecentLaM
from .dpsgd import DPSGD
from .gossip import consensus_distance, exchange, gossip
from .lsgd import LSGD
from .topology import MatchaTopology, Topology, metropolis_weights

__all__ = ["Topology", "MatchaTopology", "metropolis_weights", "gossip", "exchange", "consensus_distance", "DPSGD",
           "DecentLaM", "LSGD", "ALDSGD"]
