"""LLaMA-architecture pretraining from a ``LlamaConfig`` preset, with any compatible combination of hf_dtrain's parts.

``run_pretrain(PretrainConfig(...))`` is what ``hf-dtrain pretrain`` runs (one process, or under ``accelerate
launch`` / ``torchrun``): a model built from the preset (tiny and small here; llama2-7b / llama3-8b shapes for GPU
users), a tokenized text dataset packed into blocks (the Python standard library's source by default; a local text
or jsonl file or a hub dataset, ``streaming`` for large ones), an Accelerate training loop, and the switches of
:class:`hf_dtrain.compose.ComposeOptions`: a communication hook or a 1-bit / decentralized optimizer, Eva, DELTA, in-
memory fault tolerance and the heterogeneity-aware sampler. Writes ``results.json`` (losses with wall time, held-out
loss, bytes per step, DELTA's saved bytes, snapshots and the restore source) and, on rank 0, the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from hf_dtrain.compose import (EXCHANGING, ComposeOptions, build_optimizer, check_local_path, fsdp_from_launcher,
                               keep_sharded, run_identity, shard_with_fsdp, snapshot_config_for, wire_bytes)

logger = logging.getLogger(__name__)


@dataclass
class PretrainConfig(ComposeOptions):
    """Settings of one pretraining run; every field is a ``hf-dtrain pretrain`` flag and a recipe YAML key."""

    preset: str = field(default="tiny", metadata={"help": "LlamaConfig preset (hf_dtrain.models.PRESETS)."})
    dataset: Optional[str] = field(default=None, metadata={
        "help": "A local .txt/.jsonl/.json file or a hub dataset with a text column; None = the Python standard "
                "library's source (on every machine)."})
    dataset_config: Optional[str] = field(default=None, metadata={"help": "Hub dataset configuration name."})
    text_column: str = field(default="text", metadata={"help": "Column holding the text."})
    streaming: bool = field(default=False, metadata={"help": "Stream the dataset (hub datasets too large to load)."})
    data_bytes: int = field(default=2_000_000, metadata={"min": 1000, "help": "Default corpus: bytes of stdlib source to use."})
    seq_len: int = field(default=128, metadata={"min": 2, "help": "Tokens per training block."})
    per_device_train_batch_size: int = field(default=16, metadata={"min": 1, 
        "help": "Blocks per process per step (with --hetero-speeds: the global batch is this x processes)."})
    max_steps: int = field(default=200, metadata={"min": 1, "help": "Optimizer steps."})
    learning_rate: float = field(default=1e-3, metadata={"gt": 0, "help": "Peak learning rate."})
    warmup_steps: int = field(default=20, metadata={"min": 0, "help": "Linear warm-up steps, then cosine decay to a tenth."})
    weight_decay: float = field(default=0.0, metadata={"min": 0, "help": "Weight decay."})
    seed: int = field(default=0, metadata={"min": 0, "help": "Seed of the init and the data order."})
    output_dir: str = field(default="outputs/pretrain", metadata={"help": "Where results.json and the model go."})
    logging_steps: int = field(default=10, metadata={"min": 0, "help": "Print the loss every N steps (rank 0)."})
    eval_blocks: int = field(default=64, metadata={"min": 0, "help": "Held-out blocks for the final loss (default corpus)."})
    save_model: bool = field(default=True, metadata={"help": "Save the model and tokenizer at the end (rank 0)."})
    progress: bool = field(default=True, metadata={"help": "Show a progress bar."})

    def __post_init__(self):
        from hf_dtrain.settings import check_fields

        check_fields(self)
        from hf_dtrain.models import PRESETS

        if self.preset not in PRESETS:
            raise ValueError(f"preset={self.preset!r} is unknown; set --preset to one of {', '.join(PRESETS)}.")
        for name in ("seq_len", "per_device_train_batch_size", "max_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}.")
        self.validate()
        check_local_path(self, "dataset")



def default_tokenizer(preset: str, data_bytes: int = 1_000_000):
    """A byte-level BPE tokenizer for ``preset``'s vocabulary trained on the stdlib's source, cached on disk."""
    from transformers import AutoTokenizer

    from hf_dtrain.models import PRESETS, cache_root, stdlib_text, train_tokenizer

    path = cache_root() / "tokenizers" / f"{preset}-{PRESETS[preset]['vocab_size']}-{data_bytes}"
    if (path / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(path))
    tok = train_tokenizer(stdlib_text(data_bytes), vocab_size=PRESETS[preset]["vocab_size"])
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    try:
        os.replace(tmp, path)
    except OSError:  # another process won the race
        pass
    return AutoTokenizer.from_pretrained(str(path))


def _pack(tokenizer, texts, seq_len: int) -> torch.Tensor:
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=True):
        ids.extend(enc.ids)
        ids.append(eos)
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def load_blocks(cfg: PretrainConfig, tokenizer, rank: int, world: int):
    """(train, held-out): tensors of token blocks, or for ``streaming`` an iterable of this rank's blocks and None."""
    if cfg.dataset is None:
        from hf_dtrain.models import stdlib_text

        blocks = _pack(tokenizer, stdlib_text(cfg.data_bytes), cfg.seq_len)
        g = torch.Generator().manual_seed(1234)
        blocks = blocks[torch.randperm(len(blocks), generator=g)]
        held = min(cfg.eval_blocks, len(blocks) // 10)
        return blocks[held:], blocks[:held]
    from datasets import load_dataset

    path = cfg.dataset
    if os.path.exists(path):
        kind = "text" if path.endswith(".txt") else "json"
        ds = load_dataset(kind, data_files=path, split="train", streaming=cfg.streaming)
    else:
        ds = load_dataset(path, cfg.dataset_config, split="train", streaming=cfg.streaming)
    if cfg.streaming:
        from datasets.distributed import split_dataset_by_node

        ds = split_dataset_by_node(ds, rank=rank, world_size=world)

        def stream():
            buf: list[str] = []
            for row in ds:
                buf.append(row[cfg.text_column])
                if len(buf) == 256:
                    yield from _pack(tokenizer, buf, cfg.seq_len)
                    buf = []
            if buf:
                yield from _pack(tokenizer, buf, cfg.seq_len)

        return stream, None
    if cfg.text_column not in ds.column_names:
        raise ValueError(f"dataset {path} has no column {cfg.text_column!r} (columns: {ds.column_names}); set "
                         "--text-column.")
    blocks = _pack(tokenizer, ds[cfg.text_column], cfg.seq_len)
    held = min(cfg.eval_blocks, len(blocks) // 10)
    return blocks[held:], blocks[:held]


def _schedule(cfg: PretrainConfig):
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        t = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return factor


def run_pretrain(cfg: PretrainConfig) -> dict:
    """Run one pretraining job; return the measured figures (also ``<output_dir>/results.json``)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    from accelerate.utils import DataLoaderConfiguration

    from hf_dtrain.distributed import unwrap_optimizer
    from hf_dtrain.models import PRESETS, build_llama
    from hf_dtrain.parallel import local_param_bytes

    # a seedable sampler: epoch e's order depends on (seed, e) only, so a resumed run skips into the same order
    from hf_dtrain.distributed import RankMonitor, init_distributed

    init_distributed()  # under torchrun's / accelerate's restarts: the generation's own store keys
    accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    world, rank = accelerator.num_processes, accelerator.process_index
    cfg.fsdp = fsdp_from_launcher(cfg.fsdp)
    cfg.check(world, engine="accelerate")
    with accelerator.main_process_first():
        tokenizer = default_tokenizer(cfg.preset)
        train, held_out = load_blocks(cfg, tokenizer, rank, world)
    set_seed(cfg.seed)
    model = build_llama(cfg.preset, seed=cfg.seed, vocab_size=max(len(tokenizer), PRESETS[cfg.preset]["vocab_size"]))
    model.train()
    delta = None
    if cfg.delta is not None:
        from hf_dtrain.memory import apply_delta

        delta = apply_delta(model, cfg.delta)  # on the unwrapped model
    fsdp_exchange = None
    if cfg.fsdp is not None:
        # before the optimizer: it is built on the sharded parameters; a comm hook compresses the HSDP replica
        # exchange (the clash check allowed it only with fsdp.replicate >= 2)
        fsdp_exchange = shard_with_fsdp(model, cfg.fsdp, cfg.comm_hook)
        keep_sharded(model)
    optimizer = build_optimizer(cfg, model, cfg.learning_rate, cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(cfg))

    batch = cfg.per_device_train_batch_size
    loss_scale = 1.0
    if callable(train):  # streaming: this rank's blocks in order
        from torch.utils.data import IterableDataset

        class _Stream(IterableDataset):
            def __iter__(self):
                return iter(train())

        loader = DataLoader(_Stream(), batch_size=batch)
        prepare_loader = False
    elif cfg.hetero_speeds is not None:
        from hf_dtrain.data import HeterogeneityAwareSampler

        sampler = HeterogeneityAwareSampler(None, cfg.hetero_speeds, rank=rank, num_samples=len(train), seed=cfg.seed,
                                            global_batch_size=batch * world)
        batch = sampler.batch_size_for(batch * world)
        loss_scale = sampler.loss_scale(cfg.per_device_train_batch_size * world)
        loader = DataLoader(train, batch_size=batch, sampler=sampler, drop_last=True)
        prepare_loader = False
    else:
        loader = DataLoader(train, batch_size=batch, shuffle=True, drop_last=True,
                            generator=torch.Generator().manual_seed(cfg.seed))
        prepare_loader = True
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if prepare_loader:
        loader = accelerator.prepare(loader)
    comm_state = None
    if fsdp_exchange is not None:
        comm_state = fsdp_exchange
    elif cfg.comm_hook is not None:
        from hf_dtrain.comm import register

        comm_state = register(model, cfg.comm_hook, optimizer=optimizer)
    elif cfg.optimizer in EXCHANGING:
        from hf_dtrain.comm import register

        register(model, "noop")  # the optimizer exchanges; DDP must not average as well
    engine, restored, start = None, None, 1
    if cfg.fault_tolerance is not None:
        from hf_dtrain.fault import SnapshotEngine

        stateful = {"comm_hook": comm_state} if hasattr(comm_state, "state_dict") else None
        from hf_dtrain.fault.snapshot import job_key_for

        engine = SnapshotEngine(model, optimizer, scheduler, config=snapshot_config_for(cfg.fault_tolerance,
                                                                                        cfg.output_dir),
                                stateful=stateful, identity=run_identity(cfg), job_key=job_key_for(cfg.output_dir))
        restored = engine.restore()
        if restored is not None and restored.source == "completed":
            previous = os.path.join(cfg.output_dir, f"results_rank{rank}.json")
            if accelerator.is_main_process:
                print(f"this job already completed ({restored.detail}); nothing to do. To run it again, relaunch "
                      "with --fault-tolerance.fresh-start true", flush=True)
            engine.close()
            if os.path.exists(previous):
                with open(previous) as f:
                    return json.load(f)
            start = cfg.max_steps + 1
        elif restored is not None:
            start = restored.extra["next_step"]
            if accelerator.is_main_process:
                print(f"resumed after step {restored.step} from {restored.source} ({restored.detail})", flush=True)

    def batches():
        """Blocks from the step ``start``: whole epochs skipped by count, then the rest of the epoch skipped."""
        done = start - 1
        epoch = 0
        per_epoch = None if callable(train) else len(loader)
        if per_epoch:
            epoch, skip = divmod(done, per_epoch)
        else:
            skip = done
        while True:
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)
            sampler = getattr(loader, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            it = iter(loader)
            for i, b in enumerate(it):
                if i < skip:
                    continue
                yield b
            skip = 0
            epoch += 1

    history, t0 = [], time.perf_counter()
    os.makedirs(cfg.output_dir, exist_ok=True)
    # one line per step as it happens (kept across a crash and the relaunch: the full curve of a restarted run)
    step_log = open(os.path.join(cfg.output_dir, f"history_rank{rank}.jsonl"), "a")
    bar = tqdm(total=cfg.max_steps, initial=start - 1, disable=not (cfg.progress and accelerator.is_main_process),
               desc=f"pretrain {cfg.preset}")
    monitor = RankMonitor(resume_hint="relaunch the same command to resume" + (
        " from the snapshot processes, which keep the state" if engine is not None else "")) if world > 1 else None
    with monitor.guard() if monitor is not None else contextlib.nullcontext():
        step = start - 1
        for blocks in batches():
            if step >= cfg.max_steps:
                break
            step += 1
            if monitor is not None:
                monitor.step = step
            blocks = blocks.to(accelerator.device)
            loss = model(input_ids=blocks, labels=blocks).loss
            accelerator.backward(loss * loss_scale)
            if engine is not None:
                engine.wait()  # the snapshot in flight reads what this step changes
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            history.append({"step": step, "loss": loss.item(), "seconds": time.perf_counter() - t0})
            step_log.write(json.dumps({**history[-1], "time": time.time()}) + "\n")
            step_log.flush()
            if engine is not None and step % cfg.fault_tolerance.every_n_steps == 0:
                engine.snapshot(step, extra={"next_step": step + 1})
            bar.update(1)
            if accelerator.is_main_process and cfg.logging_steps and step % cfg.logging_steps == 0:
                bar.write(f"step {step}: loss {loss.item():.4f}")
    bar.close()
    step_log.close()
    if engine is not None:
        engine.wait()

    held_loss = None
    unwrapped = accelerator.unwrap_model(model)
    if held_out is not None and len(held_out):
        with torch.no_grad():
            unwrapped.eval()
            losses = [unwrapped(input_ids=b.to(accelerator.device), labels=b.to(accelerator.device)).loss.item()
                      for b in held_out.split(16)]
            unwrapped.train()
        held_loss = sum(losses) / len(losses)
    results = dict(
        preset=cfg.preset, world_size=world, rank=rank, steps=cfg.max_steps, first_step=start, batch_size=batch,
        history=history, held_out_loss=held_loss,
        wire=wire_bytes(comm_state, unwrap_optimizer(optimizer) if cfg.optimizer in EXCHANGING else None),
        delta=None if delta is None else {
            "budget_bytes": {str(k): p.budget for k, p in delta.plans.items()},
            "saved_bytes": [h["saved_bytes"] for h in delta.executor.stats.history if not h["profiling"]],
            "offloaded_bytes": [h["offloaded_bytes"] for h in delta.executor.stats.history if not h["profiling"]],
            "plans": {str(k): p.actions for k, p in delta.plans.items()}},
        fault_tolerance=None if engine is None else {
            "snapshots": engine.stats["snapshots"], "snapshot_bytes": engine.stats["bytes"],
            "restored": None if restored is None else {"step": restored.step, "source": restored.source}},
        engine="fsdp2" if cfg.fsdp is not None else "ddp" if world > 1 else "single process",
        param_bytes_local=local_param_bytes(unwrapped),
        config=dataclasses.asdict(cfg),
    )
    os.makedirs(cfg.output_dir, exist_ok=True)
    with open(os.path.join(cfg.output_dir, f"results_rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    accelerator.wait_for_everyone()
    if cfg.save_model and cfg.fsdp is not None:
        from hf_dtrain.parallel import save_pretrained

        save_pretrained(unwrapped, cfg.output_dir)  # every rank gathers its shards; rank 0 writes
    if accelerator.is_main_process:
        with open(os.path.join(cfg.output_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
        if cfg.save_model:
            if cfg.fsdp is None:
                unwrapped.save_pretrained(cfg.output_dir)
            tokenizer.save_pretrained(cfg.output_dir)
        first, last = history[0]["loss"] if history else float("nan"), history[-1]["loss"] if history else float("nan")
        print(f"pretrain {cfg.preset}: loss {first:.4f} -> {last:.4f}, held-out {held_loss}", flush=True)
    if engine is not None:
        engine.close(shutdown=True)
    if monitor is not None:
        monitor.close()
    if delta is not None:
        delta.remove()
    return results

