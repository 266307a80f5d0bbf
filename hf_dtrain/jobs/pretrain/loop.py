"""The pretraining job's run: :func:`build`, :func:`train_step`, :func:`train` and :func:`report` (see
:mod:`hf_dtrain.jobs.pretrain`)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch

from hf_dtrain.errors import check_writable
from hf_dtrain.run.job import JobRun

from .data import batches, default_tokenizer, load_blocks, loader, schedule
from .skeleton import skeleton


@dataclass
class Parts:
    """What the run trains with, built from the config."""

    accelerator: object
    tokenizer: object
    module: torch.nn.Module  # the model itself (on a mesh: this rank's stages and shards)
    model: torch.nn.Module  # what is called: the module, or Accelerate's DDP wrapper of it
    optimizer: object
    scheduler: object
    loader: object  # a hf_dtrain.run.section.Loader
    train: object
    held_out: object


def run_pretrain(cfg) -> dict:
    """Run one pretraining job; return the measured figures (also ``<output_dir>/results.json``)."""
    run = JobRun(cfg, start=False, skeleton=skeleton)  # clashes refused, sections checked (the mesh's degrees)
    if run.answered is not None:  # a section answered without training (the step's memory, traced)
        return run.answered
    check_writable(cfg.output_dir, "--output-dir")
    run.start()  # the process group
    parts = build(cfg, run)
    if run.start_step is None:  # a snapshot says the job completed: its results stand
        run.close()
        return run.completed
    history = train(cfg, run, parts)
    return report(cfg, run, parts, history)


def build(cfg, run) -> Parts:
    """The tokenizer and blocks (rank 0 first: it trains and caches the tokenizer), the model from the preset, the
    sections' preparation (DELTA, the mesh, FSDP2), the optimizer and schedule, the loader, Accelerate's wrapping
    (not of a model a section laid out on a mesh), then the sections that need the wrapped model (a comm hook, the
    restored snapshot)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DataLoaderConfiguration, set_seed

    from hf_dtrain.models import build_llama, trained_vocab_size

    # Accelerate's state is one per process and outlives its Accelerator: an earlier job in this process (a bf16
    # fine-tune's Trainer) would leave its bf16 for this loop, which the environment (accelerate launch's
    # --mixed_precision) says instead; TrainingArguments resets it the same way
    AcceleratorState._reset_state(reset_partial_state=False)
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        kwargs_handlers=run.accelerator_kwargs(),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    with run.main_first():
        tokenizer = default_tokenizer(cfg.preset)
        train_blocks, held_out = load_blocks(cfg, tokenizer, run.rank, run.world_size, run.replicas)
    set_seed(cfg.seed)
    module = build_llama(cfg.preset, seed=cfg.seed, vocab_size=max(len(tokenizer), trained_vocab_size(cfg.preset)))
    module.train()
    run.prepare(module)
    optimizer = run.optimizer(module, cfg.learning_rate, cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(cfg))
    dealt = loader(cfg, run, train_blocks)
    model = module
    if not run.laid_out:
        model, optimizer, scheduler = accelerator.prepare(module, optimizer, scheduler)
    if dealt.prepare:
        dealt.loader = accelerator.prepare(dealt.loader)
    run.trained, run.scheduler = model, scheduler  # what the snapshots hold: each rank's own shards and stages
    run.after_prepare(model, optimizer)
    return Parts(accelerator, tokenizer, module, model, optimizer, scheduler, dealt, train_blocks, held_out)


def train_step(run, parts: Parts, blocks) -> float:
    """One optimizer step: forward and backward (a section's, over pipeline micro-batches or tensor-parallel shards;
    else the plain one, its loss scaled as the loader says), the sections' moment before the step (a snapshot in
    flight finishes), the step. Returns the loss."""
    loss = run.forward_backward(parts.model, blocks, parts.accelerator)
    if loss is None:
        loss = parts.model(input_ids=blocks, labels=blocks).loss
        parts.accelerator.backward(loss * parts.loader.loss_scale)
    run.before_optimizer_step()
    parts.optimizer.step()
    parts.scheduler.step()
    parts.optimizer.zero_grad()
    return loss.item()


