"""The settings of one pretraining job (``PretrainConfig``): the job's own (preset, data, schedule, where it
writes) and every registered engine section's, built from the registries when first used. Light to import."""

from __future__ import annotations

from dataclasses import dataclass

from hf_dtrain.run.config import JobConfig, job_config_class
from hf_dtrain.run.section import reads_no_data
from hf_dtrain.settings import SettingsError, check_local_path, setting


@dataclass
class PretrainJob(JobConfig):
    """Settings of one pretraining run; every field is a ``hf-dtrain pretrain`` flag and a recipe YAML key: the
    job's own and every registered engine section's (the TP / PP layout's among them)."""

    job = "pretrain"
    trainer = False

    preset: str = setting("tiny", "LlamaConfig preset (hf_dtrain.models.PRESETS).")
    dataset: str | None = setting(
        None,
        "A local .txt/.jsonl/.json file or a hub dataset with a text column; None = the Python standard "
        "library's source (on every machine).",
    )
    dataset_config: str | None = setting(None, "Hub dataset configuration name.")
    text_column: str = setting("text", "Column holding the text.")
    streaming: bool = setting(False, "Stream the dataset (hub datasets too large to load).")
    data_bytes: int = setting(2_000_000, "Default corpus: bytes of stdlib source to use.", min=1000)
    seq_len: int = setting(128, "Tokens per training block.", min=2)
    per_device_train_batch_size: int = setting(
        16, "Blocks per process per step (a section that deals the batches says how it shares them).", min=1
    )
    max_steps: int = setting(200, "Optimizer steps.", min=1)
    learning_rate: float = setting(1e-3, "Peak learning rate.", gt=0)
    warmup_steps: int = setting(20, "Linear warm-up steps, then cosine decay to a tenth.", min=0)
    weight_decay: float = setting(0.0, "Weight decay.", min=0)
    seed: int = setting(0, "Seed of the init and the data order.", min=0)
    output_dir: str = setting("outputs/pretrain", "Where results.json and the model go.")
    logging_steps: int = setting(10, "Print the loss every N steps (rank 0).", min=0)
    eval_blocks: int = setting(64, "Held-out blocks for the final loss (default corpus).", min=0)
    save_model: bool = setting(True, "Save the model and tokenizer at the end (rank 0).")
    progress: bool = setting(True, "Show a progress bar.")
    process_group_timeout: float = setting(
        1800.0,
        "Seconds a collective waits for the other ranks before the run fails (torch's default 1800): a rank that "
        "hangs without dying ends the run after this, not after half an hour.",
        gt=0,
    )

    def collective_timeout(self) -> float:
        return float(self.process_group_timeout)

    def check_own(self) -> None:
        from hf_dtrain.models import PRESETS

        if self.preset not in PRESETS:
            raise SettingsError(f"preset={self.preset!r} is unknown; set --preset to one of {', '.join(PRESETS)}.")
        if not reads_no_data(self):
            check_local_path(self, "dataset")


def pretrain_config_class() -> type:
    """``PretrainConfig``: :class:`PretrainJob` with every registered section's settings."""
    return job_config_class(PretrainJob)


def __getattr__(name: str):
    if name == "PretrainConfig":
        return pretrain_config_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
