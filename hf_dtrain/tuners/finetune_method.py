"""What the jobs know of each fine-tuning method, pushed here by the method itself.

A method registers a :class:`FinetuneMethod` with :func:`register_finetune_method` when its folder is imported
(``hf_dtrain/tuners/<method>/method.py``; peft's ``register_peft_method`` and torchtitan's train-spec registry have
this shape). It declares everything the jobs would otherwise branch on:

* its name, default learning rate, the 4-bit bases it trains on, and its own settings (a dataclass that becomes the
  ``--<name>.*`` section of ``hf-dtrain finetune`` and of the sweep's jobs);
* ``build_config(adapter, settings, model)``: its peft config from the adapter settings every method shares
  (:class:`AdapterSettings`: ``--lora-r``, ``--lora-alpha``, ``--lora-dropout``, ``--target-modules``,
  ``--quant-group-size``) and its own settings; never the whole job config;
* ``prepare(model, settings, data)``: a step after the adapters are made and before the model is wrapped and trains
  (SMT's block selection, outside ``max_steps``);
* ``owns_optimizer(settings)`` / ``build_optimizer``: an optimizer of its own (LoRA-FA's), and the flag that turns it
  off, which the optimizer section names when it refuses a second optimizer;
* ``fused``: how its adapters train fused in ``hf-dtrain sweep`` (:class:`LowRankForm`, :class:`BlockSparseForm`,
  :data:`WHOLE_MODEL`), or the reason they cannot.

This module imports neither torch nor peft (``hf-dtrain finetune --help`` reads it); the methods import their heavy
parts inside the functions they register. A tuner outside hf_dtrain registers the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hf_dtrain.errors import SettingsError

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class AdapterSettings:
    """The adapter settings every method reads (the job's ``--lora-r``, ``--lora-alpha``, ``--lora-dropout``,
    ``--target-modules``, ``--quant-group-size``); each method says which it uses."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] | None = None
    quant_group_size: int = 64

    def targets(self, default: list[str] = LORA_TARGETS) -> list[str]:
        return list(self.target_modules or default)


@dataclass(frozen=True)
class MethodData:
    """What a method's ``prepare`` step may use (it runs before the model is wrapped for DDP, FSDP2, DeepSpeed or a
    fused sweep): the training data as the job draws it, where the model runs and what it computes in."""

    train: Any  # the prepared training dataset
    collator: Callable
    batch_size: int
    seed: int
    world_size: int = 1
    rank: int = 0
    adapter_name: str | None = None
    progress: bool = True
    autocast_dtype: Any = None  # the torch dtype the job computes in under autocast (bf16 / fp16), None for none


@dataclass(frozen=True)
class LowRankForm:
    """Adapters of the form ``s * B A`` (LoRA, LoRA-FA, Q-BaRA), trained fused as ``hf_dtrain.fused.FusedLowRank``:
    ``factors(layer, name)`` gives the adapter's live ``(A, B)`` tensors (``A: (r, in/pool)``, ``B: (out/pool, r)``;
    the fused values are copied back into them), ``dropout(layer, name)`` its dropout probability, ``pool(layer,
    name)`` its input pooling factor; ``check(layer, names)`` raises ``ValueError`` when these adapters cannot fuse."""

    factors: Callable[[Any, str], tuple]
    dropout: Callable[[Any, str], float] = lambda layer, name: 0.0
    pool: Callable[[Any, str], int] = lambda layer, name: 1
    a_trainable: bool = True
    check: Callable[[Any, list], None] | None = None
    optimizer_rule: str = "adamw"  # hf_dtrain.fused.FusedAdamW's rule while the method's own optimizer is on


@dataclass(frozen=True)
class BlockSparseForm:
    """Adapters that train blocks of the weight (SMT), fused as ``hf_dtrain.fused.FusedBlockSparse``:
    ``blocks(layer, name)`` gives ``(indices (count, 2), weight (count, bs, bs) or None, block size)``, ``delta`` the
    block-sparse product ``delta(x, blocks, rows, cols, out_features, column_index)``, ``write_back(layer, name,
    weight)`` copies trained blocks into the adapter; ``check(layer, names)`` as for :class:`LowRankForm`."""

    blocks: Callable[[Any, str], tuple]
    delta: Callable[[], Callable]
    write_back: Callable[[Any, str, Any], None]
    check: Callable[[Any, list], None] | None = None


# full fine-tuning trains fused as K copies of the whole model (hf_dtrain.fused.fuse_models)
WHOLE_MODEL = "whole model"


