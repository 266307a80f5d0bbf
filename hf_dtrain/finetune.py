"""Fine-tune a causal LM with one of hf_dtrain's (or peft's) methods through TRL's ``SFTTrainer``.

``run_finetune(FinetuneConfig(...))`` is what ``hf-dtrain finetune`` runs: load the base model (the embedded default
when ``model`` is None, else any causal LM checkpoint, in ``torch_dtype``, 4-bit with ``quantize``), load the data in
one of TRL's formats (language modelling ``text``, ``prompt``/``completion``, conversational ``messages``; the
default addition task when ``dataset`` is None), wrap the model for ``method`` (or a saved ``peft_config``), train
with ``SFTTrainer`` on every ``SFTConfig`` setting given (``training``: every ``TrainingArguments`` field too), evaluate
before and after (eval loss; exact-match accuracy on prompt-completion data), save the adapter (or the full model), a
model card and ``results.json``, print a table. Works in one process and under ``accelerate launch`` / ``torchrun``
(DDP, FSDP2, DeepSpeed; only rank 0 writes and prints).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import typing
from dataclasses import dataclass, field

import datasets
import torch
from peft import PeftConfig
from torch.utils.data import DataLoader, DistributedSampler
from transformers import set_seed
from trl import SFTConfig, SFTTrainer

from hf_dtrain import tasks
from hf_dtrain.callbacks import NonFiniteLossCallback
from hf_dtrain.compose import EXCHANGING, ComposeOptions, check_local_path, run_identity, wire_bytes
from hf_dtrain.datafile import check_enough
from hf_dtrain.distributed.groups import init_distributed
from hf_dtrain.errors import check_writable
from hf_dtrain.model_card import write_model_card
from hf_dtrain.models import load_model_and_tokenizer
from hf_dtrain.parallel import local_param_bytes
from hf_dtrain.parallel.zero import deepspeed_config
from hf_dtrain.run import JobRun
from hf_dtrain.settings import SettingsError, check_fields
from hf_dtrain.tuners.finetune_method import FINETUNE_METHODS, LORA_TARGETS
from hf_dtrain.tuners.smt import SMTSelectionCallback, smt_warmup
from hf_dtrain.tuners.smt.job import SMT_TARGETS

# Each method's fine-tuning knowledge (default learning rate, 4-bit bases, peft config with the budget matched to
# LoRA's, its own optimizer, its own settings section) lives in its tuner folder: hf_dtrain/tuners/<method>/job.py,
# which registers it (hf_dtrain.tuners.finetune_method.register_finetune_method).
METHODS = tuple(FINETUNE_METHODS)
DEFAULT_LR = {name: m.default_lr for name, m in FINETUNE_METHODS.items()}
# Which methods train on which 4-bit base (``--quantize``); see hf_dtrain.quantization.
QUANTIZED_METHODS = {
    base: tuple(n for n, m in FINETUNE_METHODS.items() if base in m.quantized_bases) for base in ("nf4", "hqq4", "int4")
}
TORCH_DTYPES = ("auto", "bfloat16", "float16", "float32")
# The default task's size when no --train-size is given (2000 steps of 16 examples: README command 1)
DEFAULT_TASK_TRAIN_SIZE = 32000


# Trainer settings SFTConfig leaves unchecked: (name, bound, strict)
TRAINER_BOUNDS = (
    ("learning_rate", 0, True),
    ("per_device_train_batch_size", 1, False),
    ("per_device_eval_batch_size", 1, False),
    ("gradient_accumulation_steps", 1, False),
    ("num_train_epochs", 0, True),
    ("warmup_steps", 0, False),
    ("weight_decay", 0, False),
    ("max_length", 1, False),
    ("logging_steps", 0, True),
    ("max_grad_norm", 0, False),
)


def sft_fields() -> dict:
    """The fields of TRL's ``SFTConfig`` (so of ``TrainingArguments``) by name."""

    return {f.name: f for f in dataclasses.fields(SFTConfig) if f.init}


# transformers 5.23 renamed TrainingArguments' gradient_checkpointing to activation_checkpointing: the field this
# release has, found on the dataclass, not from a version string
CHECKPOINTING_FIELD = (
    "activation_checkpointing" if "activation_checkpointing" in sft_fields() else "gradient_checkpointing"
)


