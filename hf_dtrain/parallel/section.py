"""The sharding and layout sections of the jobs: FSDP2 (``--fsdp.*``), DeepSpeed ZeRO for the Trainer
(``--deepspeed``) and the TP / PP / data mesh of a plain loop (``--tp --pp --dp-*``, ``--tensor-parallel.*``,
``--pipeline.*``)."""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import field

from hf_dtrain.errors import RunFailure, SettingsError
from hf_dtrain.run.section import Clash, Loader, Section, register_section

from .config import FSDPConfig, ParallelConfig, PipelineConfig, TensorParallelConfig

MESH_FLAGS = "--tp/--pp/--dp-replicate/--dp-shard (parallel)"


def fsdp_from_launcher(fsdp):
    """The job's FSDP2 settings: ``--fsdp`` as given, or, when ``accelerate launch`` was given an Accelerate FSDP
    config on a machine without CUDA, that config's settings. Accelerate enables its FSDP plugin only on GPU-class
    devices (1.15: on CPU it silently falls back to DDP), so there hf_dtrain shards the model itself with them. On
    CUDA the Trainer / Accelerator takes Accelerate's own FSDP2 route."""
    if not FSDPConfig.requested_by_accelerate():
        return fsdp
    if fsdp is not None:
        raise SettingsError(
            "Two FSDP settings: --fsdp and an Accelerate FSDP launch config (distributed_type: FSDP) both shard the "
            "model; keep one (drop --fsdp, or launch with a non-FSDP config)."
        )
    import torch

    if torch.cuda.is_available():
        return None
    config = FSDPConfig.from_accelerate()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"hf-dtrain: the Accelerate FSDP config runs as FSDP2 on CPU through hf_dtrain.parallel: {config}")
    return config


def keep_sharded(model) -> None:
    """Let the Trainer / Accelerator use a model FSDP2 has already sharded: ``prepare`` would otherwise wrap it in
    DDP (on a device where its FSDP plugin is off), which refuses DTensor parameters. A model Accelerate marks as
    prepared is used as it is; FSDP2 does the gradient reduction itself."""
    model._is_accelerate_prepared = True
    model._sharded_by_hf_dtrain = True


def leave_sharded_to_the_trainer(accelerator) -> None:
    """Accelerate 1.14 and later hand a model marked prepared (:func:`keep_sharded`) back as it is; before 1.14 its
    ``prepare_model`` wrapped the FSDP2-sharded model in DDP on a multi-process CPU run, which fails on its DTensor
    parameters (``Attempted to flatten unevenly sharded dimension 0``: ``hf-dtrain finetune --fsdp`` on the floor
    releases). On those releases this Trainer's Accelerator is given the newer behaviour for such a model."""
    from accelerate.utils import compare_versions

    if compare_versions("accelerate", ">=", "1.14.0") or getattr(accelerator, "_leaves_sharded", False):
        return
    prepare_model = accelerator.prepare_model

    def prepare_unless_sharded(model, *args, **kwargs):
        if getattr(model, "_sharded_by_hf_dtrain", False):
            if model not in accelerator._models:
                accelerator._models.append(model)
            return model
        return prepare_model(model, *args, **kwargs)

    accelerator.prepare_model = prepare_unless_sharded
    accelerator._leaves_sharded = True


def autocast_as_prepared(model) -> None:
    """What Accelerate's ``prepare_model`` does for mixed precision, which it skips on a model marked prepared
    (:func:`keep_sharded`): the forward under Accelerate's own autocast (``--bf16`` / ``--mixed_precision``), its
    outputs in float32. Without it a ``--fsdp`` run trained in float32 while its results said bf16 (found by holding
    the estimate against the job's own step: the measured peak 1.5x the traced one, the step's activations float32)."""
    from types import MethodType

    from accelerate.state import AcceleratorState
    from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

    if AcceleratorState().mixed_precision not in ("bf16", "fp16") or getattr(model, "_autocast_by_hf_dtrain", False):
        return
    context = get_mixed_precision_context_manager(True)
    model._original_forward = model.forward
    if hasattr(model.forward, "__func__"):  # as Accelerate does: on the function, bound again
        model.forward = MethodType(context(model.forward.__func__), model)
        model.forward = MethodType(convert_outputs_to_fp32(model.forward.__func__), model)
    else:
        model.forward = convert_outputs_to_fp32(context(model.forward))
    model._autocast_by_hf_dtrain = True


