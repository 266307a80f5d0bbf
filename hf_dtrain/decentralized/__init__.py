"""Decentralized and straggler-tolerant training: topologies with doubly stochastic mixing, neighbour gossip on
torch.distributed, and optimizers built on them (D-PSGD, DecentLaM, LSGD, AL-DSGD), the DiLoCo baseline with an optional
1-bit outer exchange, and Non-blocking SGD with a straggler injector."""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    submod_attrs={
        "aldsgd": ["ALDSGD"],
        "config": ["DiLoCoConfig", "GossipConfig"],
        "decentlam": ["DecentLaM"],
        "diloco": ["DiLoCo"],
        "dpsgd": ["DPSGD"],
        "gossip": ["consensus_distance", "exchange", "gossip"],
        "lsgd": ["LSGD"],
        "nonblocking": ["NonBlockingSGD", "Straggler"],
        "topology": ["MatchaTopology", "Topology", "metropolis_weights"],
    },
)
