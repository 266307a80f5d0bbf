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

from hf_dtrain.parallel.mesh import ParallelConfig
from hf_dtrain.parallel.pipeline import PipelineConfig
from hf_dtrain.parallel.tensor import TensorParallelConfig
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
    parallel: Optional[ParallelConfig] = field(default=None, metadata={
        "help": "Tensor / pipeline / data parallelism degrees on one DeviceMesh (hf_dtrain.parallel.mesh: --tp, "
                "--pp, --dp-replicate, --dp-shard; their product is the process count). None: DDP, or FSDP2 with "
                "--fsdp. per_device_train_batch_size is then the batch of one data-parallel replica."})
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig, metadata={
        "help": "Tensor parallelism's settings (used with --tp > 1)."})
    pipeline: PipelineConfig = field(default_factory=PipelineConfig, metadata={
        "help": "Pipeline parallelism's settings (used with --pp > 1)."})

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
        tp = self.parallel.tp if self.parallel is not None else 1
        pp = self.parallel.pp if self.parallel is not None else 1
        for section, degree, flag in (("tensor_parallel", tp, "--tp"), ("pipeline", pp, "--pp")):
            if getattr(self, section) != type(getattr(self, section))() and degree == 1:
                raise ValueError(f"{section}.* settings are given but {flag} is 1; set {flag} N (N >= 2) or drop "
                                 f"the {section} settings.")

    def check(self, world_size: int, engine: str, lorafa_optimizer: bool = False) -> None:
        """ComposeOptions' clashes, and what cannot run on a tensor / pipeline / mesh-parallel model today."""
        clashes = self.parallel_clashes()
        if clashes:
            raise ValueError("These switches cannot be combined: " + "; ".join(clashes) + ".")
        super().check(world_size, engine, lorafa_optimizer)

    def parallel_clashes(self) -> list[str]:
        """What cannot run on a tensor / pipeline / mesh-parallel model today, each with its reason."""
        clashes = []
        if self.parallel is not None:
            what = "--tp/--pp/--dp-replicate/--dp-shard (parallel)"
            if self.fsdp is not None and self.fsdp.replicate != 1:
                clashes.append(f"fsdp.replicate and {what}: the mesh's data dims are --dp-replicate and --dp-shard; "
                               "drop --fsdp.replicate (the fsdp.* settings still apply to the data dims)")
            for name, value, why in (
                    ("comm_hook", self.comm_hook, "DDP communication hooks have no DDP to hook into on the mesh"),
                    ("delta", self.delta, "DELTA schedules whole-layer activations; it is not built for DTensor "
                                          "shards or pipeline stages yet"),
                    ("fault_tolerance", self.fault_tolerance, "snapshots cover DDP, FSDP2 and ZeRO; tensor and "
                                                              "pipeline shards are not snapshotted yet: use "
                                                              "--fsdp (FSDP2 without the mesh) with "
                                                              "--fault-tolerance"),
                    ("hetero_speeds", self.hetero_speeds, "the sampler shards over processes, not data-parallel "
                                                          "replicas")):
                if value is not None:
                    clashes.append(f"{name} with {what}: {why}")
            if self.optimizer not in ("adamw",):
                clashes.append(f"optimizer={self.optimizer} with {what}: only adamw runs on DTensor shards and "
                               "pipeline stages here")
        return clashes



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