def _two_engines(view) -> str | None:
    if getattr(view.cfg, "fsdp", None) is not None and getattr(view.cfg, "deepspeed", None):
        return "fsdp and deepspeed are two sharding engines: choose --fsdp (torch FSDP2) or --deepspeed"
    return None


def _fsdp_exchanging(view) -> str | None:
    if getattr(view.cfg, "fsdp", None) is not None and view.fact("exchanging"):
        return (
            f"optimizer={view.cfg.optimizer} exchanges whole gradients/parameters between replicas; under FSDP2 each "
            "rank holds a shard, not a replica: use --optimizer adamw"
        )
    return None


@register_section
class FSDPSection(Section):
    """``--fsdp``: FSDP2 on the decoder layers and the root (tuner layers whole); HSDP with ``fsdp.replicate > 1``.
    Also an Accelerate FSDP launch config on a machine without CUDA (:func:`fsdp_from_launcher`)."""

    name = "fsdp"
    order = 30
    shards_parameters = True
    placement_keys = ("fsdp",)
    clashes = (
        Clash("`--fsdp` with `--deepspeed`", "two sharding engines", _two_engines),
        Clash("`--fsdp` with an exchanging optimizer", "each rank holds a shard, not a replica", _fsdp_exchanging),
        Clash("`--fsdp` with an Accelerate FSDP launch config", "both would shard the model: keep one"),
    )

    @classmethod
    def settings(cls):
        help = (
            "Shard the model with FSDP2 (hf_dtrain.parallel.apply_fsdp: decoder layers and root, tuner layers whole; "
            "fsdp.replicate > 1 for HSDP) instead of replicating it with DDP. None: DDP."
        )
        return [("fsdp", FSDPConfig | None, field(default=None, metadata={"help": help}))]

    @classmethod
    def resolve(cls, cfg) -> None:
        cfg.fsdp = fsdp_from_launcher(cfg.fsdp)

    @classmethod
    def alternatives(cls, cfg, world_size: int) -> list:
        """Sharding the replicas' parameters, gradients and optimizer state over the ranks (``--fsdp``)."""
        laid_out = getattr(cfg, "parallel", None) is not None or getattr(cfg, "deepspeed", None) is not None
        if cfg.fsdp is not None or laid_out or world_size < 2:
            return []
        changed = copy.copy(cfg)
        changed.fsdp = FSDPConfig()
        return [(f"--fsdp (FSDP2 over the {world_size} ranks)", changed)]

    def trainer_args(self, given: dict) -> dict:
        strategy = str(getattr(given.get("save_strategy", "no"), "value", given.get("save_strategy", "no")))
        if strategy != "no":
            raise SettingsError(
                f"save_strategy={strategy} with fsdp: the Trainer's checkpoints cannot hold the FSDP2 shards hf_dtrain "
                "lays out (the final adapter is gathered and saved at the end); set --save-strategy no, or train on "
                "DDP (no --fsdp) for resumable Trainer checkpoints."
            )
        return {}

    def prepare(self, model) -> None:
        """Shard ``model``; with a section that carries the replica exchange itself (a comm hook under HSDP), shard
        within the replica groups only and hand it their process group (``run.replica_group``)."""
        if self.run.mesh is not None:  # the layout put FSDP2 on the mesh's data dims
            return
        from .fsdp import apply_fsdp, fsdp_mesh

        fsdp = self.cfg.fsdp
        if fsdp.replicate >= 2 and self.run.any_active("carries_replica_exchange"):
            mesh = fsdp_mesh(fsdp)
            apply_fsdp(model, fsdp, mesh=mesh["dp_shard"])
            self.run.replica_group = mesh["dp_replicate"].get_group()
        else:
            apply_fsdp(model, fsdp)
        keep_sharded(model)

    def attach(self, trainer) -> None:
        leave_sharded_to_the_trainer(trainer.accelerator)  # accelerate < 1.14 would wrap it in DDP
        autocast_as_prepared(trainer.model)  # the Trainer's Accelerator skips the model it is told is prepared

    def after_prepare(self, model, optimizer) -> None:
        autocast_as_prepared(model)  # a plain loop's, likewise

    def engine_name(self) -> str | None:
        return "fsdp2"

    def save(self, model, output_dir: str) -> bool:
        from .state import save_pretrained

        save_pretrained(model, output_dir)  # every rank gathers its shards, rank 0 writes
        return True


