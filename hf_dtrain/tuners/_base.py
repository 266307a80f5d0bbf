"""What every hf_dtrain tuner of ``nn.Linear`` layers shares: the model-side module swap and the layer-side
merge/unmerge bookkeeping, so a method only says how its delta is applied to the weight."""

from __future__ import annotations

import warnings

import torch
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer, check_adapters_to_merge

from hf_dtrain.errors import SettingsError, UnsupportedTarget

from ..fast import paths as fast_paths
from ..quantization import prepare_bnb_4bit_for_training, quantized_base_types
from . import register_with_peft


class LinearTunerModel(BaseTuner):
    """``BaseTuner`` for methods that wrap ``nn.Linear`` targets in ``linear_cls(target, adapter_name, config,
    layer_key=...)``; ``method_name`` and ``config_name`` only shape error messages."""

    linear_cls: type
    method_name: str
    config_name: str
    # True: also wrap the 4-bit layers of hf_dtrain.quantization.quantized_base_types() (Int4Linear, HQQLinear);
    # bitsandbytes' Linear4bit is an nn.Linear subclass and always accepted
    quantized_bases: bool = False

    def _pre_injection_hook(self, model, config, adapter_name) -> None:
        # bitsandbytes 4-bit layers anywhere in the model (adapted or not) must stay differentiable on CPU
        prepare_bnb_4bit_for_training(model)

    def _replace_module(self, parent, child_name, new_module, child) -> None:
        if not hasattr(new_module, "base_layer") and not hasattr(new_module, "weight"):
            # unloading back to a base without a ``weight`` attribute (HQQLinear): peft would copy ``weight`` over;
            # the base is the module itself, already on its device
            setattr(parent, child_name, new_module)
            return
        super()._replace_module(parent, child_name, new_module, child)

    def _create_and_replace(self, config, adapter_name, target, target_name, parent, current_key, **kwargs):
        if current_key is None:
            raise SettingsError("current_key must not be None")
        if isinstance(target, self.linear_cls):
            target.update_layer(adapter_name, config, layer_key=current_key)
            if getattr(config, "init_weights", True) is False:
                random_start(target, adapter_name)
            return
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        accepted = (torch.nn.Linear, *quantized_base_types()) if self.quantized_bases else (torch.nn.Linear,)
        if not isinstance(base, accepted):
            raise UnsupportedTarget(
                f"{self.method_name} can adapt nn.Linear layers only; {current_key!r} is {type(base).__name__}. "
                f"Narrow {self.config_name}.target_modules to linear projections."
            )
        new_module = self.linear_cls(target, adapter_name, config, layer_key=current_key)
        if getattr(config, "init_weights", True) is False:
            random_start(new_module, adapter_name)
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)
        self._replace_module(parent, target_name, new_module, target)


def random_start(layer, adapter_name: str, std: float = 0.02) -> None:
    """``init_weights=False``: the adapter's zero-initialized trainable tensors (what makes its start the identity)
    drawn from N(0, std) instead, so the adapter changes the output from the start (peft's convention)."""
    with torch.no_grad():
        for name in layer.adapter_layer_names:
            container = getattr(layer, name)
            if adapter_name in container:
                p = container[adapter_name]
                if p.numel() and not p.any():
                    p.normal_(0.0, std)