@dataclass(frozen=True)
class FinetuneMethod:
    name: str
    default_lr: float
    # (adapter settings, own settings or None, base model) -> peft config, or None (full fine-tuning)
    build_config: Callable[[AdapterSettings, Any, Any], Any]
    quantized_bases: tuple[str, ...] = ()  # the --quantize values it trains on
    settings: type | None = None  # its own section of the job config (a dataclass), named after the method
    peft_type: str | None = None  # the peft type of its adapters ("LORA", "SMT"...), None for full fine-tuning
    # (model, own settings, MethodData) -> Trainer callbacks; runs after get_peft_model, before the model is wrapped
    prepare: Callable[[Any, Any, MethodData], list] | None = None
    # (model, own settings, seed) -> None: prepare's stand-in when no data is read (a model on fake tensors, traced
    # for its memory): what prepare would select, drawn from the seed, with the same shapes
    without_data: Callable[[Any, Any, int], None] | None = None
    # whether it builds its own optimizer with these settings, and (own settings, model, lr, wd) -> that optimizer
    owns_optimizer: Callable[[Any], bool] = lambda settings: False
    build_optimizer: Callable[[Any, Any, float, float], Any] | None = None
    own_optimizer_off: str = ""  # the flag that turns its own optimizer off (said when another one is asked for)
    # how its adapters train fused (LowRankForm, BlockSparseForm, WHOLE_MODEL), a str saying why they cannot, or None
    fused: Any = None
    # its own settings that may differ between the jobs of one fused sweep, and those of them a sweep's grid takes
    # from the command line (setting -> (type, the short label in job names)): --smt.num-blocks 8,16
    sweep_settings: tuple[str, ...] = ()
    sweep_axes: dict = field(default_factory=dict, compare=False)
    order: int = field(default=100, compare=False)  # where --method lists it (lower first)
    default: bool = field(default=False, compare=False)  # the jobs' --method when none is given

    def fused_form(self):
        """Its fused form, or ``ValueError`` with the reason it has none."""
        if self.fused is None or (isinstance(self.fused, str) and self.fused != WHOLE_MODEL):
            reason = self.fused or "it has no fused form"
            raise SettingsError(f"method {self.name!r} cannot be fused: {reason}")
        return self.fused


# name -> method
FINETUNE_METHODS: dict[str, FinetuneMethod] = {}
_version = [0]  # bumped by every registration (the job configs holding the methods' sections are rebuilt)


def registry_version() -> int:
    return _version[0]


def register_finetune_method(method: FinetuneMethod) -> FinetuneMethod:
    """Make ``method`` known to the fine-tuning jobs (idempotent: registering a name again replaces it, so a
    reloaded tuner module points the job at its new classes)."""
    if not isinstance(method, FinetuneMethod):
        raise TypeError(f"register_finetune_method takes a FinetuneMethod, got {type(method).__name__}.")
    if not method.name.isidentifier() or method.name != method.name.lower():
        raise SettingsError(
            f"FinetuneMethod.name must be a lower-case identifier (it is a flag section), got {method.name!r}."
        )
    FINETUNE_METHODS[method.name] = method
    ordered = sorted(FINETUNE_METHODS.values(), key=lambda m: m.order)
    FINETUNE_METHODS.clear()
    FINETUNE_METHODS.update((m.name, m) for m in ordered)
    _version[0] += 1
    return method


def unregister_finetune_method(name: str) -> None:
    """Forget a registered method (a plug-in's tests put the registry back as they found it)."""
    if FINETUNE_METHODS.pop(name, None) is not None:
        _version[0] += 1


def default_method() -> str:
    """The jobs' ``--method`` when none is given: the first registered method that says it is the default."""
    for method in FINETUNE_METHODS.values():
        if method.default:
            return method.name
    raise SettingsError("no registered fine-tuning method is the default; register one with default=True.")


def method_names() -> tuple[str, ...]:
    return tuple(FINETUNE_METHODS)


def fused_form_of(peft_type: str):
    """The fused form of adapters of ``peft_type`` (from the method that registered one), or ``ValueError`` naming
    why they cannot fuse."""
    methods = [m for m in FINETUNE_METHODS.values() if m.peft_type == peft_type]
    for m in methods:
        if m.fused is not None and not isinstance(m.fused, str):
            return m.fused
    reasons = [m.fused for m in methods if isinstance(m.fused, str)]
    fusable = ", ".join(
        m.name for m in FINETUNE_METHODS.values() if m.fused is not None and not isinstance(m.fused, str)
    )
    why = reasons[0] if reasons else "no registered method fuses them"
    raise SettingsError(
        f"{peft_type.lower()} adapters cannot be trained fused: {why}. Run their jobs one at a time (hf-dtrain "
        f"finetune), or fuse one of {fusable}."
    )


def linear_shapes(model, targets) -> list[tuple[int, int]]:
    """``(out, in)`` of every linear (dense or 4-bit) whose name ends with one of ``targets``."""
    shapes = []
    for name, mod in model.named_modules():
        if name.split(".")[-1] in targets and hasattr(mod, "in_features") and hasattr(mod, "out_features"):
            shapes.append((mod.out_features, mod.in_features))
    return shapes


