"""``hf-dtrain fed simulate``: a federated fine-tuning run simulated on the launched processes (FedML Parrot-style).

``run_fed_simulate(FedSimulateConfig(job=FinetuneConfig(method=...), fed=FederatedConfig(clients=100)))``: the
base model and the task as ``hf-dtrain finetune`` builds them, the training set split over the clients (Dirichlet over
the task's labels: for the default addition task, the first digit of the first operand; for a dataset, its ``label``
or ``source`` column when it has one), the peft adapter as the payload, and one row per round: the clients sampled
and trained, those that failed, uplink bytes, train loss and eval loss of the global adapter. Writes the final
adapter (a standard peft directory), ``fed.json``, ``fed.md`` and ``fed.png`` (eval loss and uplink bytes per round).
Under ``torchrun`` / ``accelerate launch`` the processes share the clients; the client states live under
``<output_dir>/client_states`` (owner-only).
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    submod_attrs={
        "config": [
            "FED_SHORT",
            "FED_TRAINER_SETTINGS",
            "FedSimulateConfig",
            "add_arguments",
            "config_from_args",
            "fed_methods",
        ],
        "run": ["build_federation", "client_config", "main", "run_fed_simulate"],
    },
)
