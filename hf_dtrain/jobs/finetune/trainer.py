"""The fine-tuning job's Trainer glue: the ``SFTConfig`` it trains with, the model wrapped for the method, TRL's
``SFTTrainer`` built around it, and the training with its evaluations before and after, with the workarounds the
Trainer and Accelerate need (each says which release and why)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from transformers import set_seed

from hf_dtrain import tasks
from hf_dtrain.errors import check_writable
from hf_dtrain.precision import autocast_dtype
from hf_dtrain.tuners.finetune_method import MethodData


def arguments(cfg, run):
    """The ``SFTConfig``: the job's defaults, the user's settings, and what the sections set (DeepSpeed's config,
    no clipping under an exchanging optimizer), which refuse a given setting that contradicts them. The output
    directory is checked writable before anything is loaded."""
    args = cfg.training_args(**run.trainer_args(cfg.training))
    check_writable(args.output_dir, "--output-dir")
    run.output_dir = args.output_dir
    return args


def adapt(cfg, run, data, args):
    """The base model wrapped for the method (its peft config, or the saved one; the base itself for full
    fine-tuning), and the method's prepare step (one that selects what trains on the data); returns ``(model,
    callbacks)``."""
    set_seed(args.seed)
    model = data.model
    peft_config = cfg.build_peft_config(model)
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)
    method = cfg.method_entry
    if method.prepare is None:
        return model, []
    prepared = MethodData(
        train=data.train,
        collator=tasks.sft_collator(data.tokenizer, args),
        batch_size=args.per_device_train_batch_size,
        seed=args.seed,
        world_size=run.world_size,
        rank=run.rank,
        progress=cfg.progress and run.is_main,
        autocast_dtype=autocast_dtype(args),
    )
    return model, method.prepare(model, cfg.method_settings, prepared)


def build(cfg, run, data, model, args, callbacks, optimizer):
    """TRL's ``SFTTrainer`` on the prepared data, with the sections attached (a comm hook on its DDP model, the
    snapshots' state)."""
    accuracy = data.completions and not (args.eval_packing if args.eval_packing is not None else args.packing)
    # the data is prepared already (load_base_and_data, by TRL's own preparation): the trainer takes it as it is
    # (its assistant-only masks are in the labels already: the trainer's own check for them would look for messages)
    args.dataset_kwargs = {**(args.dataset_kwargs or {}), "skip_prepare_dataset": True}
    args.assistant_only_loss = False
    # TRL casts the trainable parameters of a 4-bit model to bf16 (its QLoRA default); the job keeps the adapter dtype
    # peft gave them (fp32 on a 4-bit base: peft's autocast_adapter_dtype), which the fused sweep, the federated loop
    # and the exact 4-bit merge assume; --bf16 still computes in bf16 under autocast
    kept = {name: p.data for name, p in model.named_parameters() if p.requires_grad}
    from trl import SFTTrainer

    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.eval,
        processing_class=data.tokenizer,
        callbacks=callbacks,
        optimizers=(optimizer, None),
        compute_metrics=tasks.compute_metrics if accuracy else None,
        preprocess_logits_for_metrics=tasks.preprocess_logits_for_metrics if accuracy else None,
    )
    for name, p in model.named_parameters():
        if name in kept and p.dtype != kept[name].dtype:
            p.data = kept[name]
    run.attach(trainer)
    return trainer


@dataclass
class Measured:
    """What training and the two evaluations gave."""

    before: dict | None
    after: dict
    train_output: object
    train_seconds: float


def train(run, trainer, args, before: bool = True) -> Measured:
    """Evaluate (the adapters start as the identity: this is the base model; unless ``before`` is false), train (from
    a restored snapshot when a section resumes one) under the rank guard, evaluate again. Not before training under
    Accelerate's own FSDP2 (a
    GPU): there ``evaluate()`` would prepare the model alone, which Accelerate refuses once an optimizer exists (FSDP2
    rewrites the optimizer's parameters as it shards); that run reports no "before" figures."""
    resume = run.resume(trainer, default=args.resume_from_checkpoint)
    before = None if trainer.is_fsdp_enabled or not before else trainer.evaluate()
    allow_ddp_after_evaluate(trainer)
    t0 = time.perf_counter()
    with run.guard(step_of=lambda: trainer.state.global_step):
        train_output = trainer.train(resume_from_checkpoint=resume)
    run.close_guard()
    seconds = time.perf_counter() - t0
    return Measured(before, trainer.evaluate(), train_output, seconds)


def allow_ddp_after_evaluate(trainer) -> None:
    """Undo what ``trainer.evaluate()`` before ``train()`` does to a multi-process run.

    Evaluation prepares the model with ``accelerator.prepare_model(model, evaluation_mode=True)``, which (accelerate
    1.15) marks it ``_is_accelerate_prepared``; the ``prepare`` in ``train()`` then returns it as it is, without the
    DistributedDataParallel wrapper, and every rank trains on its own shard with no gradient averaging (found with
    transformers 5.23). Clearing the mark lets ``train()`` wrap the model in DDP as it would without the evaluation.
    """
    model = trainer.model
    if trainer.accelerator.num_processes < 2 or getattr(model, "_sharded_by_hf_dtrain", False):
        return  # (a model sharded by hf_dtrain is marked prepared on purpose: hf_dtrain.parallel.section.keep_sharded)
    if getattr(model, "_is_accelerate_prepared", False) and trainer.model_wrapped is model:
        del model._is_accelerate_prepared
        trainer.accelerator._models[:] = [m for m in trainer.accelerator._models if m is not model]
