"""The settings of a federated simulation (``hf-dtrain fed simulate --fed.*``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_dtrain.errors import SettingsError
from hf_dtrain.settings import check_choice, check_fields

ALGORITHMS = ("fedavg", "fedprox", "scaffold")
UPLINKS = ("none", "int8", "int4", "lowrank")
CLIENT_OPTIMIZERS = ("adamw", "sgd")


@dataclass
class FederatedConfig:
    """A FedML-Parrot-style simulation of ``clients`` clients on the launched processes, with peft adapters as the
    payload. Every field is a ``--fed.*`` flag."""

    clients: int = field(default=100, metadata={"min": 1, "help": "Clients in the federation."})
    per_round: int = field(default=10, metadata={"min": 1, "help": "Clients sampled each round (<= clients)."})
    rounds: int = field(default=20, metadata={"min": 1, "help": "Communication rounds."})
    local_steps: int = field(default=10, metadata={"min": 1, "help": "Optimizer steps of a client per round."})
    batch_size: int = field(default=8, metadata={"min": 1, "help": "A client's micro-batch."})
    client_lr: float = field(default=4e-3, metadata={"gt": 0, "help": "A client's learning rate."})
    client_optimizer: str = field(
        default="adamw",
        metadata={"help": "A client's optimizer: 'adamw' or 'sgd' (SCAFFOLD's control variates assume SGD)."},
    )
    keep_client_optimizer: bool = field(
        default=False,
        metadata={
            "help": "Keep each client's optimizer state between its rounds (in the client state store); False: a "
            "fresh optimizer each round, as most federated fine-tuning does."
        },
    )
    algorithm: str = field(
        default="fedavg",
        metadata={
            "help": "'fedavg' (weighted average of the clients' deltas), 'fedprox' (a proximal term mu/2 ||w - "
            "w_global||^2 in each client's loss), 'scaffold' (control variates, kept per client between rounds)."
        },
    )
    prox_mu: float = field(default=0.01, metadata={"min": 0, "help": "FedProx's mu."})
    server_lr: float = field(default=1.0, metadata={"gt": 0, "help": "The server's step on the averaged delta."})
    dirichlet_alpha: float | None = field(
        default=0.5,
        metadata={
            "gt": 0,
            "help": "Non-IID split: each label's (or source's) samples dealt to clients by Dirichlet(alpha) "
            "proportions; smaller is more skewed. None: an IID split.",
        },
    )
    uplink: str = field(
        default="none",
        metadata={
            "help": "Compression of a client's adapter delta: 'none' (fp32), 'int8' / 'int4' (per-tensor scale), "
            "'lowrank' (rank uplink_rank factors of every matrix)."
        },
    )
    uplink_rank: int = field(default=4, metadata={"min": 1, "help": "Rank of the 'lowrank' uplink."})
    error_feedback: bool = field(
        default=True,
        metadata={"help": "Add each client's compression error to its next delta (kept in the client state store)."},
    )
    seed: int = field(
        default=0, metadata={"min": 0, "help": "Seed of the split, the client sampling and the data order."}
    )

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
