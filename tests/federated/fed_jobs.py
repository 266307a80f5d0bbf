"""The multi-process federated run of test_simulation (a module the spawned ranks import)."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

CONFIG = dict(
    clients=8,
    per_round=6,
    rounds=3,
    local_steps=2,
    batch_size=4,
    algorithm="fedprox",
    prox_mu=0.1,
    uplink="int8",
    dirichlet_alpha=None,
)


def build(state_dir):
    from hf_dtrain.federated import FederatedConfig, FederatedSimulation
    from tests.federated.test_simulation import _collate, _dataset, _peft_model

    torch.set_num_threads(1)
    data = [_dataset(8, s) for s in range(CONFIG["clients"])]
    return FederatedSimulation(_peft_model(), data, _collate, FederatedConfig(**CONFIG), state_dir=state_dir)


def ranks_run(rank: int, world: int, state_dir: str, out: str) -> None:
    sim = build(state_dir)
    history = sim.run(progress=False)
    if rank == 0:
        import json

        save_file({n: v.contiguous() for n, v in sim.global_state.items()}, out)
        with open(out + ".json", "w") as f:
            json.dump(history, f)
