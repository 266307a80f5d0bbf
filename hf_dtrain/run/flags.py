"""Flags and recipes from the typed configs: one flag per setting of a job config, sections expanded
(``--delta.budget``), generated from the dataclasses (a field added to an engine's config is a flag with no other
edit); a recipe YAML with the same keys; the flags given on the command line over the recipe, field by field. Used by
the console script (:mod:`hf_dtrain.cli`) and the jobs that add flags of their own (sweep, fed)."""

from __future__ import annotations

import argparse
import dataclasses
import typing

import yaml

from hf_dtrain.settings import SettingsError, help_of, merge, section_type, unwrap_optional, walk_fields

from .section import sections_for


def _bool(text: str) -> bool:
    t = str(text).strip().lower()
    if t in ("1", "true", "yes", "y", "on"):
        return True
    if t in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _none_or(conv):
    def parse(text):
        return None if str(text).lower() in ("none", "null", "") else conv(text)

    parse.__name__ = conv.__name__
    return parse


def converter(annotation) -> tuple:
    """(argparse type, nargs) for a field's annotation."""
    base, optional = unwrap_optional(annotation)
    origin = typing.get_origin(base)
    if origin in (list, tuple):
        args = [a for a in typing.get_args(base) if a is not Ellipsis] or [str]
        inner = {float: float, int: int}.get(args[0], str)
        return inner, (len(args) if origin is tuple and Ellipsis not in typing.get_args(base) else "+")
    conv = {bool: _bool, int: int, float: float, str: str}.get(base, str)
    return (_none_or(conv) if optional else conv), None


def flag_of(path: str) -> str:
    """``comm_hook.start_iter`` -> ``--comm-hook.start-iter``."""
    return "--" + path.replace("_", "-")


def add_job_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """One flag per setting of ``cls``, sections expanded (``--delta.budget``), generated from the dataclasses: a
    field added to an engine's config is a flag with no other edit. Optional sections also get their short form
    (``--comm-hook acp_sgd``, ``--delta 0.5``, ``--fault-tolerance true``). A job holding the Trainer's settings
    (``FinetuneConfig.training``) gets every ``SFTConfig`` field as a flag too."""
    parser.add_argument(
        "--recipe",
        metavar="FILE.yaml",
        help="YAML file whose keys are the job's fields (sections as nested mappings); flags given "
        "explicitly override it.",
    )
    for f in dataclasses.fields(cls):
        sec = section_type(cls, f.name)
        if sec is not None and sec[1]:  # an optional section's short form
            inner = sec[0]
            short = getattr(inner, "shorthand", None)
            extra = {}
            if short is None:  # an on/off section: the bare flag (--fsdp) turns it on
                conv, meta, extra = _bool, "{true,false}", {"nargs": "?", "const": True}
            else:
                conv, _ = converter(typing.get_type_hints(inner)[short])
                conv, meta = _none_or(conv), None
            what = f"the {short} of the section" if short else "true (or the bare flag): on with the section's defaults"
            parser.add_argument(
                flag_of(f.name),
                dest=f.name,
                type=conv,
                default=argparse.SUPPRESS,
                metavar=meta,
                help=f"{help_of(f)} Short form: {what}; any {flag_of(f.name)}.* flag turns it on too.",
                **extra,
            )
    groups: dict = {}
    for path, f, annotation, owner in walk_fields(cls):
        if f.metadata.get("flatten"):
            continue
        conv, nargs = converter(annotation)
        kwargs = dict(
            dest=path, type=conv, default=argparse.SUPPRESS, help=help_of(f), metavar=path.rsplit(".", 1)[-1].upper()
        )
        section = path.split(".")[0] if "." in path else None
        if section not in groups:
            groups[section] = (
                parser
                if section is None
                else parser.add_argument_group(f"{section} ({owner.__name__}, {owner.__module__.rsplit('.', 1)[0]})")
            )
        if nargs:
            kwargs["nargs"] = nargs
        choices = f.metadata.get("choices")
        if choices is not None:
            kwargs["choices"] = choices() if callable(choices) else choices
        if conv is _bool:
            kwargs["metavar"] = "{true,false}"
            if not nargs:  # the bare flag means true
                kwargs.update(nargs="?", const=True)
        if f.metadata.get("hidden"):
            kwargs["help"] = argparse.SUPPRESS
        groups[section].add_argument(flag_of(path), **kwargs)
    for section in sections_for(getattr(cls, "job", "")):  # a section's short forms (--tp for --parallel.tp)
        for flag, dest, kwargs in section.short_flags():
            group = groups.get(dest.split(".")[0], parser)
            group.add_argument(flag, dest=dest, default=argparse.SUPPRESS, **kwargs)
    own = {f.name for f in dataclasses.fields(cls)}
    for f in dataclasses.fields(cls):
        if f.metadata.get("flatten"):  # a mapping whose keys are flags of their own (the Trainer's settings)
            f.metadata["flatten"](parser, own)


def load_recipe(path: str) -> dict:
    """A recipe YAML's mapping (checked against the job's fields when the config is built)."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise SettingsError(
            f"recipe {path} cannot be read ({e.strerror or e}); give --recipe an existing YAML file."
        ) from None
    except yaml.YAMLError as e:
        raise SettingsError(f"recipe {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise SettingsError(f"recipe {path}: expected a mapping of job fields, got {type(data).__name__}.")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def args_to_data(ns: argparse.Namespace, cls) -> dict:
    """The flags given explicitly, as nested plain data (``--comm-hook.rank 8`` -> ``{"comm_hook": {"rank": 8}}``)."""
    data: dict = {}
    given = {k: v for k, v in vars(ns).items() if k not in ("command", "recipe")}
    for key, value in sorted(given.items(), key=lambda kv: kv[0].count(".")):  # short forms before fields
        section, _, name = key.partition(".")
        data = merge(data, {section: {name: value}} if name else {key: value}, cls)
    return data


def job_config_from_args(ns: argparse.Namespace, cls):
    """Recipe values first, then the flags given explicitly on the command line (flags win, field by field)."""
    recipe = load_recipe(ns.recipe) if getattr(ns, "recipe", None) else {}
    where = f"recipe {ns.recipe}" if getattr(ns, "recipe", None) else cls.__name__
    return cls.from_dict(merge(recipe, args_to_data(ns, cls), cls), where=where)


def list_of(conv):
    """An argparse type: a comma-separated list of ``conv`` values."""

    def parse(text):
        items = [t for t in str(text).split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return [conv(t.strip()) for t in items]

    parse.__name__ = f"list of {conv.__name__}"
    return parse


def add_config_arguments(parser: argparse.ArgumentParser, cls, prefix: str, title: str, short: dict | None = None):
    """``--<prefix>.<field>`` flags for every field of a plain config ``cls`` (dest ``<prefix>.<field>``), and
    ``short`` forms (flag -> field)."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        conv, _ = converter(hints[f.name])
        group.add_argument(
            flag_of(f"{prefix}.{f.name}"),
            dest=f"{prefix}.{f.name}",
            type=conv,
            default=argparse.SUPPRESS,
            help=help_of(f),
        )
    for flag, name in (short or {}).items():
        conv, _ = converter(hints[name])
        group.add_argument(
            f"--{flag}",
            dest=f"{prefix}.{name}",
            type=conv,
            default=argparse.SUPPRESS,
            help=f"Short for {flag_of(prefix + '.' + name)}.",
        )
