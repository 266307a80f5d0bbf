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

import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from datasets import Dataset
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from hf_dtrain.compose import (
    EXCHANGING,
    ComposeOptions,
    check_local_path,
    run_identity,
    snapshot_config_for,
    wire_bytes,
)
from hf_dtrain.datafile import check_enough, check_text_columns, load_file, load_hub
from hf_dtrain.distributed.engines import unwrap_optimizer
from hf_dtrain.errors import NONFINITE_OPT_OUT, DataError, check_writable, non_finite_loss
from hf_dtrain.fault import SnapshotEngine
from hf_dtrain.fault.snapshot import job_key_for
from hf_dtrain.models import PRESETS, cache_root, llama_config, stdlib_text, train_tokenizer
from hf_dtrain.parallel import local_param_bytes
from hf_dtrain.parallel.mesh import ParallelConfig, check_parallel
from hf_dtrain.parallel.pipeline import PipelineConfig
from hf_dtrain.parallel.planner import format_table, measure_profile, rank_plans
from hf_dtrain.parallel.tensor import TensorParallelConfig, local_loss, tensor_parallel_loss
from hf_dtrain.run import JobRun
from hf_dtrain.settings import SettingsError, check_fields

logger = logging.getLogger(__name__)


@dataclass
class PretrainConfig(ComposeOptions):
    """Settings of one pretraining run; every field is a ``hf-dtrain pretrain`` flag and a recipe YAML key."""

    preset: str = field(default="tiny", metadata={"help": "LlamaConfig preset (hf_dtrain.models.PRESETS)."})
    dataset: str | None = field(
        default=None,
        metadata={
            "help": "A local .txt/.jsonl/.json file or a hub dataset with a text column; None = the Python standard "
            "library's source (on every machine)."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset configuration name."})
    text_column: str = field(default="text", metadata={"help": "Column holding the text."})
    streaming: bool = field(default=False, metadata={"help": "Stream the dataset (hub datasets too large to load)."})
    data_bytes: int = field(
        default=2_000_000, metadata={"min": 1000, "help": "Default corpus: bytes of stdlib source to use."}
    )
    seq_len: int = field(default=128, metadata={"min": 2, "help": "Tokens per training block."})
    per_device_train_batch_size: int = field(
        default=16,
        metadata={
            "min": 1,
            "help": "Blocks per process per step (with --hetero-speeds: the global batch is this x processes).",
        },
    )
    max_steps: int = field(default=200, metadata={"min": 1, "help": "Optimizer steps."})
    learning_rate: float = field(default=1e-3, metadata={"gt": 0, "help": "Peak learning rate."})
    warmup_steps: int = field(
        default=20, metadata={"min": 0, "help": "Linear warm-up steps, then cosine decay to a tenth."}
    )
    weight_decay: float = field(default=0.0, metadata={"min": 0, "help": "Weight decay."})
    seed: int = field(default=0, metadata={"min": 0, "help": "Seed of the init and the data order."})
    output_dir: str = field(default="outputs/pretrain", metadata={"help": "Where results.json and the model go."})
    logging_steps: int = field(default=10, metadata={"min": 0, "help": "Print the loss every N steps (rank 0)."})
    eval_blocks: int = field(
        default=64, metadata={"min": 0, "help": "Held-out blocks for the final loss (default corpus)."}
    )
    save_model: bool = field(default=True, metadata={"help": "Save the model and tokenizer at the end (rank 0)."})
    progress: bool = field(default=True, metadata={"help": "Show a progress bar."})
    parallel: ParallelConfig | None = field(
        default=None,
        metadata={
            "help": "Tensor / pipeline / data parallelism degrees on one DeviceMesh (hf_dtrain.parallel.mesh: --tp, "
            "--pp, --dp-replicate, --dp-shard; their product is the process count). None: DDP, or FSDP2 with "
            "--fsdp. per_device_train_batch_size is then the batch of one data-parallel replica."
        },
    )
    tensor_parallel: TensorParallelConfig = field(
        default_factory=TensorParallelConfig, metadata={"help": "Tensor parallelism's settings (used with --tp > 1)."}
    )
    pipeline: PipelineConfig = field(
        default_factory=PipelineConfig, metadata={"help": "Pipeline parallelism's settings (used with --pp > 1)."}
    )

    def __post_init__(self):

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
            value = getattr(self, section)
            given = sorted(getattr(value, "given_keys", ()))  # from the flags / YAML, even at a default value
            if degree == 1 and (given or value != type(value)()):
                named = ", ".join(f"{section}.{k}" for k in given) or f"{section}.*"
                raise SettingsError(
                    f"{named} given but {flag} is 1 (the dimension is off); set {flag} N (N >= 2) or drop "
                    f"the {section} settings."
                )

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
                clashes.append(
                    f"fsdp.replicate and {what}: the mesh's data dims are --dp-replicate and --dp-shard; "
                    "drop --fsdp.replicate (the fsdp.* settings still apply to the data dims)"
                )
            for name, value, why in (
                ("comm_hook", self.comm_hook, "DDP communication hooks have no DDP to hook into on the mesh"),
                (
                    "delta",
                    self.delta,
                    "DELTA schedules whole-layer activations; it is not built for DTensor "
                    "shards or pipeline stages yet",
                ),
                ("hetero_speeds", self.hetero_speeds, "the sampler shards over processes, not data-parallel replicas"),
            ):
                if value is not None:
                    clashes.append(f"{name} with {what}: {why}")
            if self.optimizer not in ("adamw",):
                clashes.append(
                    f"optimizer={self.optimizer} with {what}: only adamw runs on DTensor shards and "
                    "pipeline stages here"
                )
        return clashes


def default_tokenizer(preset: str, data_bytes: int = 1_000_000):
    """A byte-level BPE tokenizer for ``preset``'s vocabulary trained on the stdlib's source, cached on disk."""

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


def load_blocks(cfg: PretrainConfig, tokenizer, rank: int, world: int, replicas: int | None = None):
    """(train, held-out): tensors of token blocks, or for ``streaming`` an iterable of this rank's blocks and None.
    Fewer training blocks than one global batch (``replicas`` data-parallel replicas, default ``world``, each
    ``per_device_train_batch_size``) is a ``DataError``."""
    replicas = replicas or world
    if cfg.dataset is None:
        from hf_dtrain.models import stdlib_text

        blocks = _pack(tokenizer, stdlib_text(cfg.data_bytes), cfg.seq_len)
        g = torch.Generator().manual_seed(1234)
        blocks = blocks[torch.randperm(len(blocks), generator=g)]
        return _split_blocks(
            cfg,
            blocks,
            replicas,
            f"(the default corpus, {cfg.data_bytes} bytes)",
            "raise --data-bytes",
            flag="--data-bytes",
        )

    path = cfg.dataset
    local = os.path.exists(path)
    if local:
        ds = load_file(path, split="train", streaming=cfg.streaming)
    else:
        ds = load_hub(path, cfg.dataset_config, split="train", streaming=cfg.streaming)
    if cfg.streaming:
        from datasets.distributed import split_dataset_by_node

        ds = split_dataset_by_node(ds, rank=rank, world_size=world)

        def stream():
            buf: list[str] = []
            for i, row in enumerate(ds):
                text = row.get(cfg.text_column)
                if not isinstance(text, str):
                    check_text_columns(Dataset.from_list([row]), [cfg.text_column], f"{path} (streamed row {i})")
                buf.append(text)
                if len(buf) == 256:
                    yield from _pack(tokenizer, buf, cfg.seq_len)
                    buf = []
            if buf:
                yield from _pack(tokenizer, buf, cfg.seq_len)

        return stream, None
    if cfg.text_column not in ds.column_names:
        raise DataError(
            f"--dataset {path} has no column {cfg.text_column!r} (columns: {ds.column_names}); set --text-column."
        )
    check_text_columns(ds, [cfg.text_column], path, path if local else None)
    return _split_blocks(cfg, _pack(tokenizer, ds[cfg.text_column], cfg.seq_len), replicas, path, "give more text")


def _split_blocks(cfg: PretrainConfig, blocks, replicas: int, source: str, more: str, flag: str = "--dataset"):
    """(train, held-out) blocks: up to ``eval_blocks`` (a tenth at most) held out; fewer training blocks than one
    global batch (``replicas`` x ``per_device_train_batch_size``) is a ``DataError``."""
    held = min(cfg.eval_blocks, len(blocks) // 10)
    check_enough(
        len(blocks) - held,
        cfg.per_device_train_batch_size * replicas,
        f"training blocks of {cfg.seq_len} tokens ({held} more held out)",
        source,
        f"lower --per-device-train-batch-size or --seq-len, or {more}",
        flag=flag,
    )
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

    config = llama_config(cfg.preset)
    global_batch = cfg.per_device_train_batch_size * world
    profile = measure_profile(name=f"this machine, {world} ranks")
    try:
        plans = rank_plans(
            config,
            world,
            profile,
            global_batch,
            cfg.seq_len,
            activations=("checkpoint",) if (cfg.fsdp and cfg.fsdp.activation_checkpointing) else ("none",),
        )
    except ValueError as e:
        raise SettingsError(f"--plan auto: {e}") from None
    best = plans[0]
    if not best.fits:
        raise SettingsError(
            f"--plan auto: no plan fits in {profile.device_memory / 2**30:.1f} GiB per rank "
            f"({best.overflow}); lower the batch or the sequence length, or add devices."
        )
    if main:
        print(
            f"--plan auto chose {best.key} (predicted {best.step_time:.4g} s per step); the ranking:\n"
            f"{format_table(plans, 8)}",
            flush=True,
        )
    cfg.parallel = dataclasses.replace(
        cfg.parallel, plan=None, tp=best.tp, pp=best.pp, dp_replicate=best.dp_replicate, dp_shard=best.dp_shard
    )
    if best.pp > 1:
        cfg.pipeline = dataclasses.replace(
            cfg.pipeline, schedule=best.schedule, microbatches=best.microbatches, stages_per_rank=best.stages_per_rank
        )
    cfg.per_device_train_batch_size = global_batch // (best.dp_replicate * best.dp_shard)
    try:
        return check_parallel(cfg.parallel, world, config, cfg.pipeline)
    except ValueError as e:
        raise SettingsError(f"--plan auto chose {best.key}, which the runtime refuses: {e}") from None


def _checked_layout(cfg: PretrainConfig) -> dict | None:
    """The mesh degrees against the process count and the model, before any process group (None: no mesh, or
    ``--plan auto``, which needs the launched ranks)."""
    if cfg.parallel is None:
        return None

    clashes = cfg.parallel_clashes()
    if clashes:
        raise SettingsError("These switches cannot be combined: " + "; ".join(clashes) + ".")
    if cfg.parallel.plan == "auto":
        return None
    try:
        return check_parallel(
            cfg.parallel, int(os.environ.get("WORLD_SIZE", "1")), llama_config(cfg.preset), cfg.pipeline
        )
    except ValueError as e:
        raise SettingsError(str(e)) from None


def _loader(cfg: PretrainConfig, train, mesh, world: int, rank: int):
    """``(loader, per-rank batch, loss scale, whether Accelerate should prepare it)`` for the layout: a data-parallel
    replica's blocks on the mesh, this rank's stream, the heterogeneity-aware sampler, or a shuffled loader."""

    batch = cfg.per_device_train_batch_size
    if mesh is not None:  # a data-parallel replica's tp and pp ranks see the same blocks
        from torch.utils.data import DistributedSampler

        from hf_dtrain.parallel.mesh import data_parallel

        dp_rank, dp_size = data_parallel(mesh)
        if callable(train):
            raise ValueError(
                "streaming with --tp/--pp/--dp-*: the stream is sharded per process, not per "
                "data-parallel replica; load the dataset (streaming false)."
            )
        sampler = DistributedSampler(
            train, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=cfg.seed, drop_last=True
        )
        return DataLoader(train, batch_size=batch, sampler=sampler, drop_last=True), batch, 1.0, False
    if callable(train):  # streaming: this rank's blocks in order
        from torch.utils.data import IterableDataset

        class _Stream(IterableDataset):
            def __iter__(self):
                return iter(train())

        return DataLoader(_Stream(), batch_size=batch), batch, 1.0, False
    if cfg.hetero_speeds is not None:
        from hf_dtrain.data import HeterogeneityAwareSampler

        sampler = HeterogeneityAwareSampler(
            None, cfg.hetero_speeds, rank=rank, num_samples=len(train), seed=cfg.seed, global_batch_size=batch * world
        )
        scale = sampler.loss_scale(batch * world)
        batch = sampler.batch_size_for(batch * world)
        return DataLoader(train, batch_size=batch, sampler=sampler, drop_last=True), batch, scale, False
    loader = DataLoader(
        train, batch_size=batch, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(cfg.seed)
    )
    return loader, batch, 1.0, True


def _batches(loader, start: int, streaming: bool):
    """Blocks from the step ``start``: whole epochs skipped by count, then the rest of the epoch skipped; epoch e's
    order depends on (seed, e) only, so a resumed run skips into the same order."""
    if not streaming and len(loader) == 0:
        raise DataError(
            "the training data gives no full batch on this rank: lower --per-device-train-batch-size or give more data."
        )
    done = start - 1
    epoch, skip = (0, done) if streaming else divmod(done, len(loader))
    while True:
        for owner in (loader, getattr(loader, "sampler", None)):
            if hasattr(owner, "set_epoch"):
                owner.set_epoch(epoch)
        batches = 0
        for i, b in enumerate(loader):
            batches += 1
            if i >= skip:
                yield b
        if batches == 0:  # a stream that gives no full batch would spin here for ever
            raise DataError(
                "the training data gives no full batch on this rank: lower --per-device-train-batch-size or "
                "--seq-len, or give more data."
            )
        skip = 0
        epoch += 1


# the settings that say how the model is laid over the ranks, not what is trained: snapshots taken in another layout
# are the same job's, and reshard from the persisted DCP copy (as on another world size)
PLACEMENT = ("parallel", "tensor_parallel", "pipeline", "fsdp")


def _identity_and_placement(cfg: PretrainConfig, degrees: dict | None, pipe) -> tuple[dict, dict]:
    """The job's identity for its snapshots, and its placement: the layout settings, the degrees in force (the
    planner's too) and the pipeline's layer cut (a profile may cut another way on another launch)."""
    identity = run_identity(cfg)
    placement = {k: identity.pop(k, None) for k in PLACEMENT}
    placement["degrees"] = degrees
    if pipe is not None:
        placement["layer_cut"] = [list(b) for b in pipe.bounds]
    return identity, placement


def _restore(
    cfg: PretrainConfig,
    model,
    optimizer,
    scheduler,
    comm_state,
    accelerator,
    rank: int,
    degrees: dict | None = None,
    pipe=None,
):
    """The snapshot engine and what it restored: ``(engine, restored, first step, previous results or None)``."""

    stateful = {"comm_hook": comm_state} if hasattr(comm_state, "state_dict") else None
    identity, placement = _identity_and_placement(cfg, degrees, pipe)
    engine = SnapshotEngine(
        model,
        optimizer,
        scheduler,
        config=snapshot_config_for(cfg.fault_tolerance, cfg.output_dir),
        stateful=stateful,
        identity=identity,
        placement=placement,
        job_key=job_key_for(cfg.output_dir),
    )
    restored = engine.restore()
    if restored is not None and restored.source == "completed":
        previous = os.path.join(cfg.output_dir, f"results_rank{rank}.json")
        if accelerator.is_main_process:
            print(
                f"this job already completed ({restored.detail}); nothing to do. To run it again, relaunch "
                "with --fault-tolerance.fresh-start true",
                flush=True,
            )
        engine.close()
        done = None
        if os.path.exists(previous):
            with open(previous) as f:
                done = json.load(f)
        return engine, restored, cfg.max_steps + 1, done
    if restored is not None and accelerator.is_main_process:
        print(f"resumed after step {restored.step} from {restored.source} ({restored.detail})", flush=True)
    return engine, restored, (restored.extra["next_step"] if restored is not None else 1), None


def _held_out_loss(held_out, trained, unwrapped, pipe, batch: int, device) -> float | None:

    if held_out is None or not len(held_out):
        return None
    with torch.no_grad():
        trained.eval()
        if pipe is not None:  # whole pipeline batches (the micro-batch split must divide them)
            chunks = [b for b in held_out.split(batch) if len(b) == batch] or [held_out[:0]]
            losses = [pipe.evaluate(b.to(device), b.to(device)).item() for b in chunks if len(b)]
        else:
            with tensor_parallel_loss(unwrapped):
                losses = [
                    local_loss(unwrapped(input_ids=b.to(device), labels=b.to(device)).loss).item()
                    for b in held_out.split(16)
                ]
        trained.train()
    return sum(losses) / len(losses) if losses else None


def _save(cfg: PretrainConfig, run, unwrapped, tokenizer, pipe, mesh, degrees, results) -> None:
    """results.json, and the model: one safetensors file per pipeline rank and the index, or gathered shards, or
    rank 0's replica."""
    if cfg.save_model and pipe is not None:
        writer = all(mesh[d].get_local_rank() == 0 for d in ("tp", "dp_replicate", "dp_shard"))
        pipe.save_pretrained(cfg.output_dir, unwrapped.config, writer)
        run.finish(unwrapped, tokenizer, cfg.output_dir, results, save_model=False)
        if run.is_main:
            tokenizer.save_pretrained(cfg.output_dir)
        return
    # a mesh holds DTensor shards even without FSDP: every rank gathers, rank 0 writes
    run.finish(
        unwrapped,
        tokenizer,
        cfg.output_dir,
        results,
        save_model=cfg.save_model,
        gather=True if degrees is not None else None,
    )


def run_pretrain(cfg: PretrainConfig) -> dict:
    """Run one pretraining job; return the measured figures (also ``<output_dir>/results.json``)."""

    from hf_dtrain.models import PRESETS, build_llama

    degrees = _checked_layout(cfg)
    check_writable(cfg.output_dir, "--output-dir")
    run = JobRun(cfg, engine="accelerate", check=False)
    handlers = []
    if cfg.asynchronous_gossip:  # a buffer broadcast in every forward would make every step a synchronisation point
        from accelerate.utils import DistributedDataParallelKwargs

        handlers.append(DistributedDataParallelKwargs(broadcast_buffers=False))
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        kwargs_handlers=handlers,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    world, rank = accelerator.num_processes, accelerator.process_index
    if cfg.parallel is not None and cfg.parallel.plan == "auto":
        degrees = _auto_plan(cfg, world, accelerator.is_main_process)
    cfg.check(world, engine="accelerate")
    with run.main_first():
        tokenizer = default_tokenizer(cfg.preset)
        replicas = degrees["dp_replicate"] * degrees["dp_shard"] if degrees else world
        train, held_out = load_blocks(cfg, tokenizer, rank, world, replicas)
    set_seed(cfg.seed)
    model = build_llama(cfg.preset, seed=cfg.seed, vocab_size=max(len(tokenizer), PRESETS[cfg.preset]["vocab_size"]))
    model.train()
    delta = None
    if cfg.delta is not None:
        from hf_dtrain.memory import apply_delta

        delta = apply_delta(model, cfg.delta)  # on the unwrapped model
    exchange, pipe, mesh, trained = None, None, None, model
    if degrees is not None:
        from hf_dtrain.parallel.mesh import apply_parallelism, build_mesh

        mesh = build_mesh(degrees)
        pipe, trained = apply_parallelism(
            model,
            mesh,
            batch_size=cfg.per_device_train_batch_size,
            seq_len=cfg.seq_len,
            tensor_parallel=cfg.tensor_parallel,
            pipeline=cfg.pipeline,
            fsdp=cfg.fsdp,
            device=accelerator.device,
        )
        if pipe is not None and run.is_main:
            print(
                f"pipeline: {degrees['pp'] * cfg.pipeline.stages_per_rank} stages, layers {pipe.bounds}, "
                f"{cfg.pipeline.schedule} over {pipe.n_microbatches} micro-batches",
                flush=True,
            )
    else:
        exchange = run.shard(model)
    optimizer = run.optimizer(trained, cfg.learning_rate, cfg.weight_decay, trainer_default=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(cfg))
    loader, batch, loss_scale, prepare_loader = _loader(cfg, train, mesh, world, rank)
    if degrees is None:  # the mesh path is laid out already: Accelerate would wrap it in DDP
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if prepare_loader:
        loader = accelerator.prepare(loader)
    comm_state = exchange
    if exchange is None and (cfg.comm_hook is not None or cfg.optimizer in EXCHANGING):
        from hf_dtrain.comm import register

        # an exchanging optimizer averages itself: DDP runs the noop hook
        hooked = register(model, cfg.comm_hook or "noop", optimizer=optimizer if cfg.comm_hook else None)
        comm_state = hooked if cfg.comm_hook is not None else None
    engine, restored, start = None, None, 1
    if cfg.fault_tolerance is not None:
        # on the mesh each rank snapshots what it trains: its tensor-parallel shards, its pipeline stages
        engine, restored, start, done = _restore(
            cfg,
            model if degrees is None else trained,
            optimizer,
            scheduler,
            comm_state,
            accelerator,
            rank,
            degrees,
            pipe,
        )
        if done is not None:
            return done
    history, t0 = [], time.perf_counter()
    os.makedirs(cfg.output_dir, exist_ok=True)
    # one line per step as it happens (kept across a crash and the relaunch: the full curve of a restarted run)
    step_log = open(os.path.join(cfg.output_dir, f"history_rank{rank}.jsonl"), "a")
    bar = tqdm(
        total=cfg.max_steps,
        initial=start - 1,
        disable=not (cfg.progress and run.is_main),
        desc=f"pretrain {cfg.preset}",
    )
    step = start - 1
    with run.guard(snapshots=engine is not None):
        for blocks in _batches(loader, start, callable(train)) if start <= cfg.max_steps else ():
            step += 1
            if run.monitor is not None:
                run.monitor.step = step  # published at once: a dead rank is named with the step it was on
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
            value = loss.item()
            if cfg.stop_on_nonfinite_loss and not math.isfinite(value):
                raise non_finite_loss("training", value, step, NONFINITE_OPT_OUT)
            history.append({"step": step, "loss": value, "seconds": time.perf_counter() - t0})
            step_log.write(json.dumps({**history[-1], "time": time.time()}) + "\n")
            step_log.flush()
            if engine is not None and step % cfg.fault_tolerance.every_n_steps == 0:
                engine.snapshot(step, extra={"next_step": step + 1})
            bar.update(1)
            if run.is_main and cfg.logging_steps and step % cfg.logging_steps == 0:
                bar.write(f"step {step}: loss {loss.item():.4f}")
            if step >= cfg.max_steps:
                break
    bar.close()
    step_log.close()
    if engine is not None:
        engine.wait()
    if hasattr(unwrap_optimizer(optimizer), "finish"):  # asynchronous gossip: the last messages, on every rank
        unwrap_optimizer(optimizer).finish()
    unwrapped = accelerator.unwrap_model(model) if degrees is None else model
    held_loss = _held_out_loss(held_out, trained, unwrapped, pipe, batch, accelerator.device)
    if cfg.stop_on_nonfinite_loss and held_loss is not None and not math.isfinite(held_loss):
        raise non_finite_loss("held-out", held_loss, step, NONFINITE_OPT_OUT)
    results = dict(
        preset=cfg.preset,
        world_size=world,
        rank=rank,
        steps=cfg.max_steps,
        first_step=start,
        batch_size=batch,
        history=history,
        held_out_loss=held_loss,
        wire=wire_bytes(comm_state, unwrap_optimizer(optimizer) if cfg.optimizer in EXCHANGING else None),
        delta=None
        if delta is None
        else {
            "budget_bytes": {str(k): p.budget for k, p in delta.plans.items()},
            "saved_bytes": [h["saved_bytes"] for h in delta.executor.stats.history if not h["profiling"]],
            "offloaded_bytes": [h["offloaded_bytes"] for h in delta.executor.stats.history if not h["profiling"]],
            "plans": {str(k): p.actions for k, p in delta.plans.items()},
        },
        fault_tolerance=None
        if engine is None
        else {
            "snapshots": engine.stats["snapshots"],
            "snapshot_bytes": engine.stats["bytes"],
            "restored": None if restored is None else {"step": restored.step, "source": restored.source},
        },
        engine=("mesh " + " x ".join(f"{k} {v}" for k, v in degrees.items()))
        if degrees is not None
        else "fsdp2"
        if cfg.fsdp is not None
        else "ddp"
        if world > 1
        else "single process",
        pipeline=None
        if pipe is None
        else {"bounds": pipe.bounds, "profile": pipe.costs, "microbatches": pipe.n_microbatches},
        param_bytes_local=local_param_bytes(trained),
        config=dataclasses.asdict(cfg),
    )
    with open(os.path.join(cfg.output_dir, f"results_rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    accelerator.wait_for_everyone()
    _save(cfg, run, unwrapped, tokenizer, pipe, mesh, degrees, results)
    if run.is_main:
        first, last = (history[0]["loss"], history[-1]["loss"]) if history else (float("nan"), float("nan"))
        print(f"pretrain {cfg.preset}: loss {first:.4f} -> {last:.4f}, held-out {held_loss}", flush=True)
    if engine is not None:
        engine.close(shutdown=True)
    run.close_guard()
    if delta is not None:
        delta.remove()
    return results