class MergeableLinearMixin:
    """merge/unmerge for a tuner layer that names its trainable container in ``adapter_layer_names[0]``.

    ``forward`` is the base output plus ``_adapter_output(x, adapter)`` of every active adapter (the only part a layer
    writes). ``_apply_delta(weight, adapter, sign)`` adds ``sign`` times the adapter's update to ``weight`` (in place);
    the default adds the dense ``get_delta_weight(adapter)``, layers with a sparse update (SMT) override it, and layers
    with a quantized base override ``_merge_one``."""

    def _has_adapter(self, adapter: str) -> bool:
        return adapter in getattr(self, self.adapter_layer_names[0])

    def _apply_delta(self, weight: torch.Tensor, adapter: str, sign: float) -> torch.Tensor:
        return weight.add_(self.get_delta_weight(adapter).to(weight.dtype), alpha=sign)

    def _merge_one(self, adapter: str, sign: float, safe_merge: bool = False) -> None:
        """Add ``sign`` times the adapter's update to the base weight; layers with a quantized base override this."""
        base = self.get_base_layer()
        dense = (
            isinstance(base, torch.nn.Linear)
            and base.weight.is_floating_point()
            and tuple(base.weight.shape) == (base.out_features, base.in_features)
        )
        if not dense:
            raise SettingsError(
                f"{type(self).__module__.split('.')[-2]} adapters merge into dense floating-point nn.Linear weights; "
                f"this base is {type(base).__name__} (quantized), where a merge would have to re-quantize and round. "
                "Load the base in fp16/bf16/fp32 to merge, or use QA-HiRA on an HQQ or Int4Linear base for an exact "
                "merge into 4 bits."
            )
        weight = base.weight.data.clone() if safe_merge else base.weight.data
        merged = self._apply_delta(weight, adapter, sign)
        if safe_merge and not torch.isfinite(merged).all():
            raise SettingsError(f"NaNs detected in the merged weights; adapter {adapter!r} seems to be broken.")
        base.weight.data = merged

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        for name in check_adapters_to_merge(self, adapter_names):
            if self._has_adapter(name):
                self._merge_one(name, 1.0, safe_merge)
                self.merged_adapters.append(name)

    def unmerge(self) -> None:
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
            return
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            if self._has_adapter(name):
                self._merge_one(name, -1.0)

    def _adapter_output(self, x: torch.Tensor, adapter: str) -> torch.Tensor | None:
        """What ``adapter`` adds to the base layer's output for input ``x`` (None: nothing)."""
        raise NotImplementedError

    def _lean_factors(self, adapter: str):
        """``(a, b, scale, dropout)`` when the adapter's output is ``scale * (dropout(x) a^T) b^T`` (a low-rank
        product :mod:`hf_dtrain.fast.lowrank` runs), or ``(a, b, scale, dropout, repeat)`` with ``a``'s columns and
        ``b``'s rows each standing for ``repeat`` consecutive ones; else None (the layer has no lean path)."""
        return None

    def _lean_forward(self, x: torch.Tensor, args, kwargs) -> torch.Tensor | None:
        """The lean path's output, or None where the plain path must run (the reason recorded for
        :func:`hf_dtrain.fast.report`)."""
        names = self.active_adapters
        if len(names) != 1 or not self._has_adapter(names[0]):
            fast_paths.record(self, "several or no active adapters")
            return None
        return self._lean_call(x, args, kwargs, names[0])

    def _lean_call(self, x: torch.Tensor, args, kwargs, adapter: str) -> torch.Tensor | None:
        """The lean output for the one active ``adapter``: a low-rank product from :meth:`_lean_factors` by default;
        a layer with another form of update (QA-HiRA's pooled one) overrides this."""
        factors = self._lean_factors(adapter)
        if factors is None:
            fast_paths.record(self, "no lean path")
            return None
        a, b, scale, dropout, *repeat = factors
        repeat = repeat[0] if repeat else 1
        return fast_paths.lowrank_forward(self, x, args, kwargs, a, b, scale, dropout=dropout, repeat=repeat)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        lean = self._lean_forward(x, args, kwargs)
        return lean if lean is not None else self._plain_forward(x, *args, **kwargs)

    def _plain_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """The base layer's output plus each active adapter's ``_adapter_output``."""
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        result = self.base_layer(x, *args, **kwargs)
        if self.merged:
            return result
        for name in self.active_adapters:
            if self._has_adapter(name):
                delta = self._adapter_output(x, name)
                if delta is not None:
                    result = result + delta.to(result.dtype)
        return result


register_with_peft(caller=__name__)  # peft may have been imported by this module: the folders load now