def train(cfg, run, parts: Parts) -> list[dict]:
    """The loop from ``run.start_step`` (a restored snapshot moves it) to ``max_steps``: one :func:`train_step` per
    batch, the sections after each (the loss guard, a snapshot), one line per step in ``history_rank<r>.jsonl`` as it
    happens (kept across a crash and the relaunch: the full curve of a restarted run)."""
    from tqdm.auto import tqdm

    start, history, t0 = run.start_step, [], time.perf_counter()
    os.makedirs(cfg.output_dir, exist_ok=True)
    step_log = open(os.path.join(cfg.output_dir, f"history_rank{run.rank}.jsonl"), "a")
    bar = tqdm(
        total=cfg.max_steps,
        initial=start - 1,
        disable=not (cfg.progress and run.is_main),
        desc=f"pretrain {cfg.preset}",
    )
    step = start - 1
    with run.guard():
        for blocks in batches(parts.loader.loader, start, callable(parts.train)) if start <= cfg.max_steps else ():
            step += 1
            if run.monitor is not None:
                run.monitor.step = step  # published at once: a dead rank is named with the step it was on
            loss = train_step(run, parts, blocks.to(run.device))
            history.append({"step": step, "loss": loss, "seconds": time.perf_counter() - t0})
            step_log.write(json.dumps({**history[-1], "time": time.time()}) + "\n")
            step_log.flush()  # before the sections' (a snapshot, the loss guard): the step happened, whatever follows
            run.after_step(step, loss)
            bar.update(1)
            if run.is_main and cfg.logging_steps and step % cfg.logging_steps == 0:
                bar.write(f"step {step}: loss {loss:.4f}")
            if step >= cfg.max_steps:
                break
    bar.close()
    step_log.close()
    run.end()
    return history


def held_out_loss(run, parts: Parts, model) -> float | None:
    """The mean loss on the held-out blocks: a section's (a pipeline, tensor-parallel shards), else the plain one."""
    if parts.held_out is None or not len(parts.held_out):
        return None
    with torch.no_grad():
        parts.module.eval()
        loss = run.evaluate(model, parts.held_out, parts.loader.batch_size)
        if loss is None:
            losses = [
                model(input_ids=b.to(run.device), labels=b.to(run.device)).loss.item() for b in parts.held_out.split(16)
            ]
            loss = sum(losses) / len(losses) if losses else None
        parts.module.train()
    return loss


def report(cfg, run, parts: Parts, history: list[dict]) -> dict:
    """The held-out loss, ``results_rank<r>.json`` on every rank, ``results.json`` and the model (the sections say how
    it is gathered or split), a one-line summary."""
    import dataclasses

    from hf_dtrain.parallel import local_param_bytes

    model = parts.model if run.laid_out else parts.accelerator.unwrap_model(parts.model)
    held = held_out_loss(run, parts, model)
    run.evaluated(held, history[-1]["step"] if history else run.start_step - 1)
    results = dict(
        preset=cfg.preset,
        world_size=run.world_size,
        rank=run.rank,
        steps=cfg.max_steps,
        first_step=run.start_step,
        batch_size=parts.loader.batch_size,
        history=history,
        held_out_loss=held,
        **run.results(),
        param_bytes_local=local_param_bytes(parts.module),
        config=dataclasses.asdict(cfg),
    )
    with open(os.path.join(cfg.output_dir, f"results_rank{run.rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    parts.accelerator.wait_for_everyone()
    run.finish(model, parts.tokenizer, cfg.output_dir, results, save_model=cfg.save_model)
    if run.is_main:
        first, last = (history[0]["loss"], history[-1]["loss"]) if history else (float("nan"), float("nan"))
        print(f"pretrain {cfg.preset}: loss {first:.4f} -> {last:.4f}, held-out {held}", flush=True)
    run.close()
    return results
