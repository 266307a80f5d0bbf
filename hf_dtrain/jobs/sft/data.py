"""What the fine-tuning jobs (finetune, sweep, fed) start from: the base model (the embedded default, built and
cached, or any causal LM checkpoint; dense, in ``torch_dtype``, or 4-bit with ``quantize``) and the data in one of TRL's
formats (language modelling ``text``, ``prompt``/``completion``, conversational ``messages``; the default addition
task when no dataset is given), checked before the base model is built and prepared by TRL's own preparation."""

from __future__ import annotations

import os
from dataclasses import dataclass

import datasets
import torch

from hf_dtrain import tasks
from hf_dtrain.datafile import check_enough
from hf_dtrain.models import base_model_path, load_model_and_tokenizer
from hf_dtrain.settings import SettingsError

from .config import DEFAULT_TASK_TRAIN_SIZE, quantized_compute_dtype


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
    completions: bool = False  # prompt / completion pairs (plain or chat turns): the completion's exact match is scored


def load_base_model(cfg, base_path: str):
    """The base model at ``base_path`` as the job loads it: ``torch_dtype``, ``attn_implementation``,
    ``trust_remote_code`` (the Trainer's setting, off by default), or 4-bit with ``quantize``."""
    if cfg.quantize is not None:
        from hf_dtrain.quantization import load_quantized_model

        dtype = quantized_compute_dtype(cfg)
        kwargs = {"dtype": dtype} if cfg.quantize == "nf4" and cfg.torch_dtype != "auto" else {}
        return load_quantized_model(
            base_path, cfg.quantize, group_size=cfg.quant_group_size, compute_dtype=dtype, **kwargs
        )
    kwargs = {"trust_remote_code": bool(cfg.training.get("trust_remote_code", False)), "dtype": cfg.torch_dtype}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    return load_model_and_tokenizer(base_path, **kwargs)[0]


def load_base_and_data(cfg, progress: bool = True, load_model: bool = True) -> BaseAndData:
    """The base model (the embedded default, built and cached when ``cfg.model`` is None; ``torch_dtype``,
    ``attn_implementation``, ``trust_remote_code``, 4-bit ``quantize``) and the train / eval data (the default task
    or ``cfg.dataset``), tokenized by TRL's preparation for ``cfg.training_args()``."""
    if not progress:
        datasets.disable_progress_bars()
    args = cfg.training_args()
    check_paths(args)  # also for sweep and fed, which load through here
    cfg.check_target_modules_early()  # before the default base is built or a model is read
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
    base_path = base_model_path(cfg.model, cfg.gguf_file, cfg.base_preset, cfg.base_steps, progress=progress)
    _, tokenizer = load_model_and_tokenizer(base_path, load_model=False, trust_remote_code=bool(args.trust_remote_code))
    if cfg.dataset is None and tokenizer.chat_template is not None:  # a chat model is asked in its own template
        train, held = tasks.as_instructions(train), tasks.as_instructions(held)
        kind = tasks.dataset_format(train, args.dataset_text_field)
    model = load_base_model(cfg, base_path) if load_model else None
    if kind == "conversational" and tokenizer.chat_template is None and args.chat_template_path is None:
        raise SettingsError(
            f"--dataset {cfg.dataset} is conversational (messages), but the tokenizer of {base_path} has "
            "no chat template: set --chat-template-path to a Jinja template file (or a model whose "
            "template to use), or give the data as prompt/completion or text."
        )
    if args.assistant_only_loss and kind != "conversational":
        where = cfg.dataset or "the default task"
        raise SettingsError(
            f"--assistant-only-loss needs conversational data (messages); {where} is {kind}: use "
            "--completion-only-loss for prompt/completion data."
        )
    if args.chat_template_path is not None:
        with open(args.chat_template_path) as f:
            tokenizer.chat_template = f.read()
    eval_packing = args.packing if args.eval_packing is None else args.eval_packing
    completions = {"prompt", "completion"} <= set(train.column_names)
    train = tasks.prepare_sft_dataset(train, tokenizer, args)
    held = tasks.prepare_sft_dataset(held, tokenizer, args, packing=eval_packing)
    return BaseAndData(model, tokenizer, base_path, train, held, kind, completions)
