"""Tensor and sequence parallelism for Hugging Face LLaMA-family models, on torch's own engine (DTensor and
``torch.distributed.tensor.parallel.parallelize_module``).

``apply_tensor_parallel(model, mesh)`` shards, over a 1D ``tp`` mesh (Megatron's layout, as torchtitan plans it):

* q/k/v, gate and up projections column-wise (each rank holds ``1/tp`` of the heads and of the MLP rows), o and
  down projections row-wise (their partial sums are reduced once per block);
* the embedding row-wise over the vocabulary and ``lm_head`` column-wise; with ``loss_parallel`` the logits stay
  sharded over the vocabulary and the cross-entropy is computed on the shards (``torch.distributed.tensor.parallel
  .loss_parallel``), so no rank holds the whole ``batch x seq x vocab`` logits;
* with ``sequence_parallel`` the norms and the residual stream between the blocks are sharded over the sequence:
  each row-wise projection reduce-scatters onto sequence shards and each block's input is all-gathered, instead of
  an all-reduce and replicated activations.

The embedding's output is all-reduced (replicated) and the first decoder layer takes its own sequence shard of it:
the model computes its rotary embeddings and attention mask from the whole sequence, as without tensor
parallelism. peft adapters: LoRA (peft's own) and LoRA-FA are sharded with their base layer (the adapter matrix on
the sharded side follows the base weight, the other is replicated); the other tuners are refused with the reason.

Under ``loss_parallel`` the forward and the backward must run inside :func:`tensor_parallel_loss` (``with
tensor_parallel_loss(model): loss = model(**batch).loss; loss.backward()``); every rank of a ``tp`` group must see
the same batch.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from hf_dtrain.errors import SettingsError
from hf_dtrain.models import is_tuner_layer

from .config import TensorParallelConfig

# the module names of a LLaMA-family decoder layer (LLaMA, Mistral, Qwen2 and their kin use the same)
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")

# peft tuner layers whose adapters TP can shard: the adapter tensors on the input side ([r, in]: sharded on dim 1
# when the base layer is row-wise) and on the output side ([out, r]: sharded on dim 0 when it is column-wise); the
# other side is replicated. The peft prefix is the attribute holding the adapters (per adapter name).
TP_ADAPTERS = {"lora_": ("lora_A", "lora_B"), "lorafa_": ("lorafa_A", "lorafa_B")}
TP_REFUSED = {
    "smt_": "SMT's trainable blocks are addressed by (row block, column block) indices of the whole weight; a "
    "tensor-parallel shard would split blocks across ranks and renumber them",
    "qbara_": "Q-BaRA's base is a quantized (4-bit) weight, which DTensor cannot shard, and its adapters act on "
    "groups of the whole input",
    "qahr_": "QA-HiRA's Hadamard-product adapter is defined on groups of the whole (quantized) weight",
}


def _tuner_kind(module: nn.Module):
    if not is_tuner_layer(module):
        return None
    first = module.adapter_layer_names[0] if module.adapter_layer_names else type(module).__name__
    for prefix in (*TP_ADAPTERS, *TP_REFUSED):
        if first.startswith(prefix):
            return prefix
    return first


def check_tensor_parallel(model_config, tp: int) -> None:
    """Refuse a ``tp`` degree the model's shapes do not allow, naming the dim and the fix (before any process group
    exists: the planner and the CLI call this first)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise SettingsError(f"tp={tp!r}: the tensor-parallel degree must be a whole number >= 1 (--tp).")
    if tp == 1:
        return
    dims = {
        "num_attention_heads": model_config.num_attention_heads,
        "num_key_value_heads": getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads,
        "intermediate_size": model_config.intermediate_size,
        "vocab_size": model_config.vocab_size,
    }
    for name, value in dims.items():
        if value % tp:
            raise SettingsError(
                f"--tp {tp} does not divide the model's {name} ({value}): each rank holds 1/tp of "
                f"the {name.split('_')[-1]}; choose a tp that divides {value}."
            )