def _zero_stage(cfg) -> int | None:
    from .zero import deepspeed_config, zero_stage

    return zero_stage(deepspeed_config(cfg.deepspeed)) if cfg.deepspeed else None


def _deepspeed_in_loop(view) -> str | None:
    if view.fact("zero_stage") is not None and not view.trainer:
        return (
            "deepspeed: hf-dtrain pretrain runs DDP through Accelerate; DeepSpeed configs are taken by hf-dtrain "
            "finetune (the Trainer)"
        )
    return None


def _deepspeed_replaces_ddp(view) -> str | None:
    stage = view.fact("zero_stage")
    if stage is None:
        return None
    out = []
    if getattr(view.cfg, "comm_hook", None) is not None:
        out.append(
            f"comm_hook={view.cfg.comm_hook.method} is a DDP communication hook and DeepSpeed ZeRO-{stage} replaces "
            "DDP (its own reduce/reduce-scatter): drop --comm-hook, or use hf_dtrain.comm.register_deepspeed with ZeRO "
            "stage 0 from Python"
        )
    if view.fact("exchanging"):
        out.append(
            f"optimizer={view.cfg.optimizer} needs DDP's noop hook; DeepSpeed ZeRO-{stage} does its own gradient "
            "exchange"
        )
    return "; ".join(out) or None


def _deepspeed_snapshots(view) -> str | None:
    stage = view.fact("zero_stage")
    if stage is not None and stage >= 1 and getattr(view.cfg, "fault_tolerance", None) is not None:
        return (
            f"fault_tolerance with DeepSpeed ZeRO-{stage} under the Trainer: the Trainer resumes DeepSpeed through "
            "DeepSpeed's own checkpoint loader, which the in-memory snapshots do not feed; use DDP or --fsdp (no "
            "--deepspeed) or ZeRO stage 0 with the Trainer, or SnapshotEngine(engine, engine.optimizer) in your own "
            "DeepSpeed loop, which snapshots ZeRO-1/2/3 partitions"
        )
    return None


