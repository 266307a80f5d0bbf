"""The federated job's settings and command line (``hf-dtrain fed simulate`` flags). Light to import: ``--help``
reads it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from hf_dtrain.federated.config import FederatedConfig
from hf_dtrain.jobs.sft.config import FinetuneJob, finetune_config_class
from hf_dtrain.run.flags import add_config_arguments, add_job_arguments, args_to_data, load_recipe
from hf_dtrain.settings import SettingsError, build, merge, setting
from hf_dtrain.tuners.finetune_method import FINETUNE_METHODS


def fed_methods() -> list[str]:
    """The methods whose adapter can be the payload: every registered one that trains a peft adapter."""
    return [name for name, m in FINETUNE_METHODS.items() if m.peft_type is not None]


@dataclass
class FedSimulateConfig:
    """A federated simulation: the model / method / data settings of a finetune job, and the federation."""

    job: FinetuneJob = setting(
        help="Base model, method, rank and data, as hf-dtrain finetune takes them (its engine sections are refused).",
        factory=lambda: finetune_config_class()(),
    )
    fed: FederatedConfig = setting(help="The federation.", factory=FederatedConfig)

    def __post_init__(self):
        if self.job.method not in fed_methods():
            raise SettingsError(
                f"method={self.job.method!r}: the federated payload is a peft adapter; use one of "
                f"{', '.join(fed_methods())}."
            )
        for name in self.job.engine_settings_given():
            raise SettingsError(
                f"{name} is set, but hf-dtrain fed simulate runs its own loop (clients trained one after another, "
                f"Parrot's aggregation); leave {name} at its default."
            )
        unsupported = sorted(set(self.job.training) - FED_TRAINER_SETTINGS)
        if unsupported:
            raise SettingsError(
                f"{', '.join('--' + k.replace('_', '-') for k in unsupported)} given, but hf-dtrain fed "
                "simulate runs its own client loop (--fed.* sets it) and takes only these Trainer "
                f"settings: {', '.join(sorted(FED_TRAINER_SETTINGS))}."
            )


# the Trainer settings the federation honours: the data's preparation, the seed, the clients' learning rate (when
# --fed.client-lr is not given), where it writes; the others are refused rather than ignored
FED_TRAINER_SETTINGS = {
    "learning_rate",
    "seed",
    "output_dir",
    "max_length",
    "truncation_mode",
    "dataset_text_field",
    "completion_only_loss",
    "assistant_only_loss",
    "chat_template_path",
    "report_to",
    "disable_tqdm",
    "logging_steps",
    "use_cpu",
}


FED_SHORT = {
    "clients": "clients",
    "per-round": "per_round",
    "rounds": "rounds",
    "local-steps": "local_steps",
    "algorithm": "algorithm",
    "uplink": "uplink",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hf-dtrain fed simulate``: finetune's model / method / data flags, ``--fed.*`` (FederatedConfig) and the
    short forms ``--clients --per-round --rounds --local-steps --algorithm --uplink``."""
    add_job_arguments(parser, finetune_config_class())
    title = f"fed (FederatedConfig, {FederatedConfig.__module__})"
    add_config_arguments(parser, FederatedConfig, "fed", title, short=FED_SHORT)


def config_from_args(ns: argparse.Namespace) -> FedSimulateConfig:
    FinetuneConfig = finetune_config_class()
    given = vars(ns)
    fed = {k.split(".", 1)[1]: v for k, v in given.items() if k.startswith("fed.")}
    data = load_recipe(ns.recipe) if getattr(ns, "recipe", None) else {}
    fed = {**(data.pop("fed", None) or {}), **fed}
    shared = argparse.Namespace(
        **{k: v for k, v in given.items() if not k.startswith("fed.") and k not in ("recipe", "action")}
    )
    job = FinetuneConfig.from_dict(
        merge(data, args_to_data(shared, FinetuneConfig), FinetuneConfig),
        where=f"recipe {ns.recipe}" if getattr(ns, "recipe", None) else "FinetuneConfig",
    )
    return FedSimulateConfig(job=job, fed=build(FederatedConfig, fed, where="fed"))
