"""The parallelism settings, as typed configs (validated on construction; light to import): FSDP2's
(:class:`FSDPConfig`, ``--fsdp.*``), tensor parallelism's (:class:`TensorParallelConfig`, ``--tensor-parallel.*``),
pipeline parallelism's (:class:`PipelineConfig`, ``--pipeline.*``) and the mesh degrees (:class:`ParallelConfig`,
``--tp --pp --dp-replicate --dp-shard``). The engines that take them are ``fsdp.py``, ``tensor.py``, ``pipeline.py``
and ``mesh.py``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

from hf_dtrain.errors import SettingsError
from hf_dtrain.settings import check_choice, check_fields, setting

PARAM_DTYPES = ("fp32", "bf16", "fp16")  # FSDP2's gathered-parameter dtypes (fsdp.py maps them to torch dtypes)
SINGLE_STAGE = ("GPipe", "1F1B")  # pipeline schedules with one stage per rank
MULTI_STAGE = ("Interleaved1F1B", "InterleavedZeroBubble")  # and with several
ACTIVATION_POLICIES = ("none", "checkpoint")  # what the planner considers for activations (planner.py)


@dataclass
class FSDPConfig:
    """FSDP2 settings (validated on construction). Every field is a ``--fsdp.<field>`` flag of ``hf-dtrain
    finetune`` / ``pretrain`` and a key of the ``fsdp:`` YAML section; ``apply_fsdp(model, config)`` takes it
    unchanged."""

    section_key: ClassVar[str] = "fsdp"

    replicate: int = setting(
        1,
        "HSDP replicas (dp_replicate): the processes form `replicate` groups that each shard the model, "
        "and gradients are all-reduced across groups. 1: plain FSDP, one shard per process.",
    )
    reshard_after_forward: bool = setting(
        True,
        "Free each layer's gathered parameters after its forward and gather them again for backward "
        "(ZeRO-3-like); false keeps them until backward (ZeRO-2-like: more memory, one all-gather less).",
    )
    param_dtype: str = setting(
        "fp32",
        "Dtype of the gathered parameters in forward and backward (MixedPrecisionPolicy.param_dtype): "
        "fp32, bf16 or fp16. Gradients are reduced in fp32 and the sharded master weights stay fp32.",
    )
    cpu_offload: bool = setting(
        False,
        "Keep the sharded parameters, gradients and optimizer state in host memory (CPUOffloadPolicy); "
        "the optimizer step runs on the CPU.",
    )
    layer_classes: list[str] | None = setting(
        None,
        "Class names of the modules that become FSDP units, e.g. [LlamaDecoderLayer]. Default: the "
        "model's _no_split_modules (its decoder layer). A class inside a peft tuner layer is refused.",
    )
    activation_checkpointing: bool = setting(
        False,
        "Recompute each decoder layer in backward (transformers' gradient checkpointing, non-reentrant); "
        "the recomputation runs after FSDP2 has gathered the layer again.",
    )

    def __post_init__(self):
        check_fields(self)
        if isinstance(self.replicate, bool) or not isinstance(self.replicate, int) or self.replicate < 1:
            raise SettingsError(
                f"FSDPConfig.replicate must be a whole number >= 1, got {self.replicate!r}; set "
                "fsdp.replicate (1 for plain FSDP)."
            )
        check_choice(self, "param_dtype", PARAM_DTYPES, "fsdp.param_dtype")
        if self.layer_classes is not None:
            if isinstance(self.layer_classes, str):
                self.layer_classes = [self.layer_classes]
            if not self.layer_classes or not all(isinstance(c, str) and c for c in self.layer_classes):
                raise SettingsError(
                    f"FSDPConfig.layer_classes must be a non-empty list of class names, got "
                    f"{self.layer_classes!r}; e.g. [LlamaDecoderLayer], or leave it unset."
                )
        if self.cpu_offload and self.param_dtype == "fp16":
            raise SettingsError(
                "FSDPConfig: cpu_offload with param_dtype=fp16 is refused: the CPU optimizer step "
                "has no loss scaling for fp16; use param_dtype=bf16."
            )

    @classmethod
    def from_accelerate(cls, plugin=None, mixed_precision: str | None = None) -> FSDPConfig:
        """The settings of an Accelerate FSDP config (``accelerate launch --config_file`` with ``distributed_type:
        FSDP`` sets them in the environment; ``plugin`` defaults to ``FullyShardedDataParallelPlugin()`` read from
        there). Only what FSDP2 and this engine can honour is taken; anything else is a ``ValueError`` naming the
        key to change."""
        from torch.distributed.fsdp import CPUOffloadPolicy

        if plugin is None:
            from accelerate.utils import FullyShardedDataParallelPlugin

            plugin = FullyShardedDataParallelPlugin()
        if plugin.fsdp_version != 2:
            raise SettingsError(
                f"The Accelerate FSDP config has fsdp_version: {plugin.fsdp_version}; hf_dtrain shards "
                "with FSDP2 only: set fsdp_config.fsdp_version: 2."
            )
        reshard = plugin.reshard_after_forward
        if not isinstance(reshard, bool):
            raise SettingsError(f"fsdp_config.fsdp_reshard_after_forward={reshard!r}: hf_dtrain takes true or false.")
        policy = plugin.auto_wrap_policy
        policy_name = policy if isinstance(policy, str) or policy is None else getattr(policy, "__name__", str(policy))
        layer_classes = plugin.transformer_cls_names_to_wrap or None
        if policy_name and "transformer" not in str(policy_name).lower():
            raise SettingsError(
                f"fsdp_config.fsdp_auto_wrap_policy={policy_name}: hf_dtrain wraps whole decoder "
                "layers; set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP (and "
                "fsdp_transformer_layer_cls_to_wrap, or leave it out for the model's own)."
            )
        precision = (mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")).lower()
        dtypes = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}
        if precision not in dtypes:
            raise SettingsError(f"mixed_precision={precision}: FSDP2 here takes no, bf16 or fp16.")
        replicate = int(os.environ.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1") or 1)
        return cls(
            replicate=replicate,
            reshard_after_forward=reshard,
            param_dtype=dtypes[precision],
            cpu_offload=isinstance(plugin.cpu_offload, CPUOffloadPolicy),
            layer_classes=layer_classes,
            activation_checkpointing=bool(plugin.activation_checkpointing),
        )

    @staticmethod
    def requested_by_accelerate() -> bool:
        """Whether ``accelerate launch`` was given an FSDP config (it exports ``ACCELERATE_USE_FSDP=true``)."""
        return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("true", "1", "yes")


@dataclass
class TensorParallelConfig:
    """Tensor-parallel settings (validated on construction). Every field is a ``--tensor-parallel.<field>`` flag of
    ``hf-dtrain pretrain`` and a key of the ``tensor_parallel:`` YAML section; ``apply_tensor_parallel(model, mesh,
    config)`` takes it unchanged. The degree itself is ``ParallelConfig.tp`` (``--tp N``)."""

    section_key: ClassVar[str] = "tensor_parallel"

    sequence_parallel: bool = setting(
        True,
        "Shard the norms and the residual stream over the sequence between the blocks (reduce-scatter + "
        "all-gather instead of all-reduce; activations 1/tp per rank). Needs seq_len divisible by tp.",
    )
    loss_parallel: bool = setting(
        True,
        "Keep the logits sharded over the vocabulary and compute the cross-entropy on the shards (no rank "
        "holds the whole logits); forward and backward then run inside tensor_parallel_loss(model).",
    )

    def __post_init__(self):
        check_fields(self)


@dataclass
class PipelineConfig:
    """Pipeline settings (validated on construction). Every field is a ``--pipeline.<field>`` flag of ``hf-dtrain
    pretrain`` and a key of the ``pipeline:`` YAML section; ``apply_pipeline(model, mesh, config)`` takes it
    unchanged. The degree itself is ``ParallelConfig.pp`` (``--pp N``)."""

    section_key: ClassVar[str] = "pipeline"

    schedule: str = setting(
        "1F1B",
        "torch.distributed.pipelining schedule: GPipe, 1F1B (one stage per rank), Interleaved1F1B or "
        "InterleavedZeroBubble (stages_per_rank >= 2).",
    )
    microbatches: int | None = setting(
        None,
        "Micro-batches per step (the batch is split into this many along dim 0; it must divide the "
        "batch). Default: 2 x the number of stages, at most the batch size.",
    )
    stages_per_rank: int = setting(
        1,
        "Virtual stages per rank (interleaved schedules take >= 2: fewer bubbles, more point-to-point messages).",
        min=1,
    )
    balance: str = setting(
        "profile",
        "How layers are cut into stages: profile (Merak: measured forward+backward time of the "
        "embedding, a decoder layer and the head on this machine) or uniform (equal layer counts).",
    )

    def __post_init__(self):
        check_fields(self)
        names = {n.lower(): n for n in SINGLE_STAGE + MULTI_STAGE}
        if not isinstance(self.schedule, str) or self.schedule.lower() not in names:
            raise SettingsError(
                f"PipelineConfig.schedule={self.schedule!r} is not one of {list(names.values())}; set "
                "pipeline.schedule (--pipeline.schedule)."
            )
        self.schedule = names[self.schedule.lower()]
        check_choice(self, "balance", ("profile", "uniform"), "pipeline.balance")
        if self.schedule in SINGLE_STAGE and self.stages_per_rank != 1:
            raise SettingsError(
                f"pipeline.schedule={self.schedule} runs one stage per rank, but pipeline.stages_per_rank="
                f"{self.stages_per_rank}; use Interleaved1F1B for several, or stages_per_rank 1."
            )
        if self.schedule in MULTI_STAGE and self.stages_per_rank < 2:
            raise SettingsError(
                f"pipeline.schedule={self.schedule} interleaves several stages per rank: set "
                "pipeline.stages_per_rank >= 2 (or use 1F1B)."
            )
        if self.microbatches is not None and (isinstance(self.microbatches, bool) or self.microbatches < 1):
            raise SettingsError(f"PipelineConfig.microbatches={self.microbatches!r}: a whole number >= 1, or unset.")

    def n_microbatches(self, pp: int, batch_size: int) -> int:
        """The micro-batch count for a ``batch_size`` batch on ``pp`` ranks, checked."""
        n = self.microbatches or min(batch_size, 2 * pp * self.stages_per_rank)
        if batch_size % n:
            raise SettingsError(
                f"pipeline.microbatches={n} does not divide the batch of {batch_size}: choose a divisor of "
                "the per-replica batch size (--pipeline.microbatches)."
            )
        if self.schedule in MULTI_STAGE and n % pp:
            raise SettingsError(
                f"pipeline.schedule={self.schedule} needs the micro-batch count ({n}) to be a multiple of "
                f"the pipeline degree {pp}: set --pipeline.microbatches."
            )
        return n


@dataclass
class ParallelConfig:
    """Parallelism degrees (validated on construction; checked against the world size and the model by
    :func:`check_parallel`). Every field is a ``--parallel.<field>`` flag of ``hf-dtrain pretrain`` (short forms
    ``--tp``, ``--pp``, ``--dp-shard``, ``--dp-replicate``) and a key of the ``parallel:`` YAML section.
    tp x pp x dp_replicate x dp_shard must equal the number of processes."""

    section_key: ClassVar[str] = "parallel"

    tp: int = setting(
        1, "Tensor-parallel degree (hf_dtrain.parallel.apply_tensor_parallel); the innermost mesh dim.", min=1
    )
    pp: int = setting(1, "Pipeline stages (hf_dtrain.parallel.apply_pipeline); the outermost mesh dim.", min=1)
    dp_replicate: int = setting(1, "Data-parallel replica groups (HSDP's replicate dim; gradients all-reduced).", min=1)
    dp_shard: int | None = setting(None, "Data-parallel shards (FSDP2). None: the processes left over.", min=1)
    plan: str | None = setting(
        None,
        "auto: measure this machine (hf_dtrain.parallel.planner.measure_profile, a few seconds on the "
        "launched ranks), rank every legal plan with the planner's cost model and run the best that fits "
        "(the degrees above must then be left at their defaults; the global batch is "
        "per_device_train_batch_size x processes).",
    )

    def __post_init__(self):
        check_fields(self)
        if self.plan is not None:
            if self.plan != "auto":
                raise SettingsError(f"parallel.plan={self.plan!r}: the one value is auto (--plan auto).")
            if (self.tp, self.pp, self.dp_replicate, self.dp_shard) != (1, 1, 1, None):
                raise SettingsError(
                    "--plan auto chooses --tp, --pp, --dp-replicate and --dp-shard itself: leave them "
                    "out, or drop --plan auto to set them by hand."
                )

    def degrees(self, world: int) -> dict[str, int]:
        """{pp, dp_replicate, dp_shard, tp} for ``world`` processes; a product that is not ``world`` is a
        ``ValueError`` naming the flags."""
        others = self.tp * self.pp * self.dp_replicate
        if self.dp_shard is None:
            if world % others:
                raise SettingsError(
                    f"--tp {self.tp} x --pp {self.pp} x --dp-replicate {self.dp_replicate} = {others} "
                    f"does not divide the {world} processes: choose degrees whose product divides the "
                    "process count (dp_shard takes the rest)."
                )
            shard = world // others
        else:
            shard = self.dp_shard
            if others * shard != world:
                raise SettingsError(
                    f"--tp {self.tp} x --pp {self.pp} x --dp-replicate {self.dp_replicate} x --dp-shard "
                    f"{shard} = {others * shard}, but there are {world} processes: the degrees' product "
                    "must equal the process count (leave --dp-shard out to take the rest)."
                )
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": shard, "tp": self.tp}