def _auto_plan(cfg: PretrainConfig, world: int, main: bool) -> dict:
    """``--plan auto``: measure this machine on the launched ranks, rank the legal plans, take the best that fits;
    ``cfg``'s parallel / pipeline settings and per-replica batch are set to it. Returns the degrees."""
    from hf_dtrain.models import llama_config
    from hf_dtrain.parallel.mesh import check_parallel
    from hf_dtrain.parallel.planner import format_table, measure_profile, rank_plans
    from hf_dtrain.settings import SettingsError

    config = llama_config(cfg.preset)
    global_batch = cfg.per_device_train_batch_size * world
    profile = measure_profile(name=f"this machine, {world} ranks")
    try:
        plans = rank_plans(config, world, profile, global_batch, cfg.seq_len,
                           activations=("checkpoint",) if (cfg.fsdp and cfg.fsdp.activation_checkpointing) else
                           ("none",))
    except ValueError as e:
        raise SettingsError(f"--plan auto: {e}") from None
    best = plans[0]
    if not best.fits:
        raise SettingsError(f"--plan auto: no plan fits in {profile.device_memory / 2**30:.1f} GiB per rank "
                            f"({best.overflow}); lower the batch or the sequence length, or add devices.")
    if main:
        print(f"--plan auto chose {best.key} (predicted {best.step_time:.4g} s per step); the ranking:\n"
              f"{format_table(plans, 8)}", flush=True)
    cfg.parallel = dataclasses.replace(cfg.parallel, plan=None, tp=best.tp, pp=best.pp,
                                       dp_replicate=best.dp_replicate, dp_shard=best.dp_shard)
    if best.pp > 1:
        cfg.pipeline = dataclasses.replace(cfg.pipeline, schedule=best.schedule, microbatches=best.microbatches,
                                           stages_per_rank=best.stages_per_rank)
    cfg.per_device_train_batch_size = global_batch // (best.dp_replicate * best.dp_shard)
    try:
        return check_parallel(cfg.parallel, world, config, cfg.pipeline)
    except ValueError as e:
        raise SettingsError(f"--plan auto chose {best.key}, which the runtime refuses: {e}") from None


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
    from hf_dtrain.parallel.tensor import local_loss, tensor_parallel_loss

    degrees = None
    if cfg.parallel is not None:  # the degrees against the process count and the model, before any process group
        from hf_dtrain.models import llama_config
        from hf_dtrain.parallel.mesh import check_parallel

        from hf_dtrain.settings import SettingsError

        clashes = cfg.parallel_clashes()
        if clashes:
            raise SettingsError("These switches cannot be combined: " + "; ".join(clashes) + ".")
        if cfg.parallel.plan != "auto":  # --plan auto needs the launched ranks: chosen after the group exists
            try:
                degrees = check_parallel(cfg.parallel, int(os.environ.get("WORLD_SIZE", "1")),
                                         llama_config(cfg.preset), cfg.pipeline)
            except ValueError as e:
                raise SettingsError(str(e)) from None
    init_distributed()  # under torchrun's / accelerate's restarts: the generation's own store keys
    handlers = []
    if cfg.asynchronous_gossip:
        from accelerate.utils import DistributedDataParallelKwargs

        # asynchronous gossip: a buffer broadcast in every forward would make every step a synchronisation point
        handlers.append(DistributedDataParallelKwargs(broadcast_buffers=False))
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=handlers,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    world, rank = accelerator.num_processes, accelerator.process_index
    if cfg.parallel is not None and cfg.parallel.plan == "auto":
        degrees = _auto_plan(cfg, world, accelerator.is_main_process)
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
    pipe, mesh, trained = None, None, model
    if degrees is not None:
        from hf_dtrain.parallel.mesh import apply_parallelism, build_mesh

        mesh = build_mesh(degrees)
        pipe, trained = apply_parallelism(model, mesh, batch_size=cfg.per_device_train_batch_size,
                                          seq_len=cfg.seq_len, tensor_parallel=cfg.tensor_parallel,
                                          pipeline=cfg.pipeline, fsdp=cfg.fsdp, device=accelerator.device)
        if pipe is not None and accelerator.is_main_process:
            print(f"pipeline: {degrees['pp'] * cfg.pipeline.stages_per_rank} stages, layers {pipe.bounds}, "
                  f"{cfg.pipeline.schedule} over {pipe.n_microbatches} micro-batches", flush=True)
    elif cfg.fsdp is not None:
        # before the optimizer: it is built on the sharded parameters; a comm hook compresses the HSDP replica
        # exchange (the clash check allowed it only with fsdp.replicate >= 2)
        fsdp_exchange = shard_with_fsdp(model, cfg.fsdp, cfg.comm_hook)
        keep_sharded(model)
    optimizer = build_optimizer(cfg, trained, cfg.learning_rate, cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(cfg))

    batch = cfg.per_device_train_batch_size
    loss_scale = 1.0
    if degrees is not None:  # a data-parallel replica's tp and pp ranks see the same blocks
        from torch.utils.data import DistributedSampler

        from hf_dtrain.parallel.mesh import data_parallel

        dp_rank, dp_size = data_parallel(mesh)
        if callable(train):
            raise ValueError("streaming with --tp/--pp/--dp-*: the stream is sharded per process, not per "
                             "data-parallel replica; load the dataset (streaming false).")
        sampler = DistributedSampler(train, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=cfg.seed,
                                     drop_last=True)
        loader = DataLoader(train, batch_size=batch, sampler=sampler, drop_last=True)
        prepare_loader = False
    elif callable(train):  # streaming: this rank's blocks in order
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
    if degrees is None:  # the mesh path is laid out already: Accelerate would wrap it in DDP
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
            if pipe is not None:  # forward and backward over the micro-batches; the loss on every rank
                with accelerator.autocast():  # --mixed_precision bf16 (not prepared by Accelerate: laid out here)
                    loss = pipe.step(blocks, blocks)
            elif degrees is not None:
                with tensor_parallel_loss(model):
                    with accelerator.autocast():
                        loss = model(input_ids=blocks, labels=blocks).loss
                    loss.backward()
                loss = local_loss(loss)
            else:
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
    if hasattr(unwrap_optimizer(optimizer), "finish"):  # asynchronous gossip: the last messages, on every rank
        unwrap_optimizer(optimizer).finish()

    held_loss = None
    unwrapped = accelerator.unwrap_model(model) if degrees is None else model
    if held_out is not None and len(held_out):
        with torch.no_grad():
            trained.eval()
            if pipe is not None:  # whole pipeline batches (the micro-batch split must divide them)
                chunks = [b for b in held_out.split(batch) if len(b) == batch] or [held_out[:0]]
                losses = [pipe.evaluate(b.to(accelerator.device), b.to(accelerator.device)).item()
                          for b in chunks if len(b)]
            else:
                with tensor_parallel_loss(unwrapped):
                    losses = [local_loss(unwrapped(input_ids=b.to(accelerator.device),
                                                   labels=b.to(accelerator.device)).loss).item()
                              for b in held_out.split(16)]
            trained.train()
        held_loss = sum(losses) / len(losses) if losses else None
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
        engine=("mesh " + " x ".join(f"{k} {v}" for k, v in degrees.items())) if degrees is not None else
        "fsdp2" if cfg.fsdp is not None else "ddp" if world > 1 else "single process",
        pipeline=None if pipe is None else {"bounds": pipe.bounds, "profile": pipe.costs,
                                            "microbatches": pipe.n_microbatches},
        param_bytes_local=local_param_bytes(trained),
        config=dataclasses.asdict(cfg),
    )
    os.makedirs(cfg.output_dir, exist_ok=True)
    with open(os.path.join(cfg.output_dir, f"results_rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    accelerator.wait_for_everyone()
    if cfg.save_model and pipe is not None:  # one safetensors file per pipeline rank, and the index
        writer = mesh["tp"].get_local_rank() == 0 and mesh["dp_replicate"].get_local_rank() == 0 and \
            mesh["dp_shard"].get_local_rank() == 0
        pipe.save_pretrained(cfg.output_dir, model.config, writer)
    elif cfg.save_model and (cfg.fsdp is not None or degrees is not None):
        from hf_dtrain.parallel import save_pretrained

        save_pretrained(unwrapped, cfg.output_dir)  # every rank gathers its shards; rank 0 writes
    if accelerator.is_main_process:
        with open(os.path.join(cfg.output_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
        if cfg.save_model:
            if cfg.fsdp is None and degrees is None:
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