class _TunerLinearParallel:
    """A peft tuner layer (LoRA or LoRA-FA) around a column- or row-wise base: its base weight and adapter tensors
    become DTensors and its forward runs on DTensors, so the base and adapter products come out sharded (column-wise)
    or as partial sums reduced once together (row-wise)."""

    def __init__(self, rowwise: bool, sequence_parallel: bool):
        self.rowwise, self.sequence_parallel = rowwise, sequence_parallel

    def placements(self, name: str, tensor: torch.Tensor, prefix: str):
        in_side, out_side = TP_ADAPTERS[prefix]
        if name.startswith("base_layer."):
            if name.endswith("bias"):
                return [Replicate()] if self.rowwise else [Shard(0)]
            return [Shard(1)] if self.rowwise else [Shard(0)]
        if name.startswith(in_side + "."):  # [r, in]: the input dim follows a row-wise base
            return [Shard(tensor.dim() - 1)] if self.rowwise else [Replicate()]
        if name.startswith(out_side + "."):  # [out, r]: the output dim follows a column-wise base
            return [Replicate()] if self.rowwise else [Shard(0)]
        raise SettingsError(
            f"tensor parallelism: {name!r} of a {prefix} tuner layer has no placement rule; leave this "
            "module out of the adapter's target_modules or train without --tp."
        )

    def apply(self, module: nn.Module, mesh) -> None:
        from torch.distributed.tensor import distribute_module, distribute_tensor

        prefix = _tuner_kind(module)

        def partition(name, sub, mesh):
            for key, param in list(sub.named_parameters(recurse=False)):
                full = f"{name}.{key}" if name else key
                placed = distribute_tensor(param.data, mesh, self.placements(full, param, prefix))
                sub.register_parameter(key, nn.Parameter(placed, requires_grad=param.requires_grad))
            for key, buf in list(sub.named_buffers(recurse=False)):
                full = f"{name}.{key}" if name else key
                sub._buffers[key] = distribute_tensor(buf, mesh, self.placements(full, buf, prefix))

        rowwise, sp = self.rowwise, self.sequence_parallel

        def inputs(mod, args, mesh):
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Shard(-1)] if rowwise else [Replicate()], run_check=False)
            return (x, *args[1:])

        def outputs(mod, out, mesh):
            if rowwise:
                out = out.redistribute(mesh, [Shard(1)] if sp else [Replicate()])
            return out.to_local()

        distribute_module(module, mesh, partition, inputs, outputs)


def _split_sequence():
    """Layer 0's input: the embedding's (replicated) output cut to this rank's sequence shard, no communication."""
    return PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True)


def _tuner_layers(base: nn.Module) -> dict[str, nn.Module]:
    """The model's peft tuner layers by name, refusing the kinds tensor parallelism cannot shard."""
    tuners = {}
    for name, module in base.named_modules():
        kind = _tuner_kind(module)
        if kind is None:
            continue
        if kind in TP_REFUSED:
            raise SettingsError(
                f"tensor parallelism cannot shard the {kind.rstrip('_')} adapter of {name!r}: "
                f"{TP_REFUSED[kind]}. Train it with FSDP2 or ZeRO-3 (--dp-shard) instead of --tp."
            )
        if kind not in TP_ADAPTERS:
            raise SettingsError(
                f"tensor parallelism has no sharding rule for the {type(module).__name__} tuner layer "
                f"{name!r}; LoRA and LoRA-FA are supported."
            )
        tuners[name] = module
    return tuners


def _shard_layer(layer: nn.Module, prefix: str, mesh, sp: bool, tuners: dict) -> None:
    """One decoder layer (``prefix``: its name in the model) sharded: projections colwise / rowwise, the norms
    sequence-parallel under SP, its tuner layers by :class:`_TunerLinearParallel`."""
    seq = Shard(1) if sp else Replicate()
    # the block's input stays a (replicated) DTensor: the projections' input gradients (partial sums) then add
    # up as DTensors and are reduced once per block (a reduce-scatter under SP), not once per projection
    plan = {
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": seq},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=False,
        ),
        "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=False),
    }
    if sp:
        plan.update({n: SequenceParallel() for n in NORMS})
    for n in COLWISE + ROWWISE:
        if prefix + n not in tuners:
            plan[n] = ColwiseParallel() if n in COLWISE else RowwiseParallel(output_layouts=seq)
    parallelize_module(layer, mesh, plan)
    for n in COLWISE + ROWWISE:
        if prefix + n in tuners:
            _TunerLinearParallel(n in ROWWISE, sp).apply(tuners[prefix + n], mesh)
    other = [t for t in tuners if t.startswith(prefix) and t[len(prefix) :] not in COLWISE + ROWWISE]
    if other:
        raise SettingsError(
            f"tensor parallelism: no sharding rule for the adapter on {other[0]!r}; target the "
            f"projections {list(COLWISE + ROWWISE)} only."
        )


