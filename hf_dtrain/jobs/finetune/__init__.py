"""``hf-dtrain finetune``: fine-tune a causal LM with one of hf_dtrain's (or peft's) methods through TRL's
``SFTTrainer``.

``run_finetune(FinetuneConfig(...))``: the base model and the data (:mod:`hf_dtrain.jobs.sft.data`), the model
wrapped for ``method`` (or a saved ``peft_config``), the engine sections the settings switch on
(:mod:`hf_dtrain.run`), ``SFTTrainer`` on every ``SFTConfig`` setting given (:mod:`.trainer`), evaluation before and
after (eval loss; exact-match accuracy on prompt-completion data), the adapter (or the full model), a model card,
``results.json`` and a table (:mod:`.report`). Works in one process and under ``accelerate launch`` / ``torchrun``
(DDP, FSDP2, DeepSpeed; only rank 0 writes and prints).
"""

from __future__ import annotations

from hf_dtrain.jobs.sft.config import finetune_config_class
from hf_dtrain.jobs.sft.data import load_base_and_data
from hf_dtrain.run.job import JobRun

from . import report, trainer
from .skeleton import skeleton


def run_finetune(cfg) -> dict:
    """Run one fine-tuning job; return the measured figures (also written to ``<output_dir>/results.json``)."""
    run = JobRun(cfg, skeleton=skeleton)  # clashes refused, sections checked, then the process group
    if run.answered is not None:  # a section answered without training (the step's memory, traced)
        return run.answered
    args = trainer.arguments(cfg, run)  # the SFTConfig: the job's defaults, the user's settings, the sections'
    with run.main_first():  # rank 0 builds the default base once; the others read the cache
        data = load_base_and_data(cfg, progress=cfg.progress and run.is_main)
    model, callbacks = trainer.adapt(cfg, run, data, args)  # the method's peft config and prepare step
    run.prepare(model)  # the sections' (FSDP2...)
    optimizer = run.optimizer(model, args.learning_rate, args.weight_decay)  # None: the Trainer's AdamW
    sft = trainer.build(cfg, run, data, model, args, callbacks + run.callbacks(), optimizer)
    measured = trainer.train(run, sft, args, before=cfg.evaluate_before)
    results = report.results(cfg, run, sft, data, args, measured)
    run.finish(sft.model, data.tokenizer, args.output_dir, results, write=lambda: report.write(cfg, results))
    run.close()
    return results


def __getattr__(name: str):
    if name == "FinetuneConfig":
        return finetune_config_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
