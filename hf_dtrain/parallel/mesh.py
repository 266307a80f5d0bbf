"""The process mesh of a composed run: pipeline x data (replicate, shard) x tensor parallelism, checked before any
process group exists, built as one ``DeviceMesh`` (``pp``, ``dp_replicate``, ``dp_shard``, ``tp``; the same names
as Accelerate's ``ParallelismConfig`` and torchtitan), and the model laid out on it: tensor parallelism on ``tp``,
then FSDP2 (HSDP when ``dp_replicate > 1``) on the data dimensions, per pipeline stage when ``pp > 1``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from .config import FSDPConfig, ParallelConfig, PipelineConfig
from .fsdp import apply_fsdp
from .pipeline import apply_pipeline, check_pipeline
from .tensor import apply_tensor_parallel, check_tensor_parallel

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def check_parallel(config: ParallelConfig, world: int, model_config, pipeline=None) -> dict[str, int]:
    """Every check that needs no process group: the degrees' product, tp against the heads / MLP / vocabulary, the
    stages against the layers. Returns the degrees."""
    degrees = config.degrees(world)
    pipeline = pipeline or PipelineConfig()
    check_tensor_parallel(model_config, degrees["tp"])
    check_pipeline(model_config, degrees["pp"], pipeline.stages_per_rank)
    return degrees


def build_mesh(degrees: dict[str, int], device_type: str | None = None):
    """The 4D ``DeviceMesh`` (``pp``, ``dp_replicate``, ``dp_shard``, ``tp``); dims of size 1 are kept, so every
    name exists. Needs the default process group."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return init_device_mesh(device_type, tuple(degrees[d] for d in DIMS), mesh_dim_names=DIMS)


