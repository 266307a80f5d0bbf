"""Fine-tune a causal LM with one of hf_dtrain's (or peft's) methods on the default task or a user dataset.

``run_finetune(FinetuneConfig(...))`` is what ``hf-dtrain finetune`` runs: load the base model (the embedded default
when ``model`` is None), wrap it for ``method``, train with the HF ``Trainer``, evaluate before and after (eval loss
and exact-match accuracy), save the adapter (or the full model), a model card and ``results.json``, print a table.
Works in one process and under ``accelerate launch`` / ``torchrun`` (DDP; only rank 0 writes and prints).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from dataclasses import dataclass, field

import torch

from hf_dtrain.compose import (EXCHANGING, ComposeOptions, build_optimizer, check_local_path, fsdp_from_launcher,
                               keep_sharded, run_identity, shard_with_fsdp, snapshot_config_for, wire_bytes)
from hf_dtrain.parallel import local_param_bytes
from hf_dtrain.parallel.zero import deepspeed_config
from hf_dtrain.model_card import write_model_card
from hf_dtrain.tuners.finetune_method import FINETUNE_METHODS, LORA_TARGETS
from hf_dtrain.tuners.smt.job import SMT_TARGETS

# Each method's fine-tuning knowledge (default learning rate, 4-bit bases, peft config with the budget matched to
# LoRA's, its own optimizer) lives in its tuner folder: hf_dtrain/tuners/<method>/job.py.
METHODS = tuple(FINETUNE_METHODS)
DEFAULT_LR = {name: m.default_lr for name, m in FINETUNE_METHODS.items()}
# Which methods train on which 4-bit base (``--quantize``); see hf_dtrain.quantization.
QUANTIZED_METHODS = {base: tuple(n for n, m in FINETUNE_METHODS.items() if base in m.quantized_bases)
                     for base in ("nf4", "hqq4", "int4")}


@dataclass
class FinetuneConfig(ComposeOptions):
    """Settings of one fine-tuning run; every field is also a ``hf-dtrain finetune`` flag and a recipe YAML key (the
    switches of :class:`hf_dtrain.compose.ComposeOptions` included)."""

    method: str = field(default="lorafa", metadata={"help": f"One of {', '.join(METHODS)}."})
    model: str | None = field(default=None, metadata={"help": "Base model path or hub id; None = embedded default."})
    dataset: str | None = field(default=None, metadata={
        "help": "Local json/jsonl/csv with prompt/completion columns or a hub dataset; None = default addition task."})
    output_dir: str | None = field(default=None, metadata={"help": "Where to save; default outputs/finetune-<method>."})
    max_steps: int = field(default=2000, metadata={"min": 1, "help": "Optimizer steps."})
    learning_rate: float | None = field(default=None, metadata={"gt": 0, "help": f"Peak LR; default per method {DEFAULT_LR}."})
    per_device_train_batch_size: int = field(default=16, metadata={"min": 1, "help": "Batch size per process."})
    gradient_accumulation_steps: int = field(default=1, metadata={"min": 1, "help": "Micro-batches per optimizer step."})
    warmup_steps: int = field(default=20, metadata={"min": 0, "help": "Linear LR warm-up steps."})
    weight_decay: float = field(default=0.0, metadata={"min": 0, "help": "AdamW weight decay."})
    seed: int = field(default=0, metadata={"min": 0, "help": "Seed of adapter init, data order and the default task's data."})
    lora_r: int = field(default=8, metadata={"min": 1, "help": "Rank for lora, dora and lorafa."})
    lora_alpha: int = field(default=16, metadata={"gt": 0, "help": "Scaling numerator for lora, dora and lorafa."})
    lora_dropout: float = field(default=0.0, metadata={"min": 0, "lt": 1, "help": "Dropout for lora and dora."})
    lorafa_optimizer: bool = field(default=True, metadata={
        "help": "lorafa: use hf_dtrain's create_lorafa_optimizer instead of the Trainer's AdamW."})
    smt_block_size: int = field(default=64, metadata={"min": 1, "help": "smt: side of the square sub-matrices."})
    smt_num_blocks: int | None = field(default=None, metadata={"min": 1, 
        "help": "smt: blocks to train; default matches the trainable budget of lora at lora_r."})
    smt_warmup_steps: int = field(default=20, metadata={"min": 1, "help": "smt: gradient-scoring steps before selection."})
    quantize: str | None = field(default=None, metadata={
        "help": "Load the base in 4 bits: nf4 (bitsandbytes), hqq4 (HQQ, zero-points) or int4 (hf_dtrain's Int4Linear, "
                "zero-points); qahira merges exactly into hqq4/int4."})
    quant_group_size: int = field(default=64, metadata={"min": 1, 
        "help": "hqq4/int4: quantization group size along in_features (also qahira's input pooling factor)."})
    qbara_pool: int = field(default=2, metadata={"min": 1, "help": "qbara: pooling/repeat factor lambda (rank lambda * lora_r)."})
    qahira_lambda_out: int | None = field(default=None, metadata={"min": 1, 
        "help": "qahira: output repeat factor; default the divisor of every target's out_features whose parameter "
                "count is closest to lora's at lora_r."})
    target_modules: list[str] | None = field(default=None, metadata={
        "help": f"Modules to adapt; default {LORA_TARGETS} (lora/dora/lorafa), {SMT_TARGETS} (smt)."})
    task_digits: int | None = field(default=None, metadata={"min": 1, 
        "help": "Default task: operands have 1 to N digits (default hf_dtrain.tasks.TASK_DIGITS)."})
    train_size: int = field(default=32000, metadata={"min": 1, "help": "Training examples (default task) or cap (dataset)."})
    eval_size: int = field(default=200, metadata={"min": 1, "help": "Held-out examples for eval loss and accuracy."})
    max_length: int = field(default=512, metadata={"min": 2, "help": "Truncation length for --dataset examples."})
    logging_steps: int = field(default=200, metadata={"min": 1, "help": "Log the training loss every N steps."})
    report: bool = field(default=True, metadata={"help": "Print the result table (rank 0)."})
    progress: bool = field(default=True, metadata={"help": "Show progress bars."})
    base_preset: str = field(default="tiny", metadata={"help": "Preset of the embedded default base model."})
    base_steps: int | None = field(default=None, metadata={"min": 1, "help": "Pretraining steps of the default base model."})

    def __post_init__(self):
        from hf_dtrain.settings import check_fields

        check_fields(self)
        self.method = str(self.method).lower()
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is unknown; set --method to one of {', '.join(METHODS)}.")
        if isinstance(self.target_modules, str):
            self.target_modules = [m.strip() for m in self.target_modules.split(",") if m.strip()]
        self.validate()
        check_local_path(self, "dataset")
        check_local_path(self, "model")
        if self.quantize is not None:
            self.quantize = str(self.quantize).lower()
            if self.quantize in ("none", ""):
                self.quantize = None
        if self.quantize is not None:
            if self.quantize not in QUANTIZED_METHODS:
                raise ValueError(f"quantize={self.quantize!r} is unknown; set --quantize to one of "
                                 f"{', '.join(QUANTIZED_METHODS)} (or leave it out for a dense base).")
            if self.method not in QUANTIZED_METHODS[self.quantize]:
                raise ValueError(f"method={self.method!r} cannot train on a {self.quantize} base; with "
                                 f"--quantize {self.quantize} use --method one of "
                                 f"{', '.join(QUANTIZED_METHODS[self.quantize])}.")



def build_peft_config(cfg: FinetuneConfig, model):
    """The peft config for ``cfg.method`` (None for "full"), built by the method's own ``tuners/<method>/job.py``."""
    return FINETUNE_METHODS[cfg.method].build_config(cfg, model)


