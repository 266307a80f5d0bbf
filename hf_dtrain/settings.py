"""How hf_dtrain's typed configs become objects from plain data (YAML, JSON, CLI flags), with errors that name the
field and the fix.

Every feature has one dataclass next to its engine (``CommHookConfig`` in :mod:`hf_dtrain.comm`, ``DeltaConfig`` in
:mod:`hf_dtrain.memory`, ``SnapshotConfig`` in :mod:`hf_dtrain.fault`, ``EvaConfig`` / ``OneBitLambConfig`` in
:mod:`hf_dtrain.optim`, ``GossipConfig`` in :mod:`hf_dtrain.decentralized`): each field carries its help text in
``metadata["help"]`` and the class validates itself in ``__post_init__``. A job config (``FinetuneConfig``,
``PretrainConfig``) holds those dataclasses as *sections*. This module walks them:

* :func:`walk_fields` lists every leaf setting as a dotted path (``comm_hook.rank``): the CLI makes one flag per path
  (``--comm-hook.rank``) and a test checks that every engine field has one;
* :func:`build` turns nested plain data into the dataclass, refusing unknown keys with the list of valid ones.

A section may be optional (``Optional[DeltaConfig] = None``: the feature is off). It is switched on by giving any of
its fields, or by its short form: a scalar for the field named by the class's ``shorthand`` (``comm_hook: acp_sgd``
is ``comm_hook: {method: acp_sgd}``), ``true`` for the section with its defaults, ``false``/``null`` for off.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from collections.abc import Iterator
from typing import Any

from hf_dtrain.errors import SettingsError

# The release (``hf_dtrain.__version__``; pyproject.toml reads it from here): recorded in snapshots' run identity
# and in the README saved with an adapter.
RELEASE = "0.1.0"


def setting(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = dataclasses.MISSING, **bounds):
    """A config field with its help text (the flag's help, the YAML key's doc) and the bounds :func:`check_fields`
    enforces (``min`` / ``max`` inclusive, ``gt`` / ``lt`` exclusive, ``why`` said with a bound's error; other keys
    are kept in the metadata: ``choices``, ``hidden``, ``flatten``): ``lr: float = setting(1e-3, "Peak learning
    rate.", gt=0)``; ``factory`` for a mutable default."""
    metadata = {"help": help, **bounds}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def config_from(cls: type, arguments: dict, **overrides):
    """The ``cls`` config whose fields take their values from ``arguments`` (a constructor's ``locals()``, so that an
    object built from keywords validates them as its config does) and ``overrides``."""
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    return cls(**{**{n: arguments[n] for n in names if n in arguments}, **overrides})


def is_config(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``(inner type, optional)`` of an annotation such as ``Optional[X]`` / ``X | None``."""
    args = typing.get_args(tp)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True  # noqa: UP007 (a union built at run time)
    return tp, False


def section_type(cls: type, name: str) -> tuple[type, bool] | None:
    """``(config class, optional)`` when field ``name`` of ``cls`` is a nested config section, else None."""
    inner, optional = unwrap_optional(typing.get_type_hints(cls)[name])
    return (inner, optional) if is_config(inner) else None


def sections(cls: type) -> list[tuple[str, type, bool]]:
    """``(field name, config class, optional)`` of every section of ``cls``."""
    out = []
    for f in dataclasses.fields(cls):
        sec = section_type(cls, f.name)
        if sec is not None:
            out.append((f.name, *sec))
    return out


def walk_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any, type]]:
    """``(dotted path, field, annotation, owning class)`` of every leaf setting of ``cls``, sections expanded."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        sec = section_type(cls, f.name)
        if sec is not None:
            yield from walk_fields(sec[0], prefix + f.name + ".")
        else:
            yield prefix + f.name, f, hints[f.name], cls


def section_value(cls: type, value: Any, where: str) -> dict | None:
    """A section's plain value in its dict form (None: off): a mapping, ``true`` (defaults), ``false``/``None`` (off),
    or a scalar for the class's ``shorthand`` field."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, dict):
        return dict(value)
    short = getattr(cls, "shorthand", None)
    if short is None:
        raise SettingsError(f"{where}: expected a mapping of {cls.__name__} fields or true/false, got {value!r}.")
    return {short: value}


def merge(base: dict, over: dict, cls: type) -> dict:
    """``over`` on top of ``base`` (plain data for ``cls``): sections merge field by field, leaves are replaced."""
    out = dict(base)
    for key, value in over.items():
        sec = section_type(cls, key) if key in {f.name for f in dataclasses.fields(cls)} else None
        if sec is not None and key in out:
            old = section_value(sec[0], out[key], key)
            new = section_value(sec[0], value, key)
            out[key] = None if new is None else merge(old or {}, new, sec[0])
        else:
            out[key] = value
    return out


def build(cls: type, data: dict | None, where: str | None = None):
    """``cls(**data)`` with nested sections built from their plain values; unknown keys are a ``ValueError`` that
    lists the valid ones."""
    where = where or cls.__name__
    data = {str(k).replace("-", "_"): v for k, v in (data or {}).items()}
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise SettingsError(f"{where}: unknown key(s) {unknown}; valid keys are {', '.join(sorted(fields))}.")
    kwargs = {}
    for name, value in data.items():
        sec = section_type(cls, name)
        if sec is not None:
            inner, optional = sec
            plain = section_value(inner, value, f"{where}.{name}")
            if plain is None and not optional:
                raise SettingsError(
                    f"{where}.{name} cannot be switched off; give a mapping of {inner.__name__} fields."
                )
            kwargs[name] = None if plain is None else build(inner, plain, f"{where}.{name}")
            if plain:  # which fields the user set, even to their defaults (a setting of a dimension that is off)
                kwargs[name].given_keys = frozenset(plain)
        else:
            kwargs[name] = value
    return cls(**kwargs)


def coerce_section(owner: Any, name: str) -> None:
    """In an owner's ``__post_init__``: turn a section given as plain data (``"acp_sgd"``, ``0.5``, ``True``, a dict)
    into its config object, so Python callers may write ``ComposeOptions(comm_hook="acp_sgd")``."""
    cls, optional = section_type(type(owner), name)
    value = getattr(owner, name)
    if isinstance(value, cls):
        return
    plain = section_value(cls, value, f"{type(owner).__name__}.{name}")
    if plain is None and not optional:
        plain = {}
    setattr(owner, name, None if plain is None else build(cls, plain, f"{type(owner).__name__}.{name}"))


def check_choice(config: Any, name: str, choices, key: str | None = None) -> None:
    """``ValueError`` unless ``config.name`` is one of ``choices``, naming the field, the key to set and the choices.
    ``key``: how the user sets it (default ``<section>.<name>`` is left to the caller; plain ``name`` otherwise)."""
    value = getattr(config, name)
    if value not in choices:
        raise SettingsError(
            f"{type(config).__name__}.{name}={value!r} is unknown; set {key or name} to one of "
            f"{', '.join(map(str, choices))}."
        )


def help_of(f: dataclasses.Field) -> str:
    return f.metadata.get("help", "")


_HINTS: dict = {}


def _hints(cls: type) -> dict:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def key_of(config: Any, name: str) -> str:
    """How a user sets ``config.name``: ``--section.field`` / YAML ``section: {field: ...}`` for an engine config that
    declares ``section_key``, ``--field`` for a job field."""
    section = getattr(type(config), "section_key", None)
    path = f"{section}.{name}" if section else name
    return f"{path} (--{path.replace('_', '-')})"


def _number(value: Any, kind: type) -> Any:
    """``value`` as ``kind`` (int or float): YAML 1.1 reads ``1e-3`` as a string, so numeric strings are accepted;
    booleans and non-integral floats for an int are not."""
    if isinstance(value, bool):
        raise TypeError
    if isinstance(value, str):
        value = float(value.strip()) if kind is float else int(value.strip())
    if kind is int:
        if isinstance(value, float):
            if not value.is_integer():
                raise TypeError
            value = int(value)
        if not isinstance(value, int):
            raise TypeError
        return value
    if not isinstance(value, (int, float)):
        raise TypeError
    return float(value)


def check_fields(config: Any) -> None:
    """Every plain field of ``config`` (sections skipped: they check themselves) against its annotation and bounds:
    bool fields take only true/false (no truthy strings), int fields whole numbers, float fields finite numbers, str
    fields strings, ``list[X]`` a list of X; ``None`` only where the annotation is ``Optional``. Bounds come from the
    field's metadata: ``min`` / ``max`` (inclusive), ``gt`` / ``lt`` (exclusive), and ``why`` (said with a bound's
    error). Numeric strings are converted in place.
    Raises ``ValueError`` naming the field, the flag / YAML key and what it takes."""
    cls = type(config)
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp, optional = unwrap_optional(hints[f.name]) if f.init else (None, False)
        if not f.init or is_config(tp):
            continue
        value = getattr(config, f.name)
        where = f"{cls.__name__}.{f.name}"
        fix = f"set {key_of(config, f.name)}"
        if value is None:
            if optional:
                continue
            raise SettingsError(f"{where} cannot be None; {fix}.")
        origin = typing.get_origin(tp)
        if origin in (list, tuple):
            inner = [a for a in typing.get_args(tp) if a is not Ellipsis]
            inner = inner[0] if inner else Any
            if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
                raise SettingsError(f"{where} must be a list, got {value!r}; {fix}.")
            if inner in (int, float):
                try:
                    value = [_number(v, inner) for v in value]
                except (TypeError, ValueError):
                    raise SettingsError(
                        f"{where} must be a list of {inner.__name__} values, got {value!r}; {fix}."
                    ) from None
                bad = [v for v in value if isinstance(v, float) and not math.isfinite(v)]
                if bad:
                    raise SettingsError(f"{where} must hold finite numbers, got {value!r}; {fix}.")
            elif inner is str and not all(isinstance(v, str) for v in value):
                raise SettingsError(f"{where} must be a list of strings, got {value!r}; {fix}.")
            object.__setattr__(config, f.name, list(value))
            continue
        if tp is bool:
            if not isinstance(value, bool):
                raise SettingsError(f"{where} must be true or false, got {value!r}; {fix}.")
            continue
        if tp in (int, float):
            try:
                value = _number(value, tp)
            except (TypeError, ValueError):
                kind = "a whole number" if tp is int else "a number"
                raise SettingsError(f"{where} must be {kind}, got {value!r}; {fix}.") from None
            if isinstance(value, float) and not math.isfinite(value):
                raise SettingsError(f"{where} must be a finite number, got {value!r}; {fix}.")
            why = f" ({f.metadata['why']})" if "why" in f.metadata else ""
            for key, ok, text in (
                ("min", lambda v, b: v >= b, ">="),
                ("max", lambda v, b: v <= b, "<="),
                ("gt", lambda v, b: v > b, ">"),
                ("lt", lambda v, b: v < b, "<"),
            ):
                limit = f.metadata.get(key)
                if limit is not None and not ok(value, limit):
                    kind = "an integer" if tp is int else "a number"
                    raise SettingsError(f"{where} must be {kind} {text} {limit}{why}, got {value!r}; {fix}.")
            object.__setattr__(config, f.name, value)
            continue
        if tp is str and not isinstance(value, str):
            raise SettingsError(f"{where} must be a string, got {value!r}; {fix}.")


def check_number(
    config: Any, name: str, gt: float | None = None, low: float | None = None, key: str | None = None
) -> None:
    """``ValueError`` unless ``config.name`` is a finite number (not a bool) > ``gt`` / >= ``low``, naming the field:
    for configs that are not ours field by field (peft's ``PeftConfig`` subclasses)."""
    value = getattr(config, name)
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (gt is None or value > gt) and (low is None or value >= low)
    if not ok:
        bound = f" > {gt}" if gt is not None else (f" >= {low}" if low is not None else "")
        raise SettingsError(
            f"{type(config).__name__}.{name} must be a finite number{bound}, got {value!r}; set {key or name}."
        )


def check_local_path(config, name: str, kinds: tuple = (".json", ".jsonl", ".txt", ".csv", ".parquet")) -> None:
    """``config.name`` names a local file or directory (a path separator, ``./``, or a data-file extension) that
    does not exist: a ``SettingsError`` naming the field and the path, before anything starts (otherwise it would be
    taken for a hub id and fetched)."""
    value = getattr(config, name)
    if value is None:
        return
    # a hub id is "name" or "org/name"; anything else path-like is a local path
    looks_local = value.startswith(("/", "./", "../", "~")) or value.count("/") > 1 or value.lower().endswith(kinds)
    if looks_local and not os.path.exists(os.path.expanduser(value)):
        raise SettingsError(
            f"{type(config).__name__}.{name}: {value} does not exist; set --{name.replace('_', '-')} to an existing "
            "local path or a hub id."
        )


def parse_bytes(text) -> float:
    """``80GB`` / ``80GiB`` / ``512MB`` / a number of bytes -> bytes (binary units)."""
    if isinstance(text, (int, float)):
        return float(text)
    t = str(text).strip().upper().replace("IB", "B")
    for unit, factor in (("TB", 1024**4), ("GB", 1024**3), ("MB", 1024**2), ("KB", 1024), ("B", 1)):
        if t.endswith(unit):
            try:
                return float(t[: -len(unit)]) * factor
            except ValueError:
                break
    try:
        return float(t)
    except ValueError:
        raise SettingsError(f"{text!r} is not a size: give e.g. 80GB, 512MB or a number of bytes.") from None