def last_stage_rank(degrees: dict[str, int], world: int) -> int:
    """The global rank of the last pipeline stage's first rank (the mesh is pp-major)."""
    return (degrees["pp"] - 1) * (world // degrees["pp"])


def data_parallel(mesh) -> tuple[int, int]:
    """(this rank's data-parallel index, the data-parallel size): ranks with the same index see the same batches
    (the tp and pp ranks of one replica)."""
    r, s = mesh["dp_replicate"].get_local_rank(), mesh["dp_shard"].get_local_rank()
    shards = mesh["dp_shard"].size()
    return r * shards + s, mesh["dp_replicate"].size() * shards


def data_mesh(mesh):
    """The mesh FSDP2 shards on: (dp_replicate, dp_shard) for HSDP, dp_shard alone, or None (no data parallelism)."""
    replicate, shard = mesh["dp_replicate"].size(), mesh["dp_shard"].size()
    if replicate * shard == 1:
        return None
    if replicate == 1:
        return mesh["dp_shard"]
    return mesh["dp_replicate", "dp_shard"]


def layout(module: nn.Module, mesh, tensor_parallel=None, fsdp=None) -> nn.Module:
    """Tensor parallelism on ``mesh['tp']`` (when > 1), then FSDP2 on the data dimensions (when > 1): the model, or
    one pipeline stage of it (``apply_pipeline(..., after_split=lambda s: layout(s, mesh, ...))``)."""
    if mesh["tp"].size() > 1:
        apply_tensor_parallel(module, mesh["tp"], tensor_parallel)
    dp = data_mesh(mesh)
    if dp is not None:
        apply_fsdp(module, fsdp or FSDPConfig(), mesh=dp)
    return module


def apply_parallelism(
    model: nn.Module,
    mesh,
    *,
    batch_size: int,
    seq_len: int,
    tensor_parallel=None,
    pipeline=None,
    fsdp=None,
    device=None,
    layer_cut=None,
):
    """Lay ``model`` out on ``mesh``: pipeline stages (when ``pp > 1``), each with tensor parallelism and FSDP2 on
    its dims (:func:`layout`). Returns ``(pipeline or None, the module whose parameters train)``; build the
    optimizer from the latter. With a pipeline that module is ``model`` itself, holding only this rank's stages (the
    layers it does not run are dropped), so its parameters keep the whole model's names: a snapshot or checkpoint
    of it lines up with any other layout's. ``fsdp.activation_checkpointing`` recomputes each decoder layer (set on
    the whole model before the split). ``batch_size``: one data-parallel replica's sequences per step.
    ``layer_cut``: the pipeline stages' layers, instead of the balanced cut (:func:`apply_pipeline`)."""
    from .fsdp import FSDPConfig

    fsdp = fsdp or FSDPConfig()
    if fsdp.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        fsdp = dataclasses.replace(fsdp, activation_checkpointing=False)  # done above, for every stage alike

    def shard(module):
        return layout(module, mesh, tensor_parallel, fsdp)

    if mesh["pp"].size() > 1:
        pipe = apply_pipeline(
            model,
            mesh["pp"],
            pipeline,
            batch_size=batch_size,
            seq_len=seq_len,
            device=device,
            after_split=shard,
            layer_cut=layer_cut,
        )
        return pipe, model
    shard(model)
    return None, model


def laid_out_step(pipe, model: nn.Module, blocks: torch.Tensor, autocast):
    """One step's forward and backward of a laid-out model on ``blocks`` (labels = inputs): over the pipeline's
    micro-batches when ``pipe`` is one (the loss on every rank), else on the tensor-parallel shards with loss
    parallelism. ``autocast``: the precision's context manager (``accelerator.autocast()``). Returns the loss."""
    from .tensor import local_loss, tensor_parallel_loss

    if pipe is not None:
        with autocast:
            return pipe.step(blocks, blocks)
    with tensor_parallel_loss(model):
        with autocast:
            loss = model(input_ids=blocks, labels=blocks).loss
        loss.backward()
    return local_loss(loss)


def trace_layout(
    build,
    degrees: dict[str, int],
    *,
    batch_size: int,
    seq_len: int,
    tensor_parallel=None,
    pipeline=None,
    fsdp=None,
    autocast: torch.dtype | None = None,
    layer_cut=None,
    optimizer=None,
    steps: int = 2,
    flops: bool = False,
    fake: bool = True,
):
    """Will a model laid out by your own loop fit? One training step of ``build``'s model laid out on ``degrees``
    (:func:`apply_parallelism`: pipeline stages, tensor parallelism, FSDP2 on the data dims), its forward and
    backward as :func:`laid_out_step` runs them and its optimizer's step, traced
    (:func:`hf_dtrain.estimate.trace_step`). Returns the :class:`~hf_dtrain.estimate.StepMemory` of the rank that
    holds the most.

    ``build(device)``: the model on ``device`` (``"meta"`` for the trace), with its method applied (``get_peft_model``
    with LoRA or LoRA-FA: their adapters shard with their base layers under tensor parallelism).
    ``optimizer(params)``: the optimizer of the parameters that train (AdamW, lr 1e-4, by default).
    ``batch_size``: one data-parallel replica's sequences per step.

    ``fake=True`` (the estimate): this process is rank 0 of ``prod(degrees)`` over torch's fake process group, and,
    with a pipeline, the last stage's first rank too (it holds the head and the logits); no weight is allocated.
    ``fake=False`` (the measurement the estimate is checked against): real tensors in the process group the caller
    made, this process's rank (every rank running the same call); a pipeline's first step, in which its stages infer
    their shapes, runs untraced first."""
    import contextlib
    import math

    from hf_dtrain.estimate.trace import fake_tensors, fake_world, make_fake, trace_step

    world = math.prod(degrees[d] for d in DIMS)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ranks = [0] + ([last_stage_rank(degrees, world)] if degrees["pp"] > 1 else []) if fake else [None]
    largest = None
    for rank in ranks:
        with fake_world(world, device.type, rank=rank) if fake else contextlib.nullcontext():
            model = build("meta" if fake else device.type)
            with fake_tensors() if fake else contextlib.nullcontext():
                if fake:
                    model = make_fake(model, device)
                model.train()
                pipe, trained = apply_parallelism(
                    model,
                    build_mesh(degrees, device.type),
                    batch_size=batch_size,
                    seq_len=seq_len,
                    tensor_parallel=tensor_parallel,
                    pipeline=pipeline,
                    fsdp=fsdp,
                    device=device,
                    layer_cut=layer_cut,
                )
                params = [p for p in trained.parameters() if p.requires_grad]
                opt = optimizer(params) if optimizer is not None else torch.optim.AdamW(params, lr=1e-4)
                vocab = model.config.vocab_size  # a peft model's is its base model's
                blocks = torch.randint(0, vocab, (batch_size, seq_len), device=device)
                precision = torch.autocast(device.type, dtype=autocast) if autocast else contextlib.nullcontext()

                def step():
                    laid_out_step(pipe, trained, blocks, precision)
                    opt.step()
                    opt.zero_grad(set_to_none=True)

                if not fake and pipe is not None:
                    step()
                memory = trace_step(trained, opt, step, steps=steps, flops=flops)
        if largest is None or memory.peak > largest.peak:
            largest = memory
    return largest
