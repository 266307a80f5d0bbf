"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for Hugging Face models and their peft adapters.

``apply_fsdp(model, FSDPConfig(...))`` shards each decoder layer as one FSDP unit and the root as the last, the way
torchtitan and Accelerate's FSDP2 plugin do. A peft tuner layer's adapter and its base layer always sit in the same
unit (a wrap that would split them is refused), so every adapter trains on the rank-local shard of its own layer.
With ``replicate > 1`` the processes form a 2D mesh (``dp_replicate`` x ``dp_shard``): HSDP, shards within a group
and an all-reduce across groups.

``hf_dtrain.parallel.full_state_dict`` and ``save_pretrained`` gather a sharded model for saving (peft adapters
included); resume from sharded checkpoints with ``torch.distributed.checkpoint`` (``get_state_dict`` /
``set_state_dict``) or Accelerate's ``save_state`` / ``load_state``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from hf_dtrain.errors import RunFailure, SettingsError
from hf_dtrain.models import is_tuner_layer

from .config import FSDPConfig

PARAM_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # FSDPConfig.param_dtype
# fully_shard makes an integer parameter (a 4-bit base's packed weights) a Parameter that asks for gradients before
# it sets requires_grad, which fails on torch 2.11 ("only Tensors of floating point dtype can require gradients");
# torch 2.13 passes requires_grad through (2.12 not tried here)
INTEGER_SHARDS_FROM = (2, 13)


def _check_integer_parameters(model: nn.Module) -> None:
    if torch.__version__ >= INTEGER_SHARDS_FROM:
        return
    packed = [name for name, p in model.named_parameters() if not p.is_floating_point()]
    if packed:
        raise SettingsError(
            f"--fsdp: FSDP2 on torch {torch.__version__} cannot shard integer parameters ({packed[0]}"
            f"{f' and {len(packed) - 1} more' if len(packed) > 1 else ''}: a 4-bit base's packed weights); torch "
            f"{'.'.join(map(str, INTEGER_SHARDS_FROM))} and later can. Upgrade torch, or train this base without "
            "--fsdp."
        )


def _tuner_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if is_tuner_layer(m)}


def fsdp_units(model: nn.Module, config: FSDPConfig) -> list[tuple[str, nn.Module]]:
    """The modules ``apply_fsdp`` shards as units (the root not included), checked: at least one, none inside a
    peft tuner layer (that would put a base layer in another unit than its adapter)."""
    classes = config.layer_classes
    if classes is None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        classes = list(getattr(base, "_no_split_modules", None) or [])
        if not classes:
            raise SettingsError(
                f"{type(base).__name__} names no decoder layer (_no_split_modules is empty): set "
                "FSDPConfig.layer_classes (fsdp.layer_classes) to the class of its repeated blocks."
            )
    units = [(n, m) for n, m in model.named_modules() if type(m).__name__ in classes and n]
    if not units:
        raise SettingsError(
            f"FSDPConfig.layer_classes={classes} matches no module of {type(model).__name__}; name "
            "the class of its decoder layers (e.g. LlamaDecoderLayer)."
        )
    tuners = _tuner_layers(model)
    for name, _ in units:
        for tname in tuners:
            if name.startswith(tname + "."):
                raise SettingsError(
                    f"FSDPConfig.layer_classes={classes} would make {name!r} an FSDP unit of its own, apart from the "
                    f"adapter of the peft tuner layer {tname!r} that wraps it: the adapter would be gathered and "
                    "reduced in another unit than its base weight. Wrap whole decoder layers (e.g. "
                    "[LlamaDecoderLayer]) or the tuner layers themselves."
                )
    return units


def fsdp_mesh(config: FSDPConfig, device_type: str | None = None):
    """The data-parallel ``DeviceMesh``: 1D (``dp_shard``) or, with ``replicate > 1``, 2D (``dp_replicate``,
    ``dp_shard``)."""
    if not dist.is_initialized():
        raise RunFailure(
            "apply_fsdp needs torch.distributed: launch with torchrun / accelerate launch (or call "
            "torch.distributed.init_process_group) first."
        )
    world = dist.get_world_size()
    if world % config.replicate:
        raise SettingsError(
            f"FSDPConfig.replicate={config.replicate} does not divide the {world} processes: HSDP "
            "needs replicate x shards = processes; set fsdp.replicate to a divisor of the process count."
        )
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if config.replicate == 1:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(
        device_type, (config.replicate, world // config.replicate), mesh_dim_names=("dp_replicate", "dp_shard")
    )


def apply_fsdp(model: nn.Module, config: FSDPConfig | None = None, mesh=None) -> nn.Module:
    """Shard ``model`` in place with FSDP2: one unit per decoder layer (or ``config.layer_classes``), then the
    root. Build the optimizer after this call, from ``model.parameters()`` (they are now DTensors).

    ``mesh``: the default is :func:`fsdp_mesh` (2D for HSDP). To compress HSDP's exchange across replica groups,
    shard on its ``dp_shard`` dimension only and hand the ``dp_replicate`` group to
    :func:`hf_dtrain.comm.register_fsdp`::

        mesh = fsdp_mesh(config)
        apply_fsdp(model, config, mesh=mesh["dp_shard"])
        state = register_fsdp(model, "acp_sgd", mesh["dp_replicate"].get_group())

    peft adapters must be in place first (``get_peft_model`` before ``apply_fsdp``), and SMT's blocks selected
    (``smt_warmup`` or ``SMTConfig(block_indices=...)``): selection installs new parameters, which FSDP2 cannot
    take in after sharding."""
    config = config or FSDPConfig()
    if isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in model.modules()):
        raise SettingsError("apply_fsdp: the model is already sharded with fully_shard; apply it once.")
    units = fsdp_units(model, config)
    _check_integer_parameters(model)
    mesh = mesh if mesh is not None else fsdp_mesh(config)
    if config.activation_checkpointing:
        if not hasattr(model, "gradient_checkpointing_enable"):
            raise SettingsError(
                f"FSDPConfig.activation_checkpointing: {type(model).__name__} has no "
                "gradient_checkpointing_enable; checkpoint its layers yourself or set it false."
            )
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()  # frozen embeddings under peft: the checkpointed input needs grad
    kwargs = {"mesh": mesh, "reshard_after_forward": config.reshard_after_forward}
    if PARAM_DTYPES[config.param_dtype] is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=PARAM_DTYPES[config.param_dtype], reduce_dtype=torch.float32
        )
    if config.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for _, unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model