@dataclass
class FinetuneJob(ComposeOptions):
    """The job's own settings (the methods' sections are added to :class:`FinetuneConfig` from the registry)."""

    method: str = field(default="lorafa", metadata={"help": f"One of {', '.join(METHODS)}."})
    peft_config: str | None = field(
        default=None,
        metadata={
            "help": "A saved peft config to train instead of --method's: a directory holding adapter_config.json, or "
            "the JSON file (any peft method; hf_dtrain's too). --method follows its type."
        },
    )
    model: str | None = field(
        default=None, metadata={"help": "Base model path or hub id (any causal LM); None = the embedded default LLaMA."}
    )
    torch_dtype: str = field(
        default="auto",
        metadata={"help": f"dtype the base model is loaded in: {', '.join(TORCH_DTYPES)} (auto: the checkpoint's)."},
    )
    attn_implementation: str | None = field(
        default=None,
        metadata={
            "help": "Attention kernel of the base model: eager, sdpa, flash_attention_2, ... (None: transformers' "
            "choice)."
        },
    )
    quantize: str | None = field(
        default=None,
        metadata={
            "help": "Load the base in 4 bits: nf4 (bitsandbytes), hqq4 (HQQ, zero-points) or int4 (hf_dtrain's "
            "Int4Linear, zero-points); qahira merges exactly into hqq4/int4."
        },
    )
    quant_group_size: int = field(
        default=64,
        metadata={
            "min": 1,
            "help": "hqq4/int4: quantization group size along in_features (also qahira's input pooling factor).",
        },
    )
    dataset: str | None = field(
        default=None,
        metadata={
            "help": "Local json/jsonl/csv/parquet/txt file or hub dataset in one of TRL's formats (messages, "
            "prompt/completion, text); None = the default addition task."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset configuration name."})
    lora_r: int = field(
        default=8,
        metadata={
            "min": 1,
            "help": "Rank of lora / dora / lorafa / qbara, and the LoRA budget the other methods are matched to.",
        },
    )
    lora_alpha: int = field(default=16, metadata={"gt": 0, "help": "Scaling numerator for lora, dora, lorafa, qbara."})
    lora_dropout: float = field(default=0.0, metadata={"min": 0, "lt": 1, "help": "Dropout for lora and dora."})
    target_modules: list[str] | None = field(
        default=None, metadata={"help": f"Modules to adapt; default {LORA_TARGETS} ({SMT_TARGETS} for smt)."}
    )
    task_digits: int | None = field(
        default=None,
        metadata={"min": 1, "help": "Default task: operands have 1 to N digits (default hf_dtrain.tasks.TASK_DIGITS)."},
    )
    train_size: int | None = field(
        default=None,
        metadata={
            "min": 1,
            "help": f"Training examples: the default task's count (default {DEFAULT_TASK_TRAIN_SIZE}) or a cap "
            "on --dataset's rows (default all).",
        },
    )
    eval_size: int = field(default=200, metadata={"min": 1, "help": "Held-out examples for eval loss and accuracy."})
    report: bool = field(default=True, metadata={"help": "Print the result table (rank 0)."})
    progress: bool = field(default=True, metadata={"help": "Show progress bars."})
    base_preset: str = field(default="tiny", metadata={"help": "Preset of the embedded default base model."})
    base_steps: int | None = field(default=None, metadata={"min": 1, "help": "Pretraining steps of the default base."})
    training: dict = field(
        default_factory=dict,
        metadata={
            "flatten": "SFTConfig",
            "help": "TRL's SFTConfig settings (every TrainingArguments field too), given as top-level flags and YAML "
            "keys (--bf16, --gradient-checkpointing, --learning-rate, --packing ...); the rest are the job's defaults "
            "(training_defaults).",
        },
    )

    def __post_init__(self):
        check_fields(self)
        self.method = str(self.method).lower()
        if isinstance(self.target_modules, str):
            self.target_modules = [m.strip() for m in self.target_modules.split(",") if m.strip()]
        if not isinstance(self.training, dict):
            raise ValueError(f"FinetuneConfig.training must be a mapping of SFTConfig fields, got {self.training!r}.")
        self.training = {str(k).replace("-", "_"): v for k, v in self.training.items()}
        unknown = sorted(set(self.training) - set(sft_fields()))
        if unknown:
            raise ValueError(f"FinetuneConfig.training: {unknown} are not SFTConfig / TrainingArguments fields.")
        owned = sorted(set(self.training) & {f.name for f in dataclasses.fields(self)})
        if owned:
            raise ValueError(
                f"FinetuneConfig.training: {owned} are hf_dtrain's own settings here "
                f"(--{owned[0].replace('_', '-')}); give them at the top level."
            )
        check_local_path(self, "peft_config", kinds=(".json",))
        if self.peft_config is not None:
            self.method = method_of_peft_config(load_peft_config(self.peft_config), self.method)
        if self.method not in FINETUNE_METHODS:
            raise ValueError(f"method={self.method!r} is unknown; set --method to one of {', '.join(METHODS)}.")
        if self.torch_dtype not in TORCH_DTYPES:
            raise ValueError(
                f"torch_dtype={self.torch_dtype!r} is unknown; set --torch-dtype to one of {', '.join(TORCH_DTYPES)}."
            )
        for name, m in FINETUNE_METHODS.items():  # a method's section is taken only with that method
            if (
                m.settings is not None
                and hasattr(self, name)
                and getattr(self, name) != m.settings()
                and self.method != name
            ):
                raise ValueError(
                    f"{name}.* settings are given but method={self.method}; set --method {name}, or "
                    f"drop the {name} settings."
                )
        self.validate()
        check_local_path(self, "dataset")
        check_local_path(self, "model")
        if self.quantize is not None:
            self.quantize = str(self.quantize).lower()
            if self.quantize in ("none", ""):
                self.quantize = None
        if self.quantize is not None:
            if self.quantize not in QUANTIZED_METHODS:
                raise ValueError(
                    f"quantize={self.quantize!r} is unknown; set --quantize to one of "
                    f"{', '.join(QUANTIZED_METHODS)} (or leave it out for a dense base)."
                )
            if self.method not in QUANTIZED_METHODS[self.quantize]:
                raise ValueError(
                    f"method={self.method!r} cannot train on a {self.quantize} base; with "
                    f"--quantize {self.quantize} use --method one of "
                    f"{', '.join(QUANTIZED_METHODS[self.quantize])}."
                )
        self._check_training(self.training_args())  # SFTConfig's own checks, and the bounds it leaves out, now

    def _check_training(self, args) -> None:
        """What ``SFTConfig`` accepts but would train wrong or fail on after start-up: a NaN or infinite number, a
        batch of 0, a step count of 0, negative warm-up or decay."""

        hints = typing.get_type_hints(SFTConfig)
        for name, value in self.training.items():
            flag = f"--{name.replace('_', '-')}"
            kinds = set(typing.get_args(hints[name]) or (hints[name],)) - {type(None)}
            if kinds == {bool} and not isinstance(value, bool) and value is not None:
                raise ValueError(f"{name} must be true or false, got {value!r}; set {flag}.")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{name}={value!r} must be a finite number; set {flag}.")
        for name, low, strict in TRAINER_BOUNDS:
            value = getattr(args, name)
            if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if (value <= low) if strict else (value < low):
                bound = f"> {low}" if strict else f">= {low}"
                raise ValueError(f"{name}={value!r} must be {bound}; set --{name.replace('_', '-')}.")
        if args.max_steps == 0:
            raise ValueError(
                "max_steps=0 trains nothing; set --max-steps N (N >= 1), or -1 to train --num-train-epochs epochs."
            )

    @classmethod
    def from_dict(cls, data: dict | None, where: str | None = None):
        """As :meth:`ComposeOptions.from_dict`, with the Trainer's settings at the top level (as ``trl sft``'s YAML
        has them) gathered into ``training``."""
        data = {str(k).replace("-", "_"): v for k, v in (data or {}).items()}
        own = {f.name for f in dataclasses.fields(cls)}
        sft = sft_fields()
        training = dict(data.pop("training", None) or {})
        for key in [k for k in data if k not in own and k in sft]:
            training[key] = data.pop(key)
        if training:
            data["training"] = training
        return super().from_dict(data, where)

    def training_defaults(self) -> dict:
        """The job's ``SFTConfig`` defaults where they differ from TRL's: the default task's 2000-step demo (one
        epoch of 32,000 examples at 16 per step), the method's learning rate, no reporting or checkpoints unless
        asked, and what fits the machine: bf16 and gradient checkpointing on a GPU that supports bf16, fp32 on CPU."""
        gpu = torch.cuda.is_available()
        bf16 = gpu and torch.cuda.is_bf16_supported() and not self.training.get("fp16")
        out = dict(
            output_dir=os.path.join("outputs", f"finetune-{self.method}"),
            learning_rate=FINETUNE_METHODS[self.method].default_lr,
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
        if not {"gradient_checkpointing", "activation_checkpointing"} & set(self.training):
            out[CHECKPOINTING_FIELD] = bool(bf16)
        return out

    def training_args(self, **engine):
        """The ``SFTConfig`` this job trains with: the settings given (``training``) over the job's defaults,
        passed to ``SFTConfig`` as they are; ``engine``: what the job's engines set (DeepSpeed's config...)."""

        # TrainingArguments sets up the process group as it is built: under torchrun's / accelerate's restarts it
        # must use this generation's own store keys (a restarted generation would read the dead one's addresses)
        init_distributed()
        kwargs = {**self.training_defaults(), **self.training, **engine}
        try:
            return SFTConfig(**kwargs)
        except (ValueError, TypeError) as e:
            raise ValueError(f"the Trainer's settings were refused by SFTConfig: {e}") from None

    @property
    def seed(self) -> int:
        """The Trainer's seed (adapter init, data order, the default task's draw)."""
        return int(self.training.get("seed", self.training_defaults()["seed"]))


def _finetune_config_class():
    """``FinetuneJob`` with one section per registered method that has settings of its own (``smt``, ``qbara``...):
    a tuner registered before this module is imported gets its ``--<name>.*`` flags and YAML section without any
    edit here."""
    extra = []
    for name, m in FINETUNE_METHODS.items():
        if m.settings is not None:
            extra.append(
                (
                    name,
                    m.settings,
                    field(
                        default_factory=m.settings,
                        metadata={
                            "help": f"{name}'s own settings (used with --method {name}; {m.settings.__module__})."
                        },
                    ),
                )
            )
    cls = dataclasses.make_dataclass("FinetuneConfig", extra, bases=(FinetuneJob,))
    cls.__module__ = __name__
    cls.__doc__ = (
        "Settings of one fine-tuning run; every field is also a ``hf-dtrain finetune`` flag and a recipe "
        "YAML key: the job's own, the engine sections of :class:`hf_dtrain.compose.ComposeOptions`, each "
        "method's section, and every ``SFTConfig`` field at the top level (``training``)."
    )
    return cls


FinetuneConfig = _finetune_config_class()


def load_peft_config(path: str):
    """A saved peft config: a directory holding ``adapter_config.json`` or the JSON file itself."""

    file = os.path.join(path, "adapter_config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(
            f"peft_config: {path} holds no adapter_config.json; set --peft-config to a saved peft "
            "adapter directory or its adapter_config.json."
        )
    with open(file) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"peft_config: {file} is not JSON ({e}).") from None
    if not isinstance(data, dict) or "peft_type" not in data:
        raise ValueError(f"peft_config: {file} has no peft_type; save it with PeftConfig.save_pretrained.")
    try:
        return PeftConfig.from_peft_type(**data)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"peft_config: {file} is not a config peft can build ({e!r}); a hf_dtrain method needs "
            "`import hf_dtrain`, which this job has done."
        ) from None


def method_of_peft_config(config, given: str) -> str:
    """The job's method for a saved peft config: its peft type when registered here (``dora`` for LoRA with
    ``use_dora``), else ``lora``'s job settings (learning rate) for another peft method."""
    name = str(getattr(config.peft_type, "value", config.peft_type)).lower()
    if name == "lora" and getattr(config, "use_dora", False):
        name = "dora"
    return name if name in FINETUNE_METHODS else "lora"


def build_peft_config(cfg, model):
    """The peft config for the job: the saved one (``peft_config``), or ``cfg.method``'s built by its own
    ``tuners/<method>/job.py`` (None for "full")."""
    if cfg.peft_config is not None:
        return load_peft_config(cfg.peft_config)
    return FINETUNE_METHODS[cfg.method].build_config(cfg, model)


def format_table(r: dict) -> str:
    method = r["method"] + (f" on {r['quantize']}" if r.get("quantize") else "")

    def change(before, after):
        return f"{after:.3f}" if before is None else f"{before:.3f} -> {after:.3f}"

    acc = "n/a" if r.get("accuracy_after") is None else change(r.get("accuracy_before"), r["accuracy_after"])
    cols = [
        ("method", method),
        ("trainable", f"{r['trainable_params']:,} ({r['trainable_pct']:.2f}%)"),
        ("train s", f"{r['train_seconds']:.1f}"),
        ("eval loss", change(r["eval_loss_before"], r["eval_loss_after"])),
        ("accuracy", acc),
    ]
    widths = [max(len(h), len(v)) for h, v in cols]
    line = "| " + " | ".join(h.ljust(w) for (h, _), w in zip(cols, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    val = "| " + " | ".join(v.ljust(w) for (_, v), w in zip(cols, widths)) + " |"
    return "\n".join([line, sep, val])


@dataclass
class BaseAndData:
    """What ``finetune``, ``sweep`` and ``fed`` start from: the base model, its tokenizer, and the data in TRL's
    prepared form (input_ids and labels, masked as the format says)."""

    model: torch.nn.Module
    tokenizer: object
    base_path: str
    train: object
    eval: object
    data_format: str


def load_base_model(cfg, base_path: str):
    """The base model at ``base_path`` as the job loads it: ``torch_dtype``, ``attn_implementation``,
    ``trust_remote_code`` (the Trainer's setting, off by default), or 4-bit with ``quantize``."""

    if cfg.quantize is not None:
        from hf_dtrain.quantization import load_quantized_model

        return load_quantized_model(base_path, cfg.quantize, group_size=cfg.quant_group_size)
    kwargs = {"trust_remote_code": bool(cfg.training.get("trust_remote_code", False)), "dtype": cfg.torch_dtype}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    return load_model_and_tokenizer(base_path, **kwargs)[0]


def load_base_and_data(cfg, progress: bool = True, load_model: bool = True) -> BaseAndData:
    """The base model (the embedded default, built and cached when ``cfg.model`` is None; ``torch_dtype``,
    ``attn_implementation``, ``trust_remote_code``, 4-bit ``quantize``) and the train / eval data (the default task
    or ``cfg.dataset``), tokenized by TRL's preparation for ``cfg.training_args()``."""

    from hf_dtrain.models import build_default_model, load_model_and_tokenizer

    if not progress:
        datasets.disable_progress_bars()
    args = cfg.training_args()
    check_paths(args)  # also for sweep and fed, which load through here
    if cfg.dataset is None:
        digits = cfg.task_digits or tasks.TASK_DIGITS
        train = tasks.addition_dataset(
            cfg.train_size or DEFAULT_TASK_TRAIN_SIZE, seed=cfg.seed, split="train", digits=digits
        )
        held = tasks.addition_dataset(cfg.eval_size, seed=cfg.seed, split="eval", digits=digits)
    else:
        train, held = tasks.load_sft_dataset(
            cfg.dataset,
            config=cfg.dataset_config,
            train_size=cfg.train_size,
            eval_size=cfg.eval_size,
            seed=cfg.seed,
            text_field=args.dataset_text_field,
        )
    kind = tasks.dataset_format(train, args.dataset_text_field)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    check_enough(
        len(train),
        args.per_device_train_batch_size * world * args.gradient_accumulation_steps,
        "training examples",
        cfg.dataset or f"(the default task, --train-size {cfg.train_size or DEFAULT_TASK_TRAIN_SIZE})",
        "lower --per-device-train-batch-size or --gradient-accumulation-steps, or give more rows",
        flag="--dataset" if cfg.dataset else "--train-size",
    )
    # the data is checked before the base model is built or loaded: a bad file fails in seconds
    base_path = cfg.model or build_default_model(cfg.base_preset, steps=cfg.base_steps, progress=progress)
    _, tokenizer = load_model_and_tokenizer(base_path, load_model=False, trust_remote_code=bool(args.trust_remote_code))
    model = load_base_model(cfg, base_path) if load_model else None
    if kind == "conversational" and tokenizer.chat_template is None and args.chat_template_path is None:
        raise ValueError(
            f"--dataset {cfg.dataset} is conversational (messages), but the tokenizer of {base_path} has "
            "no chat template: set --chat-template-path to a Jinja template file (or a model whose "
            "template to use), or give the data as prompt/completion or text."
        )
    if args.assistant_only_loss and kind != "conversational":
        where = cfg.dataset or "the default task"
        raise ValueError(
            f"--assistant-only-loss needs conversational data (messages); {where} is {kind}: use "
            "--completion-only-loss for prompt/completion data."
        )
    if args.chat_template_path is not None:
        with open(args.chat_template_path) as f:
            tokenizer.chat_template = f.read()
    eval_packing = args.packing if args.eval_packing is None else args.eval_packing
    train = tasks.prepare_sft_dataset(train, tokenizer, args)
    held = tasks.prepare_sft_dataset(held, tokenizer, args, packing=eval_packing)
    return BaseAndData(model, tokenizer, base_path, train, held, kind)


def engine_callbacks(cfg, output_dir: str):
    """(DELTA callback, fault-tolerance callback), each None when its section is off; each gets its section's config
    object as it is (the snapshot config with the job's default disk directory when it persists)."""
    delta_cb = ft = None
    if cfg.delta is not None:
        from hf_dtrain.memory import DeltaCallback

        delta_cb = DeltaCallback(cfg.delta)
    if cfg.fault_tolerance is not None:
        from hf_dtrain.compose import snapshot_config_for
        from hf_dtrain.fault import InMemoryFaultToleranceCallback

        ft = InMemoryFaultToleranceCallback(
            snapshot_config_for(cfg.fault_tolerance, output_dir), identity=run_identity(cfg)
        )
    return delta_cb, ft


def _engine_settings(cfg, run: JobRun) -> dict:
    """What the engines set in the Trainer's arguments, refusing a given setting that contradicts them."""
    out = {}
    if cfg.deepspeed:
        out["deepspeed"] = deepspeed_config(cfg.deepspeed)
    if "optim" in cfg.training and (cfg.optimizer != "adamw" or (cfg.method == "lorafa" and cfg.lorafa.optimizer)):
        other = (
            f"--optimizer {cfg.optimizer}"
            if cfg.optimizer != "adamw"
            else "LoRA-FA's own optimizer (--lorafa.optimizer true)"
        )
        raise SettingsError(
            f"--optim {cfg.training['optim']} is the Trainer's optimizer, and {other} would replace it "
            "silently: drop --optim, or use it with --optimizer adamw"
            + (" and --lorafa.optimizer false." if cfg.method == "lorafa" else ".")
        )
    save_strategy = cfg.training_args().save_strategy
    if cfg.fsdp is not None and save_strategy != "no":
        raise SettingsError(
            f"save_strategy={save_strategy.value} with fsdp: the Trainer's "
            "checkpoints cannot hold the FSDP2 shards hf_dtrain lays out (the final adapter is "
            "gathered and saved at the end); set --save-strategy no, or train on DDP (no --fsdp) for "
            "resumable Trainer checkpoints."
        )
    if cfg.comm_method == "dear" or cfg.optimizer in EXCHANGING:
        # DeAR averages the gradients after step() is called, and the exchanging optimizers never average them:
        # clipping local gradients would be wrong
        if cfg.training.get("max_grad_norm", 0) not in (0, 0.0, None):
            raise SettingsError(
                f"max_grad_norm={cfg.training['max_grad_norm']}: with "
                f"{'--comm-hook dear' if cfg.comm_method == 'dear' else '--optimizer ' + cfg.optimizer} "
                "the gradients are not averaged at clipping time; set --max-grad-norm 0."
            )
        out["max_grad_norm"] = 0.0
    if cfg.asynchronous_gossip:  # a buffer broadcast in every forward would make every step a synchronisation point
        out["ddp_broadcast_buffers"] = False
    return out


def _sft_trainer(cfg, run, data, model, args, callbacks, optimizers):

    accuracy = data.data_format == "prompt-completion" and not (
        args.eval_packing if args.eval_packing is not None else args.packing
    )
    # the data is prepared already (load_base_and_data, by TRL's own preparation): the trainer takes it as it is
    # (its assistant-only masks are in the labels already: the trainer's own check for them would look for messages)
    args.dataset_kwargs = {**(args.dataset_kwargs or {}), "skip_prepare_dataset": True}
    args.assistant_only_loss = False
    # TRL casts the trainable parameters of a 4-bit model to bf16 (its QLoRA default); the job keeps the adapter dtype
    # peft gave them (fp32 on a 4-bit base: peft's autocast_adapter_dtype), which the fused sweep, the federated loop
    # and the exact 4-bit merge assume; --bf16 still computes in bf16 under autocast
    kept = {name: p.data for name, p in model.named_parameters() if p.requires_grad}
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.eval,
        processing_class=data.tokenizer,
        callbacks=callbacks,
        optimizers=optimizers,
        compute_metrics=tasks.compute_metrics if accuracy else None,
        preprocess_logits_for_metrics=tasks.preprocess_logits_for_metrics if accuracy else None,
    )
    for name, p in model.named_parameters():
        if name in kept and p.dtype != kept[name].dtype:
            p.data = kept[name]
    if cfg.deepspeed and not trainer.is_deepspeed_enabled:  # never train something other than what was asked
        raise RuntimeError(
            f"deepspeed={cfg.deepspeed} was given but Accelerate did not enable DeepSpeed (distributed "
            f"type {trainer.accelerator.distributed_type}); launch with accelerate launch / torchrun / "
            "deepspeed so that LOCAL_RANK is set."
        )
    return trainer


def _select_smt_blocks(cfg, run, model, data, args, callbacks) -> None:
    """SMT picks its blocks from warm-up gradients: by a callback in one process; before DDP / FSDP2 / DeepSpeed
    wrap the model otherwise (they cannot change parameter shapes afterwards)."""

    if run.world_size == 1 and cfg.fsdp is None and not cfg.deepspeed:
        callbacks.append(SMTSelectionCallback())
        return

    sampler = DistributedSampler(data.train, num_replicas=run.world_size, rank=run.rank, shuffle=True, seed=args.seed)
    loader = DataLoader(
        data.train,
        batch_size=args.per_device_train_batch_size,
        sampler=sampler,
        collate_fn=tasks.sft_collator(data.tokenizer, args),
    )
    warmup = model.peft_config[model.active_adapter].warmup_steps
    smt_warmup(model, loader, num_steps=warmup)


def check_paths(args) -> None:
    """The files the Trainer's settings name exist, before anything is loaded (the Trainer would fail on them after
    the base model and the data)."""
    if args.chat_template_path is not None and not os.path.isfile(args.chat_template_path):
        raise SettingsError(
            f"chat_template_path: {args.chat_template_path} is not a file; set --chat-template-path to a Jinja "
            "template file."
        )
    resume = args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() not in ("true", "false") and not os.path.isdir(resume):
        raise SettingsError(
            f"resume_from_checkpoint: {resume} is not a checkpoint directory; set --resume-from-checkpoint to a "
            "checkpoint-N directory the Trainer saved (or true for the newest in --output-dir)."
        )


def run_finetune(cfg) -> dict:
    """Run one fine-tuning job; return the measured figures (also written to ``<output_dir>/results.json``)."""

    if cfg.deepspeed and not torch.cuda.is_available():
        # Accelerate 1.15 enables DeepSpeed only off the CPU: the Trainer would silently train with DDP instead.
        raise ValueError(
            f"deepspeed={cfg.deepspeed}: on a machine without CUDA, Accelerate (1.15) does not enable "
            "DeepSpeed for the Trainer and would silently run DDP. Run --deepspeed on a GPU machine, "
            "use --fsdp here, or call deepspeed.initialize yourself (DS_ACCELERATOR=cpu; see "
            "docs/sharded.md)."
        )
    own = FINETUNE_METHODS[cfg.method].build_optimizer
    run = JobRun(
        cfg, engine="trainer", lorafa_optimizer=own is not None and cfg.method == "lorafa" and cfg.lorafa.optimizer
    )
    args = cfg.training_args(**_engine_settings(cfg, run))
    check_writable(args.output_dir, "--output-dir")
    with run.main_first():  # rank 0 builds the default base once; the others read the cache
        data = load_base_and_data(cfg, progress=cfg.progress and run.is_main)
    set_seed(args.seed)
    model = data.model
    peft_config = build_peft_config(cfg, model)
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)
    callbacks = []
    if cfg.method == "smt":
        _select_smt_blocks(cfg, run, model, data, args, callbacks)
    exchange = run.shard(model)
    optimizer = run.optimizer(model, args.learning_rate, args.weight_decay)
    if own is not None:  # the method's own optimizer (lorafa's); the clash check refused another
        optimizer = own(cfg, model, args.learning_rate, args.weight_decay) or optimizer
    delta_cb, ft = engine_callbacks(cfg, args.output_dir)
    callbacks += [cb for cb in (delta_cb, ft) if cb is not None]
    if cfg.stop_on_nonfinite_loss:
        callbacks.append(NonFiniteLossCallback())
    trainer = _sft_trainer(cfg, run, data, model, args, callbacks, (optimizer, None))
    comm = None
    if (cfg.comm_hook is not None and cfg.fsdp is None) or cfg.optimizer in EXCHANGING:
        from hf_dtrain.callbacks import CommHookCallback

        comm = CommHookCallback.attach(trainer, "noop" if cfg.optimizer in EXCHANGING else cfg.comm_hook)
        if ft is not None:
            ft.add_stateful("comm_hook", comm)  # the hook's error feedback goes into the snapshots
    resume = ft.resume_checkpoint(trainer) if ft is not None else args.resume_from_checkpoint
    # adapters start as the identity: this is the base model. Not under Accelerate's own FSDP2 (a GPU): there
    # evaluate() would prepare the model alone, which Accelerate refuses once an optimizer exists (FSDP2 rewrites the
    # optimizer's parameters as it shards); that run reports no "before" figures
    before = None if trainer.is_fsdp_enabled else trainer.evaluate()
    if cfg.fsdp is None:
        _allow_ddp_after_evaluate(trainer)
    t0 = time.perf_counter()
    with run.guard(step_of=lambda: trainer.state.global_step, snapshots=ft is not None):
        train_out = trainer.train(resume_from_checkpoint=resume)
    run.close_guard()
    train_seconds = time.perf_counter() - t0
    after = trainer.evaluate()
    results = _results(
        cfg,
        run,
        trainer,
        data,
        args,
        before,
        after,
        train_out,
        train_seconds,
        comm=comm,
        exchange=exchange,
        delta_cb=delta_cb,
        ft=ft,
    )

    def report():
        write_model_card(args.output_dir, results, cfg.model or f"hf_dtrain/default-{cfg.base_preset}")
        if cfg.report:
            print(format_table(results), flush=True)

    run.finish(trainer.model, data.tokenizer, args.output_dir, results, write=report)
    return results


def _results(cfg, run, trainer, data, args, before, after, train_out, train_seconds, comm, exchange, delta_cb, ft):
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.model.parameters())
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return dict(
        method=cfg.method,
        base_model=cfg.model or f"hf_dtrain default ({cfg.base_preset})",
        base_path=data.base_path,
        quantize=cfg.quantize,
        data_format=data.data_format,
        comm=(
            wire_bytes(optimizer=optimizer)
            if cfg.optimizer in EXCHANGING
            else comm.summary()
            if comm is not None
            else dict(method=cfg.comm_hook.method, **wire_bytes(exchange))
            if exchange is not None
            else None
        ),
        delta=None
        if delta_cb is None
        else {
            "saved_bytes": [h["saved_bytes"] for h in delta_cb.history if not h["profiling"]],
            "budget_bytes": delta_cb.budgets,
        },
        fault_tolerance=None
        if ft is None
        else {
            "snapshots": ft.snapshots,
            "restored": None if ft.restored is None else {"step": ft.restored.step, "source": ft.restored.source},
        },
        replicas_identical=None if run.sharded else _replicas_identical(trainer.model, run.world_size),
        dataset=cfg.dataset or "default addition task (hf_dtrain.tasks)",
        trainable_params=trainable,
        total_params=total,
        trainable_pct=100.0 * trainable / max(1, total),
        param_bytes_local=local_param_bytes(trainer.model),
        train_seconds=train_seconds,
        train_loss=float(train_out.training_loss),
        eval_loss_before=None if before is None else float(before["eval_loss"]),
        eval_loss_after=float(after["eval_loss"]),
        accuracy_before=None if before is None else before.get("eval_accuracy"),
        accuracy_after=after.get("eval_accuracy"),
        losses={int(h["step"]): float(h["loss"]) for h in trainer.state.log_history if "loss" in h},
        max_steps=trainer.state.max_steps,
        learning_rate=args.learning_rate,
        per_device_train_batch_size=args.per_device_train_batch_size,
        mixed_precision=str(trainer.accelerator.mixed_precision),
        gradient_checkpointing=bool(
            getattr(getattr(trainer.model, "base_model", trainer.model), "is_gradient_checkpointing", False)
        ),
        world_size=run.world_size,
        output_dir=args.output_dir,
        config=dataclasses.asdict(cfg),
        engine="fsdp2"
        if cfg.fsdp is not None
        else f"deepspeed-zero{cfg.deepspeed_stage()}"
        if cfg.deepspeed
        else "ddp"
        if run.world_size > 1
        else "single process",
    )