def _count(model):
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total


def format_table(r: dict) -> str:
    method = r["method"] + (f" on {r['quantize']}" if r.get("quantize") else "")
    cols = [("method", method), ("trainable", f"{r['trainable_params']:,} ({r['trainable_pct']:.2f}%)"),
            ("train s", f"{r['train_seconds']:.1f}"),
            ("eval loss", f"{r['eval_loss_before']:.3f} -> {r['eval_loss_after']:.3f}"),
            ("accuracy", f"{r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f}")]
    widths = [max(len(h), len(v)) for h, v in cols]
    line = "| " + " | ".join(h.ljust(w) for (h, _), w in zip(cols, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    val = "| " + " | ".join(v.ljust(w) for (_, v), w in zip(cols, widths)) + " |"
    return "\n".join([line, sep, val])


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


def engine_callbacks(cfg: FinetuneConfig, output_dir: str):
    """(DELTA callback, fault-tolerance callback), each None when its section is off; each gets its section's config
    object as it is (the snapshot config with the job's default disk directory when it persists)."""
    delta_cb = ft = None
    if cfg.delta is not None:
        from hf_dtrain.memory import DeltaCallback

        delta_cb = DeltaCallback(cfg.delta)
    if cfg.fault_tolerance is not None:
        from hf_dtrain.fault import InMemoryFaultToleranceCallback

        ft = InMemoryFaultToleranceCallback(snapshot_config_for(cfg.fault_tolerance, output_dir),
                                            identity=run_identity(cfg))
    return delta_cb, ft


def run_finetune(cfg: FinetuneConfig) -> dict:
    """Run one fine-tuning job; return the measured figures (also written to ``<output_dir>/results.json``)."""
    from accelerate import PartialState
    from transformers import Trainer, TrainingArguments, set_seed

    from hf_dtrain import tasks
    from hf_dtrain.models import build_default_model, load_model_and_tokenizer

    from hf_dtrain.distributed import RankMonitor, init_distributed

    init_distributed()  # under torchrun's / accelerate's restarts: the generation's own store keys
    use_cpu = not torch.cuda.is_available()
    if cfg.deepspeed and use_cpu:
        # Accelerate 1.15 enables DeepSpeed only off the CPU: the Trainer would silently train with DDP instead.
        # Forcing it on (use_cpu=False, DS_ACCELERATOR=cpu) trains, but Accelerate finds no backend for a CPU
        # without use_cpu and counts 1 process: the Trainer would not split the data between the ranks, and its
        # evaluation gather fails. ZeRO on CPU is tested from Python (tests/parallel/test_zero.py).
        raise ValueError(f"deepspeed={cfg.deepspeed}: on a machine without CUDA, Accelerate (1.15) does not enable "
                         "DeepSpeed for the Trainer and would silently run DDP. Run --deepspeed on a GPU machine, "
                         "use --fsdp here, or call deepspeed.initialize yourself (DS_ACCELERATOR=cpu; see "
                         "docs/sharded.md).")
    state = PartialState(cpu=use_cpu)
    world_size = state.num_processes
    # clashes are refused before the base model is built or loaded (minutes for the embedded default); the
    # launcher's WORLD_SIZE, since PartialState can report 1 under accelerate launch on CPU
    cfg.fsdp = fsdp_from_launcher(cfg.fsdp)
    cfg.check(int(os.environ.get("WORLD_SIZE", world_size)), engine="trainer",
              lorafa_optimizer=cfg.method == "lorafa" and cfg.lorafa_optimizer)
    output_dir = cfg.output_dir or os.path.join("outputs", f"finetune-{cfg.method}")
    lr = cfg.learning_rate if cfg.learning_rate is not None else DEFAULT_LR[cfg.method]

    # The default base model is built once, by rank 0; the other ranks wait and then read the cache.
    with state.main_process_first():
        if cfg.model is None:
            base_path = build_default_model(cfg.base_preset, steps=cfg.base_steps,
                                            progress=cfg.progress and state.is_main_process)
        else:
            base_path = cfg.model
        if cfg.quantize is None:
            model, tokenizer = load_model_and_tokenizer(base_path)
        else:
            from hf_dtrain.quantization import load_quantized_model

            _, tokenizer = load_model_and_tokenizer(base_path, load_model=False)
            model = load_quantized_model(base_path, cfg.quantize, group_size=cfg.quant_group_size)
        if cfg.dataset is None:
            digits = cfg.task_digits or tasks.TASK_DIGITS
            train_ds = tasks.make_task_dataset(tokenizer, cfg.train_size, seed=cfg.seed, split="train", digits=digits)
            eval_ds = tasks.make_task_dataset(tokenizer, cfg.eval_size, seed=cfg.seed, split="eval", digits=digits)
        else:
            train_ds, eval_ds = tasks.load_task_dataset(cfg.dataset, tokenizer, train_size=cfg.train_size,
                                                        eval_size=cfg.eval_size, seed=cfg.seed,
                                                        max_length=cfg.max_length)
    collator = tasks.task_collator(tokenizer)

    set_seed(cfg.seed)
    peft_config = build_peft_config(cfg, model)
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)

    args = TrainingArguments(
        output_dir=output_dir, max_steps=cfg.max_steps, learning_rate=lr,
        per_device_train_batch_size=cfg.per_device_train_batch_size, per_device_eval_batch_size=64,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, warmup_steps=cfg.warmup_steps,
        weight_decay=cfg.weight_decay, lr_scheduler_type="linear", seed=cfg.seed, data_seed=cfg.seed,
        use_cpu=use_cpu, report_to=[], save_strategy="no", eval_strategy="no", logging_steps=cfg.logging_steps,
        disable_tqdm=not cfg.progress, remove_unused_columns=False, dataloader_num_workers=0,
        ddp_find_unused_parameters=False if cfg.method != "full" else None,
        # DeAR averages the gradients after step() is called, and the exchanging optimizers never average them:
        # clipping local gradients would be wrong
        max_grad_norm=0.0 if cfg.comm_method == "dear" or cfg.optimizer in EXCHANGING else 1.0,
        deepspeed=deepspeed_config(cfg.deepspeed) if cfg.deepspeed else None,
        # asynchronous gossip: a buffer broadcast in every forward would make every step a synchronisation point
        ddp_broadcast_buffers=False if cfg.asynchronous_gossip else None,
    )
    # The Trainer's view of the world (PartialState alone can report 1 under accelerate launch on CPU).
    world_size = args.world_size
    callbacks = []
    if cfg.method == "smt":
        if world_size > 1 or cfg.fsdp is not None or cfg.deepspeed:
            # DDP cannot change parameter shapes after wrapping, nor FSDP2 / DeepSpeed after sharding: select first
            from torch.utils.data import DataLoader, DistributedSampler

            from hf_dtrain.tuners.smt import smt_warmup

            sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=state.process_index,
                                         shuffle=True, seed=cfg.seed)
            loader = DataLoader(train_ds, batch_size=cfg.per_device_train_batch_size, sampler=sampler,
                                collate_fn=collator)
            smt_warmup(model, loader, num_steps=cfg.smt_warmup_steps)
        else:
            from hf_dtrain.tuners.smt import SMTSelectionCallback

            callbacks.append(SMTSelectionCallback())
    fsdp_exchange = None
    if cfg.fsdp is not None:
        # before any optimizer exists: they are built on the sharded parameters; a comm hook compresses the HSDP
        # replica exchange (the clash check allowed it only with fsdp.replicate >= 2)
        fsdp_exchange = shard_with_fsdp(model, cfg.fsdp, cfg.comm_hook)
        keep_sharded(model)
    optimizers = (None, None)
    if cfg.optimizer != "adamw":
        optimizers = (build_optimizer(cfg, model, lr, cfg.weight_decay), None)
    delta_cb, ft = engine_callbacks(cfg, output_dir)
    callbacks += [cb for cb in (delta_cb, ft) if cb is not None]
    own = FINETUNE_METHODS[cfg.method].build_optimizer
    own_optimizer = own(cfg, model, lr, cfg.weight_decay) if own is not None else None
    if own_optimizer is not None:  # the method's own optimizer (lorafa's); the clash check above refused another
        optimizers = (own_optimizer, None)

    trainer = Trainer(model=model, args=args, data_collator=collator, train_dataset=train_ds, eval_dataset=eval_ds,
                      processing_class=tokenizer, compute_metrics=tasks.compute_metrics,
                      preprocess_logits_for_metrics=tasks.preprocess_logits_for_metrics, callbacks=callbacks,
                      optimizers=optimizers)

    if cfg.deepspeed and not trainer.is_deepspeed_enabled:  # never train something other than what was asked
        raise RuntimeError(f"deepspeed={cfg.deepspeed} was given but Accelerate did not enable DeepSpeed (distributed "
                           f"type {trainer.accelerator.distributed_type}); launch with accelerate launch / torchrun / "
                           "deepspeed so that LOCAL_RANK is set.")

    comm = None
    if (cfg.comm_hook is not None and cfg.fsdp is None) or cfg.optimizer in EXCHANGING:
        from hf_dtrain.callbacks import CommHookCallback

        comm = CommHookCallback.attach(trainer, "noop" if cfg.optimizer in EXCHANGING else cfg.comm_hook)
        if ft is not None:
            ft.add_stateful("comm_hook", comm)  # the hook's error feedback goes into the snapshots

    resume = ft.resume_checkpoint(trainer) if ft is not None else None
    before = trainer.evaluate()  # adapters start as the identity: this is the base model
    if cfg.fsdp is None:
        _allow_ddp_after_evaluate(trainer)
    t0 = time.perf_counter()
    monitor = None
    if world_size > 1:
        monitor = RankMonitor(resume_hint="relaunch the same command to resume" + (
            " from the snapshot processes, which keep the state" if ft is not None else ""))
        monitor.step_of = lambda: trainer.state.global_step
    with monitor.guard() if monitor is not None else contextlib.nullcontext():
        train_out = trainer.train(resume_from_checkpoint=resume)
    if monitor is not None:
        monitor.close()
    train_seconds = time.perf_counter() - t0
    after = trainer.evaluate()
    # FSDP2 holds shards, not replicas (with fsdp.replicate > 1 the replicas are kept equal by FSDP2's own all-reduce)
    sharded = cfg.fsdp is not None or (cfg.deepspeed_stage() or 0) == 3
    replicas_identical = None if sharded else _replicas_identical(trainer.model, world_size)

    trainable, total = _count(trainer.model)
    results = dict(
        method=cfg.method, base_model=cfg.model or f"hf_dtrain default ({cfg.base_preset})", base_path=base_path,
        quantize=cfg.quantize,
        comm=(wire_bytes(optimizer=trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer")
                         else trainer.optimizer) if cfg.optimizer in EXCHANGING
              else comm.summary() if comm is not None
              else dict(method=cfg.comm_hook.method, **wire_bytes(fsdp_exchange)) if fsdp_exchange is not None
              else None),
        delta=None if delta_cb is None else {
            "saved_bytes": [h["saved_bytes"] for h in delta_cb.history if not h["profiling"]],
            "budget_bytes": delta_cb.budgets},
        fault_tolerance=None if ft is None else {
            "snapshots": ft.snapshots, "restored": None if ft.restored is None else {
                "step": ft.restored.step, "source": ft.restored.source}},
        replicas_identical=replicas_identical,
        dataset=cfg.dataset or "default addition task (hf_dtrain.tasks)",
        trainable_params=trainable, total_params=total, trainable_pct=100.0 * trainable / max(1, total),
        param_bytes_local=local_param_bytes(trainer.model),
        train_seconds=train_seconds, train_loss=float(train_out.training_loss),
        eval_loss_before=float(before["eval_loss"]), eval_loss_after=float(after["eval_loss"]),
        accuracy_before=float(before["eval_accuracy"]), accuracy_after=float(after["eval_accuracy"]),
        losses={int(h["step"]): float(h["loss"]) for h in trainer.state.log_history if "loss" in h},
        max_steps=cfg.max_steps, learning_rate=lr, per_device_train_batch_size=cfg.per_device_train_batch_size,
        world_size=world_size, output_dir=output_dir, config=dataclasses.asdict(cfg),
        engine="fsdp2" if cfg.fsdp is not None else f"deepspeed-zero{cfg.deepspeed_stage()}" if cfg.deepspeed
        else "ddp" if world_size > 1 else "single process",
    )
    if cfg.fsdp is not None or cfg.deepspeed:
        from hf_dtrain.parallel import save_pretrained

        save_pretrained(trainer.model, output_dir)  # every rank gathers (FSDP2, ZeRO-3); rank 0 writes
    if trainer.is_world_process_zero():
        os.makedirs(output_dir, exist_ok=True)
        if cfg.fsdp is None and not cfg.deepspeed:
            trainer.model.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
        base_name = cfg.model or f"hf_dtrain/default-{cfg.base_preset}"
        write_model_card(output_dir, results, base_name)
        with open(os.path.join(output_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=2)
        if cfg.report:
            print(format_table(results), flush=True)
    state.wait_for_everyone()
    return results
