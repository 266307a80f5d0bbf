"""The settings of one pretraining job (``PretrainConfig``): the job's own (preset, data, schedule, where it
writes) and every registered engine section's, built from the registries when first used. Light to import."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_dtrain.run.config import JobConfig, job_config_class
from hf_dtrain.settings import SettingsError, check_local_path


@dataclass
class PretrainJob(JobConfig):
    """Settings of one pretraining run; every field is a ``hf-dtrain pretrain`` flag and a recipe YAML key: the
    job's own and every registered engine section's (the TP / PP layout's among them)."""

    job = "pretrain"
    trainer = False

    preset: str = field(default="tiny", metadata={"help": "LlamaConfig preset (hf_dtrain.models.PRESETS)."})
    dataset: str | None = field(
        default=None,
        metadata={
            "help": "A local .txt/.jsonl/.json file or a hub dataset with a text column; None = the Python standard "
            "library's source (on every machine)."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset configuration name."})
    text_column: str = field(default="text", metadata={"help": "Column holding the text."})
    streaming: bool = field(default=False, metadata={"help": "Stream the dataset (hub datasets too large to load)."})
    data_bytes: int = field(
        default=2_000_000, metadata={"min": 1000, "help": "Default corpus: bytes of stdlib source to use."}
    )
    seq_len: int = field(default=128, metadata={"min": 2, "help": "Tokens per training block."})
    per_device_train_batch_size: int = field(
        default=16,
        metadata={
            "min": 1,
            "help": "Blocks per process per step (with --hetero-speeds: the global batch is this x processes).",
        },
    )
    max_steps: int = field(default=200, metadata={"min": 1, "help": "Optimizer steps."})
    learning_rate: float = field(default=1e-3, metadata={"gt": 0, "help": "Peak learning rate."})
    warmup_steps: int = field(
        default=20, metadata={"min": 0, "help": "Linear warm-up steps, then cosine decay to a tenth."}
    )
    weight_decay: float = field(default=0.0, metadata={"min": 0, "help": "Weight decay."})
    seed: int = field(default=0, metadata={"min": 0, "help": "Seed of the init and the data order."})
    output_dir: str = field(default="outputs/pretrain", metadata={"help": "Where results.json and the model go."})
    logging_steps: int = field(default=10, metadata={"min": 0, "help": "Print the loss every N steps (rank 0)."})
    eval_blocks: int = field(
        default=64, metadata={"min": 0, "help": "Held-out blocks for the final loss (default corpus)."}
    )
    save_model: bool = field(default=True, metadata={"help": "Save the model and tokenizer at the end (rank 0)."})
    progress: bool = field(default=True, metadata={"help": "Show a progress bar."})

    def check_own(self) -> None:
        from hf_dtrain.models import PRESETS

        if self.preset not in PRESETS:
            raise SettingsError(f"preset={self.preset!r} is unknown; set --preset to one of {', '.join(PRESETS)}.")
        check_local_path(self, "dataset")


def pretrain_config_class() -> type:
    """``PretrainConfig``: :class:`PretrainJob` with every registered section's settings."""
    return job_config_class(PretrainJob)


def __getattr__(name: str):
    if name == "PretrainConfig":
        return pretrain_config_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