def _allow_ddp_after_evaluate(trainer) -> None:
    """Undo what ``trainer.evaluate()`` before ``train()`` does to a multi-process run.

    Evaluation prepares the model with ``accelerator.prepare_model(model, evaluation_mode=True)``, which (accelerate
    1.15) marks it ``_is_accelerate_prepared``; the ``prepare`` in ``train()`` then returns it as it is, without the
    DistributedDataParallel wrapper, and every rank trains on its own shard with no gradient averaging (found with
    transformers 5.23). Clearing the mark lets ``train()`` wrap the model in DDP as it would without the evaluation.
    """
    if trainer.accelerator.num_processes < 2:
        return
    model = trainer.model
    if getattr(model, "_is_accelerate_prepared", False) and trainer.model_wrapped is model:
        del model._is_accelerate_prepared
        trainer.accelerator._models[:] = [m for m in trainer.accelerator._models if m is not model]


def _replicas_identical(model, world_size: int) -> bool:
    """Whether every rank holds the same trainable parameters (one all-gather of a float64 checksum)."""
    values = [p.detach().double().sum() for p in model.parameters() if p.requires_grad]
    checksum = torch.stack(values).sum().reshape(1) if values else torch.zeros(1, dtype=torch.float64)
    if world_size < 2 or not torch.distributed.is_initialized():
        return True
    gathered = [torch.empty_like(checksum) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, checksum)
    return all(torch.equal(gathered[0], g) for g in gathered)
