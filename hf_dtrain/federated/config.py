"""The settings of a federated simulation (``hf-dtrain fed simulate --fed.*``)."""

from __future__ import annotations

from dataclasses import dataclass

from hf_dtrain.errors import SettingsError
from hf_dtrain.settings import check_choice, check_fields, setting

ALGORITHMS = ("fedavg", "fedprox", "scaffold")
UPLINKS = ("none", "int8", "int4", "lowrank")
CLIENT_OPTIMIZERS = ("adamw", "sgd")


@dataclass
class FederatedConfig:
    """A FedML-Parrot-style simulation of ``clients`` clients on the launched processes, with peft adapters as the
    payload. Every field is a ``--fed.*`` flag."""

    clients: int = setting(100, "Clients in the federation.", min=1)
    per_round: int = setting(10, "Clients sampled each round (<= clients).", min=1)
    rounds: int = setting(20, "Communication rounds.", min=1)
    local_steps: int = setting(10, "Optimizer steps of a client per round.", min=1)
    batch_size: int = setting(8, "A client's micro-batch.", min=1)
    client_lr: float = setting(4e-3, "A client's learning rate.", gt=0)
    client_optimizer: str = setting(
        "adamw", "A client's optimizer: 'adamw' or 'sgd' (SCAFFOLD's control variates assume SGD)."
    )
    keep_client_optimizer: bool = setting(
        False,
        "Keep each client's optimizer state between its rounds (in the client state store); False: a "
        "fresh optimizer each round, as most federated fine-tuning does.",
    )
    algorithm: str = setting(
        "fedavg",
        "'fedavg' (weighted average of the clients' deltas), 'fedprox' (a proximal term mu/2 ||w - "
        "w_global||^2 in each client's loss), 'scaffold' (control variates, kept per client between rounds).",
    )
    prox_mu: float = setting(0.01, "FedProx's mu.", min=0)
    server_lr: float = setting(1.0, "The server's step on the averaged delta.", gt=0)
    dirichlet_alpha: float | None = setting(
        0.5,
        "Non-IID split: each label's (or source's) samples dealt to clients by Dirichlet(alpha) "
        "proportions; smaller is more skewed. None: an IID split.",
        gt=0,
    )
    uplink: str = setting(
        "none",
        "Compression of a client's adapter delta: 'none' (fp32), 'int8' / 'int4' (per-tensor scale), "
        "'lowrank' (rank uplink_rank factors of every matrix).",
    )
    uplink_rank: int = setting(4, "Rank of the 'lowrank' uplink.", min=1)
    error_feedback: bool = setting(
        True, "Add each client's compression error to its next delta (kept in the client state store)."
    )
    seed: int = setting(0, "Seed of the split, the client sampling and the data order.", min=0)

    def __post_init__(self):
        check_fields(self)
        check_choice(self, "algorithm", ALGORITHMS)
        check_choice(self, "uplink", UPLINKS)
        check_choice(self, "client_optimizer", CLIENT_OPTIMIZERS)
        if self.per_round > self.clients:
            raise SettingsError(
                f"FederatedConfig.per_round={self.per_round} is more than clients={self.clients}; "
                "sample at most every client each round (lower --fed.per-round)."
            )
        if self.algorithm == "scaffold" and self.client_optimizer != "sgd":
            raise SettingsError(
                "FederatedConfig.algorithm='scaffold' corrects SGD steps with control variates; set "
                "--fed.client-optimizer sgd (or use fedavg / fedprox with adamw)."
            )
