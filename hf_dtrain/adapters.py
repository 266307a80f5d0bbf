"""A saved peft adapter (hf_dtrain's tuners or peft's own) checked against the base model it is loaded onto.

peft loads an adapter's weights with ``strict=False``: weights for modules the base does not have (an adapter saved
on a 32-layer base, loaded onto a 16-layer one) are dropped without a word, and a shape mismatch is a ``RuntimeError``
that names no file. :func:`check_adapter_fits` reads the adapter's tensor names and shapes (not its data) and
refuses, naming what differs; :func:`load_adapter` is ``PeftModel.from_pretrained`` behind that check.
"""

from __future__ import annotations

import json
import os
import re

import torch
from peft import PeftConfig, PeftModel
from peft.mapping import PEFT_TYPE_TO_PREFIX_MAPPING
from safetensors import safe_open

from hf_dtrain.errors import AdapterMismatch, ModelLoadError
from hf_dtrain.models import check_weight_files

WEIGHTS = "adapter_model.safetensors"
_PEFT_ROOT = "base_model.model."


def _adapter_shapes(path: str) -> dict[str, tuple]:
    file = os.path.join(path, WEIGHTS)
    if not os.path.isfile(file):
        raise ModelLoadError(
            f"adapter {path} holds no {WEIGHTS}; save it with save_pretrained (safetensors), or point to the "
            "directory that has it."
        )
    with safe_open(file, framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)


def _layer_count(names) -> int | None:
    found = [int(m.group(1)) for n in names if (m := re.search(r"\blayers\.(\d+)\.", n))]
    return max(found) + 1 if found else None


def adapter_mismatches(model: torch.nn.Module, path: str) -> list[str]:
    """What in the adapter at ``path`` does not fit ``model`` (an empty list when it fits): weights for modules the
    base lacks, and full-module weights (``modules_to_save``) of another shape. The tuner's own tensors' shapes are
    checked by the load itself (:func:`load_adapter`)."""
    config = PeftConfig.from_pretrained(path)
    prefix = PEFT_TYPE_TO_PREFIX_MAPPING.get(config.peft_type, "")
    shapes = _adapter_shapes(path)
    modules = dict(model.named_modules())
    problems, missing = [], []
    for key, shape in shapes.items():
        name = key[len(_PEFT_ROOT) :] if key.startswith(_PEFT_ROOT) else key
        parts = name.split(".")
        cut = next((i for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules), 0)
        owner, rest = ".".join(parts[:cut]), parts[cut:]
        module = modules.get(owner, model)
        if rest and prefix and rest[0].startswith(prefix):
            continue  # the tuner's own tensor on a module the base has
        tensors = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
        if len(rest) == 1 and rest[0] in tensors:
            if tuple(tensors[rest[0]].shape) != shape:
                problems.append(f"{name} is {list(shape)} in the adapter, {list(tensors[rest[0]].shape)} in the base")
            continue
        missing.append(name)
    if missing:
        base_layers = _layer_count(modules)
        saved_layers = _layer_count(missing + list(shapes))
        if base_layers is not None and saved_layers is not None and saved_layers > base_layers:
            problems.insert(
                0,
                f"it adapts {saved_layers} decoder layers, the base has {base_layers} (the adapter was saved on "
                "another base model)",
            )
        problems.append(
            f"{len(missing)} weight(s) adapt modules the base does not have, e.g. {missing[0]}"
            + (f" and {missing[-1]}" if len(missing) > 1 else "")
        )
    return problems


def _base_of(path: str) -> str | None:
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            return json.load(f).get("base_model_name_or_path")
    except (OSError, ValueError):
        return None


SHAPE_FIELDS = (
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)


def _config_differences(model: torch.nn.Module, path: str) -> list[str]:
    """The shape-defining config fields of the base the adapter records (a local directory) against ``model``'s,
    and the architecture class peft recorded."""
    out = []
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            recorded = (json.load(f).get("auto_mapping") or {}).get("base_model_class")
    except (OSError, ValueError):
        recorded = None
    if recorded and recorded != type(model).__name__:
        out.append(f"it was saved on a {recorded}, this base is a {type(model).__name__}")
    base, config = _base_of(path), getattr(model, "config", None)
    if base and config is not None and os.path.isfile(os.path.join(base, "config.json")):
        try:
            with open(os.path.join(base, "config.json")) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            return out
        for field in SHAPE_FIELDS:
            if field in saved and getattr(config, field, saved[field]) != saved[field]:
                out.append(f"{field} is {saved[field]} in {base}, {getattr(config, field)} in this base")
    return out


def check_adapter_fits(model: torch.nn.Module, path: str) -> None:
    """An :class:`~hf_dtrain.errors.AdapterMismatch` naming the adapter, its recorded base model and what differs,
    unless the adapter at ``path`` fits ``model``."""
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise ModelLoadError(f"adapter {path} holds no adapter_config.json; save the adapter with save_pretrained.")
    check_weight_files(path)
    problems = _config_differences(model, path) + adapter_mismatches(model, path)
    if problems:
        base = _base_of(path)
        raise AdapterMismatch(
            f"adapter {path} does not fit this base model"
            + (f" (it was saved on {base})" if base else "")
            + ": "
            + "; ".join(problems)
            + ". Load it onto the base it was trained on; peft would silently drop what does not fit."
        )


def load_adapter(model: torch.nn.Module | str, path: str, **kwargs) -> PeftModel:
    """``PeftModel.from_pretrained(model, path, **kwargs)`` after :func:`check_adapter_fits`; a shape the tuner's own
    tensors disagree on is an ``AdapterMismatch`` naming the file, instead of a ``RuntimeError`` naming none.
    ``model`` may be the base itself or where to read it: a folder, a hub id or a GGUF file
    (:func:`hf_dtrain.models.load_model_and_tokenizer`)."""
    if isinstance(model, (str, os.PathLike)):
        from hf_dtrain.models import load_model_and_tokenizer

        model = load_model_and_tokenizer(os.fspath(model), progress=False)[0]
    check_adapter_fits(model, path)
    try:
        return PeftModel.from_pretrained(model, path, **kwargs)
    except RuntimeError as e:
        if "size mismatch" not in str(e):
            raise
        first = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e))
        raise AdapterMismatch(
            f"adapter {path} does not fit this base model: {first} Load it onto the base it was trained on."
        ) from e
