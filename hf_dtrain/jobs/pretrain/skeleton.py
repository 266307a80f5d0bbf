"""What a pretraining job trains, without its weights or its data: the preset's LLaMA built on the meta device, the
batch of blocks, and the precision Accelerate's launch asks for. A memory trace of the job's step starts here."""

from __future__ import annotations

import os

import torch


def skeleton(cfg):
    """The job's :class:`~hf_dtrain.estimate.job.Skeleton` (the optimizer is the run's own section's)."""
    from hf_dtrain.models import llama_config, trained_vocab_size
    from hf_dtrain.run.skeleton import Skeleton, data_notes

    # the vocabulary the job's model gets beside its trained tokenizer (the test preset's 128 grows to 259: traced at
    # 128, its step was estimated 12% under the job's measured one)
    config = llama_config(cfg.preset, vocab_size=trained_vocab_size(cfg.preset))
    notes = data_notes(cfg.dataset)
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")  # accelerate launch --mixed_precision

    def build(device="meta"):
        from transformers import LlamaForCausalLM

        with torch.device(device):
            return LlamaForCausalLM(config)

    def optimizer(params):
        return torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)

    from hf_dtrain.run.skeleton import vary

    alternatives = []
    if cfg.per_device_train_batch_size > 1:
        alternatives.append(("--per-device-train-batch-size 1", vary(cfg, per_device_train_batch_size=1)))
    return Skeleton(
        build=build,
        batch=cfg.per_device_train_batch_size,
        seq_len=cfg.seq_len,
        vocab_size=config.vocab_size,
        optimizer=optimizer,
        autocast={"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision),
        lr=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        output_dir=cfg.output_dir,
        notes=notes,
        alternatives=alternatives,
    )
