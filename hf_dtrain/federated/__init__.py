"""Federated fine-tuning with peft adapters as the payload (FedML Parrot-style simulation).

* :class:`FederatedConfig`, :class:`FederatedSimulation`: N clients simulated on P processes, clients trained one
  after another on each process, local then global aggregation, speed-aware client scheduling, per-client state;
* :func:`dirichlet_split`: non-IID client data;
* :func:`local_aggregate` / :func:`global_average` / :func:`flat_average`: Parrot's two-step aggregation;
* :func:`compress_delta`: the int8 / low-rank uplink with error feedback and byte counts;
* :class:`ClientStateStore`: the client state manager (safetensors, owner-only).
"""

from .aggregate import flat_average, global_average, local_aggregate
from .compress import compress, compress_delta
from .config import FederatedConfig
from .data import dirichlet_split
from .simulate import FederatedSimulation
from .state import ClientStateStore

__all__ = [
    "ClientStateStore",
    "FederatedConfig",
    "FederatedSimulation",
    "compress",
    "compress_delta",
    "dirichlet_split",
    "flat_average",
    "global_average",
    "local_aggregate",
]