@register_section
class DeepSpeedSection(Section):
    """``--deepspeed zero2|zero3|config.json``: DeepSpeed ZeRO through the Trainer (Accelerate's DeepSpeed plugin)."""

    name = "deepspeed"
    order = 31
    clashes = (
        Clash(
            "`--deepspeed` with a comm hook or an exchanging optimizer",
            "DeepSpeed ZeRO replaces DDP and its hooks",
            _deepspeed_replaces_ddp,
        ),
        Clash(
            "`--deepspeed` ZeRO ≥ 1 with `--fault-tolerance`",
            "the Trainer resumes DeepSpeed through DeepSpeed's own checkpoint loader, which the in-memory snapshots do "
            "not feed; `SnapshotEngine(engine, engine.optimizer)` snapshots ZeRO-1/2/3 partitions from your own "
            "DeepSpeed loop ([fault_tolerance.md](fault_tolerance.md#sharded-training-fsdp2-deepspeed-zero-and-restore-"
            "onto-another-world-size))",
            _deepspeed_snapshots,
        ),
        Clash(
            "`--deepspeed` with `pretrain`",
            "pretrain is an Accelerate DDP loop; DeepSpeed goes through finetune's Trainer",
            _deepspeed_in_loop,
        ),
    )

    def account_trace(self, memory, model):
        """DeepSpeed's engine partitions and flattens the parameters itself, outside what a fake tensor follows:
        the step is traced with the model whole and its model states are replaced by DeepSpeed's own estimate
        (:func:`~hf_dtrain.parallel.zero.model_states_estimate`), said in the notes."""
        from hf_dtrain.estimate.trace import StepMemory

        from .zero import deepspeed_config, model_states_estimate

        states, how = model_states_estimate(deepspeed_config(self.cfg.deepspeed), model, self.run.world_size)
        if states == 0:
            return memory, [how]
        kept = {k: v for k, v in memory.split.items() if k not in ("parameters", "gradients", "optimizer state")}
        split = {"model states": states, **kept}  # DeepSpeed's estimate, said in the notes
        return StepMemory(peak=sum(split.values()), split=split, flops=memory.flops), [how]

    @classmethod
    def settings(cls):
        help = (
            "DeepSpeed config for finetune's Trainer: zero2 or zero3 (built-in configs whose 'auto' values the "
            "Trainer fills), or the path of your own JSON; checked against the other switches."
        )
        return [("deepspeed", str | None, field(default=None, metadata={"help": help}))]

    @classmethod
    def active(cls, view) -> bool:
        return bool(view.cfg.deepspeed)

    @classmethod
    def validate(cls, cfg) -> None:
        _zero_stage(cfg)  # a missing or unreadable DeepSpeed config is an error now, not after start-up

    @classmethod
    def facts(cls, cfg) -> dict:
        return {"zero_stage": _zero_stage(cfg)}

    @property
    def shards_parameters(self) -> bool:
        return _zero_stage(self.cfg) == 3

    def check(self) -> None:
        import torch

        from hf_dtrain.run.section import reads_no_data

        if self.run.trainer and not torch.cuda.is_available() and not reads_no_data(self.cfg):
            # Accelerate 1.15 enables DeepSpeed only off the CPU: the Trainer would silently train with DDP instead
            raise SettingsError(
                f"deepspeed={self.cfg.deepspeed}: on a machine without CUDA, Accelerate (1.15) does not enable "
                "DeepSpeed for the Trainer and would silently run DDP. Run --deepspeed on a GPU machine, use --fsdp "
                "here, or call deepspeed.initialize yourself (DS_ACCELERATOR=cpu; see docs/sharded.md)."
            )

    def trainer_args(self, given: dict) -> dict:
        from .zero import deepspeed_config

        return {"deepspeed": deepspeed_config(self.cfg.deepspeed)}

    def attach(self, trainer) -> None:
        if not trainer.is_deepspeed_enabled:  # never train something other than what was asked
            raise RunFailure(
                f"deepspeed={self.cfg.deepspeed} was given but Accelerate did not enable DeepSpeed (distributed type "
                f"{trainer.accelerator.distributed_type}); launch with accelerate launch / torchrun / deepspeed so "
                "that LOCAL_RANK is set."
            )

    def engine_name(self) -> str | None:
        return f"deepspeed-zero{_zero_stage(self.cfg)}"

    def save(self, model, output_dir: str) -> bool:
        from .state import save_pretrained

        save_pretrained(model, output_dir)  # every rank gathers its shards, rank 0 writes
        return True


def _mesh_with(name: str, why: str):
    def refuse(view) -> str | None:
        if getattr(view.cfg, "parallel", None) is not None and getattr(view.cfg, name, None) is not None:
            return f"{name} with {MESH_FLAGS}: {why}"
        return None

    return refuse


def _mesh_replicate(view) -> str | None:
    fsdp = getattr(view.cfg, "fsdp", None)
    if view.cfg.parallel is not None and fsdp is not None and fsdp.replicate != 1:
        return (
            f"fsdp.replicate and {MESH_FLAGS}: the mesh's data dims are --dp-replicate and --dp-shard; drop "
            "--fsdp.replicate (the fsdp.* settings still apply to the data dims)"
        )
    return None