def _check_sequence(tp: int, module, args, kwargs) -> None:
    """Forward pre-hook of a sequence-parallel model: the sequence splits evenly over the ``tp`` ranks."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    if ids is not None and ids.shape[1] % tp:
        raise SettingsError(
            f"sequence parallelism over tp={tp} ranks needs a sequence length divisible by "
            f"{tp}, got {ids.shape[1]}: pad the batch to a multiple of {tp} (e.g. the "
            f"tokenizer's pad_to_multiple_of={tp}) or set tp.sequence_parallel false."
        )


def apply_tensor_parallel(model: nn.Module, mesh, config: TensorParallelConfig | None = None) -> nn.Module:
    """Shard a LLaMA-family causal LM (or a peft model around one) in place over the 1D ``mesh`` (the ``tp``
    dimension of a larger mesh). Build the optimizer after this call; with FSDP2, call ``apply_fsdp`` on the
    data-parallel dimension afterwards (2D: FSDP over TP). See the module docstring."""
    config = config or TensorParallelConfig()
    if mesh.ndim != 1:
        raise SettingsError(f"apply_tensor_parallel takes the 1D tp mesh (mesh['tp']), got a {mesh.ndim}D mesh.")
    tp = mesh.size()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = getattr(base, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None or not hasattr(base, "lm_head") or not hasattr(decoder, "embed_tokens"):
        raise SettingsError(
            f"apply_tensor_parallel: {type(base).__name__} is not a LLaMA-family causal LM "
            "(model.embed_tokens, model.layers, model.norm, lm_head)."
        )
    if getattr(model, "_hf_dtrain_tp", None) is not None:
        raise SettingsError("apply_tensor_parallel: the model is already tensor-parallel; apply it once.")
    check_tensor_parallel(base.config, tp)
    tied = base.config.tie_word_embeddings if hasattr(base.config, "tie_word_embeddings") else False
    sp, lp = config.sequence_parallel, config.loss_parallel
    seq = Shard(1) if sp else Replicate()

    tuners = _tuner_layers(base)

    # a pipeline stage (hf_dtrain.models.LlamaPipelineStage) holds some layers (a ModuleDict keyed by
    # their index in the whole model) and the embedding / norm + lm_head only on the first / last stage
    items = list(layers.items()) if isinstance(layers, nn.ModuleDict) else list(enumerate(layers))
    has_embed, has_head = decoder.embed_tokens is not None, base.lm_head is not None
    top = {}
    if has_embed:
        top["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if has_head:
        top["lm_head"] = ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1) if lp else Replicate(), use_local_output=not lp
        )
        if sp:
            top["model.norm"] = SequenceParallel()
    for key in ("model.embed_tokens", "lm_head"):
        if any(n == key for n in tuners):
            raise SettingsError(
                f"tensor parallelism: the adapter on {key!r} is not supported; leave it out of target_modules."
            )
    frozen = {n for n, p in base.named_parameters() if not p.requires_grad}
    if top:
        parallelize_module(base, mesh, top)
    for i, layer in items:
        _shard_layer(layer, f"model.layers.{i}.", mesh, sp, tuners)
    if sp and has_embed:  # the embedding's replicated output: the first layer takes its own sequence shard
        parallelize_module(items[0][1], mesh, _split_sequence())
    for n, p in base.named_parameters():  # torch's SequenceParallel re-creates the norm weights trainable
        if n in frozen:
            p.requires_grad_(False)
    if tied:  # both are vocabulary-sharded (Shard(0)): the tie holds on the shards
        base.lm_head.weight = decoder.embed_tokens.weight
    if sp:
        base.register_forward_pre_hook(functools.partial(_check_sequence, tp), with_kwargs=True)
    model._hf_dtrain_tp = config
    base.sequence_shards = tp if sp else 1  # a later pipeline stage receives 1/tp of the sequence
    return model


def tensor_parallel_loss(model: nn.Module):
    """The context a tensor-parallel model's forward and backward run in: ``loss_parallel()`` when the logits stay
    vocabulary-sharded, else nothing."""
    config = getattr(model, "_hf_dtrain_tp", None)
    if config is None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = getattr(base, "_hf_dtrain_tp", None)
    if config is not None and config.loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (a loss-parallel loss is a replicated DTensor): for logging and ``.item()``."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
