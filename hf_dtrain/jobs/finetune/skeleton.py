"""What a fine-tuning job trains, without its weights or its data: the base model's config (a preset, a directory
holding only ``config.json``, or a checkpoint's), the model built from it on the meta device, the method applied there,
and the Trainer's batch, precision, checkpointing and optimizer. A memory trace of the job's step starts here."""

from __future__ import annotations

import torch

from hf_dtrain.precision import autocast_dtype
from hf_dtrain.settings import SettingsError


def base_config(cfg):
    """The base model's ``PretrainedConfig``: a preset's (``--model llama3-8b``), the embedded default's (no
    ``--model``), or read from ``--model``'s ``config.json`` (no weight file read)."""
    import hf_dtrain.checkpoints as checkpoints
    from hf_dtrain.models import PRESETS, llama_config

    if cfg.model is None and cfg.base_preset in checkpoints.PACKAGED:
        return checkpoints.model_config(checkpoints.packaged_gguf(cfg.base_preset))
    if cfg.model is None:
        return llama_config(cfg.base_preset)
    if cfg.model in PRESETS:
        return llama_config(cfg.model)
    trust = bool(cfg.training.get("trust_remote_code", False))
    try:
        return checkpoints.model_config(cfg.model, cfg.gguf_file, trust_remote_code=trust)
    except (OSError, ValueError, KeyError) as e:
        if isinstance(e, checkpoints.ModelLoadError):
            raise
        raise SettingsError(
            f"model={cfg.model!r}: no model config could be read ({str(e).splitlines()[0][:200]}); set --model to a "
            f"directory holding config.json, a hub id, or a preset: {', '.join(PRESETS)}."
        ) from None


def _dtype(cfg, config) -> torch.dtype:
    if cfg.torch_dtype != "auto":
        return getattr(torch, cfg.torch_dtype)
    found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(found, str):
        found = getattr(torch, found, None)
    return found if isinstance(found, torch.dtype) else torch.float32


def skeleton(cfg):
    """The job's :class:`~hf_dtrain.estimate.job.Skeleton`: refuses (naming the input) what cannot be traced."""
    from transformers import AutoModelForCausalLM, Trainer

    from hf_dtrain.jobs.sft.config import checkpointing_field
    from hf_dtrain.run.skeleton import Skeleton, data_notes, vary

    notes = data_notes(cfg.dataset, ": every sequence is taken at --max-length tokens")
    args = cfg.training_args()
    config = base_config(cfg)
    dtype = _dtype(cfg, config)
    if cfg.quantize is not None:  # as the job loads a 4-bit base (jobs/sft/data.py)
        from hf_dtrain.jobs.sft.config import quantized_compute_dtype

        compute_dtype = quantized_compute_dtype(cfg)
        if cfg.quantize != "nf4":  # HQQ and INT4: the rest of the model in the compute dtype too
            dtype = compute_dtype
    method = cfg.method_entry
    if method.prepare is not None and method.without_data is None:
        raise SettingsError(
            f"method={cfg.method}: its preparation reads the data and it has no stand-in without data, so its step "
            "cannot be traced."
        )
    seq_len = args.max_length or getattr(config, "max_position_embeddings", 1024)
    attention = cfg.attn_implementation or "sdpa"

    fused_head = _fused_lm_head()

    def build(device="meta"):
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
        if cfg.quantize is not None:  # the 4-bit base the job loads, made from the dense one where it was built
            from hf_dtrain.quantization import quantize_model

            quantize_model(model, cfg.quantize, group_size=cfg.quant_group_size, compute_dtype=compute_dtype)
            if cfg.quantize == "nf4":  # as transformers' bitsandbytes loading marks the job's model: peft then wraps
                # its layers in its bitsandbytes LoRA class, as in the run (unmarked, peft's plain LoRA layer took a
                # lean path the job's does not: QLoRA without checkpointing traced 13% under the job's step)
                model.is_loaded_in_4bit = True
        with torch.device(device):
            if fused_head is not None:  # as SFTTrainer patches the base model
                fused_head(model)
            peft_config = cfg.build_peft_config(model)
            if peft_config is not None:
                from peft import get_peft_model

                model = get_peft_model(model, peft_config)
        if method.without_data is not None:  # its tensors made where the model is
            method.without_data(model, cfg.method_settings, args.seed)
        return model

    if method.without_data is not None:
        notes.append(f"{cfg.method}'s data-dependent preparation is replaced by a seeded one with the same shapes")

    def optimizer(params):
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)  # the Trainer's own choice (--optim)
        return cls(params, **kwargs)

    checkpointing = bool(getattr(args, checkpointing_field(), False))
    alternatives = []
    if args.per_device_train_batch_size > 1:
        one = {**cfg.training, "per_device_train_batch_size": 1}
        alternatives.append(("--per-device-train-batch-size 1", vary(cfg, training=one)))
    if not checkpointing:
        on = {**cfg.training, checkpointing_field(): True}
        alternatives.append((f"--{checkpointing_field().replace('_', '-')} true", vary(cfg, training=on)))
    return Skeleton(
        build=build,
        batch=args.per_device_train_batch_size,
        seq_len=int(seq_len),
        vocab_size=int(config.vocab_size),
        optimizer=optimizer,
        autocast=autocast_dtype(args),
        checkpointing=checkpointing,
        lr=args.learning_rate,
        weight_decay=args.weight_decay,
        output_dir=args.output_dir,
        notes=notes,
        alternatives=alternatives,
        forward_kwargs={"fused_lm_head": True} if fused_head is not None else {},
    )


def _fused_lm_head():
    """TRL's fused LM head as ``SFTTrainer`` adds it to the model it trains (per-token log-probabilities, entropy and
    top-1 hits computed in tiles, the loss from them: TRL 1.x, ``trl.trainer.utils.add_fused_lm_head``), or None
    where this TRL has none (its trainer then computes the loss from the full logits)."""
    import functools

    try:
        from trl.trainer.utils import add_fused_lm_head
    except ImportError:
        return None
    return functools.partial(add_fused_lm_head, outputs=("log_probs", "entropy", "is_top1"))