def _mesh_optimizer(view) -> str | None:
    if view.cfg.parallel is not None and view.cfg.optimizer != "adamw":
        return (
            f"optimizer={view.cfg.optimizer} with {MESH_FLAGS}: only adamw runs on DTensor shards and pipeline stages "
            "here"
        )
    return None


@register_section
class LayoutSection(Section):
    """``--tp --pp --dp-replicate --dp-shard`` (or ``--plan auto``): a plain loop's model on one ``DeviceMesh``:
    pipeline stages, tensor + sequence parallelism, FSDP2 / HSDP on the data dims."""

    name = "parallel"
    jobs = ("pretrain",)
    elsewhere = (
        "the Trainer cannot drive a pipeline (it calls model(**batch) once per step on every rank) and does not lay "
        "a model out on a tp / pp mesh. Use hf-dtrain pretrain --tp/--pp, or the Accelerate loop in docs/parallel.md; "
        "for sharded fine-tuning use --fsdp or --deepspeed zero3."
    )
    order = 25
    shards_parameters = True
    placement_keys = ("parallel", "tensor_parallel", "pipeline")
    clashes = (
        Clash(
            "`--tp/--pp/--dp-*` with `--comm-hook`",
            "the mesh has no DDP to hook: FSDP2 reduce-scatters the data dims",
            _mesh_with("comm_hook", "DDP communication hooks have no DDP to hook into on the mesh"),
        ),
        Clash(
            "`--tp/--pp/--dp-*` with `--delta`",
            "DELTA schedules whole layers' activations; it is not built for DTensor shards or pipeline stages yet",
            _mesh_with(
                "delta",
                "DELTA schedules whole-layer activations; it is not built for DTensor shards or pipeline stages yet",
            ),
        ),
        Clash(
            "`--tp/--pp/--dp-*` with `--hetero-speeds`",
            "the sampler shards over processes, not data-parallel replicas",
            _mesh_with("hetero_speeds", "the sampler shards over processes, not data-parallel replicas"),
        ),
        Clash(
            "`--tp/--pp/--dp-*` with `--optimizer` other than adamw",
            "the other optimizers are not built for DTensor shards or pipeline stages",
            _mesh_optimizer,
        ),
        Clash(
            "`--tp/--pp/--dp-*` with `--fsdp.replicate`",
            "the mesh's data dims are `--dp-replicate` / `--dp-shard`; the other `fsdp.*` settings still apply",
            _mesh_replicate,
        ),
        Clash("`--tensor-parallel.*` / `--pipeline.*` with `--tp 1` / `--pp 1`", "settings of a dimension that is off"),
        Clash("`--plan auto` with `--tp/--pp/--dp-*`", "the planner chooses the degrees"),
        Clash(
            "degrees whose product is not the process count, a `--tp` not dividing the heads / KV heads / MLP / "
            "vocabulary, more stages than layers",
            "checked before any process group is created, naming the flag",
        ),
    )

    @classmethod
    def settings(cls):
        return [
            (
                "parallel",
                ParallelConfig | None,
                field(
                    default=None,
                    metadata={
                        "help": "Tensor / pipeline / data parallelism degrees on one DeviceMesh (hf_dtrain.parallel."
                        "mesh: --tp, --pp, --dp-replicate, --dp-shard; their product is the process count). None: "
                        "DDP, or FSDP2 with --fsdp. per_device_train_batch_size is then the batch of one "
                        "data-parallel replica."
                    },
                ),
            ),
            (
                "tensor_parallel",
                TensorParallelConfig,
                field(
                    default_factory=TensorParallelConfig,
                    metadata={"help": "Tensor parallelism's settings (used with --tp > 1)."},
                ),
            ),
            (
                "pipeline",
                PipelineConfig,
                field(default_factory=PipelineConfig, metadata={"help": "Pipeline parallelism's settings (--pp > 1)."}),
            ),
        ]

    @classmethod
    def short_flags(cls):
        """The degrees as torchtitan names them (``--tp`` for ``--parallel.tp``), and ``--plan auto``."""
        out = [
            (
                f"--{name.replace('_', '-')}",
                f"parallel.{name}",
                dict(type=int, metavar="N", help=f"Short for --parallel.{name.replace('_', '-')}."),
            )
            for name in ("tp", "pp", "dp_shard", "dp_replicate")
        ]
        return out + [("--plan", "parallel.plan", dict(choices=["auto"], help="Short for --parallel.plan."))]

    @classmethod
    def validate(cls, cfg) -> None:
        """A setting of a dimension that is off is refused when given at all (even at its default)."""
        tp = cfg.parallel.tp if cfg.parallel is not None else 1
        pp = cfg.parallel.pp if cfg.parallel is not None else 1
        for section, degree, flag in (("tensor_parallel", tp, "--tp"), ("pipeline", pp, "--pp")):
            value = getattr(cfg, section)
            given = sorted(getattr(value, "given_keys", ()))  # from the flags / YAML, even at a default value
            if degree == 1 and (given or value != type(value)()):
                named = ", ".join(f"{section}.{k}" for k in given) or f"{section}.*"
                raise SettingsError(
                    f"{named} given but {flag} is 1 (the dimension is off); set {flag} N (N >= 2) or drop the "
                    f"{section} settings."
                )

    def __init__(self, run) -> None:
        super().__init__(run)
        self.degrees = None
        self.pipe = None

    def untraceable(self) -> str | None:
        if self.cfg.parallel.plan == "auto":
            return "--plan auto: the planner measures the launched ranks; give the degrees (--tp, --dp-shard)"
        return None

    def check(self) -> None:
        """The mesh degrees against the process count and the model, before any process group (``--plan auto``
        needs the launched ranks: :meth:`setup`)."""
        if self.cfg.parallel.plan == "auto":
            return
        from hf_dtrain.models import llama_config

        from .mesh import check_parallel

        try:
            self.degrees = check_parallel(
                self.cfg.parallel, self.run.world_size, llama_config(self.cfg.preset), self.cfg.pipeline
            )
        except ValueError as e:
            raise SettingsError(str(e)) from None

    def traced_ranks(self) -> list[int]:
        """With a pipeline, the last stage's first rank too: it holds the norm, the head and the logits, the first
        stage's ranks the embedding and the most micro-batches in flight (the mesh is pp-major)."""
        from .mesh import last_stage_rank

        if self.degrees is None or self.degrees["pp"] == 1:
            return []
        return [last_stage_rank(self.degrees, self.run.world_size)]

    def setup(self) -> None:
        if self.cfg.parallel.plan == "auto":
            self.degrees = auto_plan(self.cfg, self.run.world_size, self.run.is_main)

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: each sees its own batches (its tp and pp ranks the same ones)."""
        return self.degrees["dp_replicate"] * self.degrees["dp_shard"]

    def prepare(self, model) -> None:
        from .mesh import apply_parallelism, build_mesh

        self.run.mesh = build_mesh(self.degrees)
        self.pipe, _ = apply_parallelism(
            model,
            self.run.mesh,
            batch_size=self.cfg.per_device_train_batch_size,
            seq_len=self.cfg.seq_len,
            tensor_parallel=self.cfg.tensor_parallel,
            pipeline=self.cfg.pipeline,
            fsdp=self.cfg.fsdp,
            device=self.run.device,
        )
        if self.pipe is not None and self.run.is_main:
            stages = self.degrees["pp"] * self.cfg.pipeline.stages_per_rank
            print(
                f"pipeline: {stages} stages, layers {self.pipe.bounds}, {self.cfg.pipeline.schedule} over "
                f"{self.pipe.n_microbatches} micro-batches",
                flush=True,
            )

    def loader(self, train, batch_size: int):
        """A data-parallel replica's blocks: its tp and pp ranks see the same ones."""
        from torch.utils.data import DataLoader, DistributedSampler

        from .mesh import data_parallel

        if callable(train):
            raise SettingsError(
                "streaming with --tp/--pp/--dp-*: the stream is sharded per process, not per data-parallel replica; "
                "load the dataset (streaming false)."
            )
        dp_rank, dp_size = data_parallel(self.run.mesh)
        sampler = DistributedSampler(
            train, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=self.cfg.seed, drop_last=True
        )
        return Loader(DataLoader(train, batch_size=batch_size, sampler=sampler, drop_last=True), batch_size)

    def forward_backward(self, model, blocks, accelerator):
        from .mesh import laid_out_step

        # --mixed_precision bf16 by Accelerate's autocast (the model is laid out here, not prepared by Accelerate)
        return laid_out_step(self.pipe, model, blocks, accelerator.autocast())

    def evaluate(self, model, held_out, batch_size: int, device):
        """The held-out loss over the pipeline (whole pipeline batches: the micro-batch split must divide them) or on
        the tensor-parallel shards (loss parallel)."""
        if self.pipe is not None:
            chunks = [b for b in held_out.split(batch_size) if len(b) == batch_size] or [held_out[:0]]
            losses = [self.pipe.evaluate(b.to(device), b.to(device)).item() for b in chunks if len(b)]
        else:
            from .tensor import local_loss, tensor_parallel_loss

            with tensor_parallel_loss(model):
                losses = [
                    local_loss(model(input_ids=b.to(device), labels=b.to(device)).loss).item()
                    for b in held_out.split(16)
                ]
        return sum(losses) / len(losses) if losses else None

    def save(self, model, output_dir: str) -> bool:
        """One safetensors file per pipeline rank and the index; else the DTensor shards gathered (every rank),
        rank 0 writing."""
        if self.pipe is None:
            from .state import save_pretrained

            save_pretrained(model, output_dir)
            return True
        mesh = self.run.mesh
        writer = all(mesh[d].get_local_rank() == 0 for d in ("tp", "dp_replicate", "dp_shard"))
        self.pipe.save_pretrained(output_dir, model.config, writer)
        return True

    def placement(self) -> dict:
        out = {"degrees": self.degrees}
        if self.pipe is not None:  # a profile may cut another way on another launch
            out["layer_cut"] = [list(b) for b in self.pipe.bounds]
        return out

    def engine_name(self) -> str | None:
        return "mesh " + " x ".join(f"{k} {v}" for k, v in self.degrees.items())

    def results(self) -> dict:
        pipe = self.pipe
        return {
            "pipeline": None
            if pipe is None
            else {"bounds": pipe.bounds, "profile": pipe.costs, "microbatches": pipe.n_microbatches}
        }

    @classmethod
    def empty_results(cls, trainer: bool) -> dict:
        return {} if trainer else {"pipeline": None}


def auto_plan(cfg, world: int, main: bool) -> dict:
    """``--plan auto``: measure this machine on the launched ranks, rank the legal plans, take the best that fits;
    ``cfg``'s parallel / pipeline settings and per-replica batch are set to it. Returns the degrees."""
    from hf_dtrain.models import llama_config

    from .mesh import check_parallel
    from .planner import format_table, measure_profile, rank_plans

    config = llama_config(cfg.preset)
    global_batch = cfg.per_device_train_batch_size * world
    profile = measure_profile(name=f"this machine, {world} ranks")
    activations = ("checkpoint",) if (cfg.fsdp and cfg.fsdp.activation_checkpointing) else ("none",)
    try:
        plans = rank_plans(config, world, profile, global_batch, cfg.seq_len, activations=activations)
    except ValueError as e:
        raise SettingsError(f"--plan auto: {e}") from None
    best = plans[0]
    if not best.fits:
        raise SettingsError(
            f"--plan auto: no plan fits in {profile.device_memory / 2**30:.1f} GiB per rank ({best.overflow}); lower "
            "the batch or the sequence length, or add devices."
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
