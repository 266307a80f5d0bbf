"""Federated fine-tuning with peft adapters as the payload (FedML Parrot-style simulation).

* :class:`FederatedConfig`, :class:`FederatedSimulation`: N clients simulated on P processes, clients trained one
  after another on each process, local then global aggregation, speed-aware client scheduling, per-client state;
* :func:`dirichlet_split`: non-IID client data;
* :func:`local_aggregate` / :func:`global_average` / :func:`flat_average`: Parrot's two-step aggregation;
* :func:`compress_delta`: the int8 / low-rank uplink with error feedback and byte counts;
* :class:`ClientStateStore`: the client state manager (safetensors, owner-only).
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    submod_attrs={
        "aggregate": ["flat_average", "global_average", "local_aggregate"],
        "compress": ["compress", "compress_delta"],
        "config": ["FederatedConfig"],
        "data": ["dirichlet_split"],
        "simulate": ["FederatedSimulation"],
        "state": ["ClientStateStore"],
    },
)