def lora_budget(rank: int, shapes) -> int:
    """Trainable parameters of LoRA at ``rank`` on linears of ``shapes``: what the other methods are matched to."""
    return sum(rank * (o + i) for o, i in shapes)


def _lora(adapter: AdapterSettings, settings, model, dora: bool = False):
    from peft import LoraConfig

    return LoraConfig(
        r=adapter.r,
        lora_alpha=adapter.alpha,
        lora_dropout=adapter.dropout,
        target_modules=adapter.targets(),
        use_dora=dora,
        task_type="CAUSAL_LM",
    )


def _check_lora(layer, names) -> None:
    from torch import nn

    for n in names:
        if layer.use_dora.get(n):
            raise SettingsError(f"adapter {n!r}: {DORA_NOT_FUSABLE}; use plain LoRA in a fused sweep.")
        if getattr(layer, "lora_bias", {}).get(n):
            raise SettingsError(f"adapter {n!r}: lora_bias=True is not supported fused; leave it False.")
        base = layer.get_base_layer()
        if not isinstance(base, nn.Linear) and not hasattr(base, "quant_state"):
            raise SettingsError(
                f"adapter {n!r}: LoRA on {type(base).__name__} cannot be fused; only linear (dense or 4-bit) "
                "targets fuse."
            )


def _lora_dropout(layer, name) -> float:
    module = layer.lora_dropout[name]
    return float(getattr(module, "p", 0.0))


DORA_NOT_FUSABLE = "DoRA rescales each weight column by its norm, so its base is not shared between jobs"

# peft's own methods and full fine-tuning (hf_dtrain's tuners register from their folders)
register_finetune_method(
    FinetuneMethod(
        "lora",
        4e-3,
        _lora,
        quantized_bases=("nf4", "hqq4"),
        peft_type="LORA",
        fused=LowRankForm(
            factors=lambda layer, name: (layer.lora_A[name].weight, layer.lora_B[name].weight),
            dropout=_lora_dropout,
            check=_check_lora,
        ),
        order=0,
    )
)
register_finetune_method(
    FinetuneMethod(
        "dora",
        4e-3,
        lambda adapter, settings, model: _lora(adapter, settings, model, dora=True),
        quantized_bases=("nf4",),
        peft_type="LORA",
        fused=DORA_NOT_FUSABLE,
        order=1,
    )
)
register_finetune_method(
    FinetuneMethod("full", 5e-4, lambda adapter, settings, model: None, fused=WHOLE_MODEL, order=2)
)


def _peft_config(name: str, method: str):
    """peft's config class ``name``, or a ``SettingsError`` naming the peft release that has it."""
    import peft

    cls = getattr(peft, name, None)
    if cls is None:
        raise SettingsError(
            f"--method {method} is peft's {name}, which peft {peft.__version__} does not have: pip install "
            "'peft>=0.21.2'."
        )
    return cls


def _shira(adapter: AdapterSettings, settings, model):
    """peft's SHiRA at LoRA's budget: its ``r`` gives each target ``r * (in + out)`` trainable entries, LoRA's count."""
    ShiraConfig = _peft_config("ShiraConfig", "shira")
    return ShiraConfig(r=adapter.r, target_modules=adapter.targets(), task_type="CAUSAL_LM")


def _supertuning(adapter: AdapterSettings, settings, model):
    """peft's Super-Tuning (magnitude-selected sparse entries) at LoRA's budget: one sparsity for every target, the
    share of their weights that LoRA at ``r`` trains (per layer it differs a little from LoRA's by shape)."""
    SupertuningConfig = _peft_config("SupertuningConfig", "supertuning")
    targets = adapter.targets()
    shapes = linear_shapes(model, targets)
    total = sum(o * i for o, i in shapes)
    if not total:
        raise SettingsError(f"supertuning: target_modules={targets} match no linear layer of the model.")
    sparsity = 1.0 - lora_budget(adapter.r, shapes) / total
    return SupertuningConfig(sparsity=sparsity, target_modules=targets, task_type="CAUSAL_LM")


register_finetune_method(
    FinetuneMethod(
        "shira",
        2e-3,
        _shira,
        peft_type="SHIRA",
        fused="SHiRA's sparse entries are peft's own layer, which the fused sweep does not stack",
        order=3,
    )
)
register_finetune_method(
    FinetuneMethod(
        "supertuning",
        2e-3,
        _supertuning,
        peft_type="SUPERTUNING",
        fused="Super-Tuning's sparse entries are peft's own layer, which the fused sweep does not stack",
        order=4,
    )
)
