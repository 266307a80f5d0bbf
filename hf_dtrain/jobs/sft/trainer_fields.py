"""The Trainer's settings the fine-tuning jobs take as top-level flags: every field of TRL's ``SFTConfig`` (so of
transformers' ``TrainingArguments``), made as ``trl sft`` makes them (transformers' ``HfArgumentParser``, field by
field: ``--learning-rate`` / ``--learning_rate``, ``--no-remove-unused-columns``, choices, JSON mappings).

``hf-dtrain finetune --help`` should not load TRL and transformers' training stack to list them, so the flags are
described once from the installed releases into ``trainer_fields.json`` (``python -m
hf_dtrain.jobs.sft.trainer_fields`` rewrites it; ``tests/test_cli.py`` checks it equals what the installed TRL gives).
When the installed TRL or transformers is not the release the snapshot was written from, the description is made
from TRL itself, as before. The values parsed are passed to ``SFTConfig``, which checks them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from importlib.metadata import version

SNAPSHOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer_fields.json")
# SFTConfig fields no flag can give: an object (set it from Python: FinetuneConfig(training={...}))
NOT_FLAGS = ("parallelism_config",)


def installed() -> dict:
    return {"trl": version("trl"), "transformers": version("transformers")}


@functools.cache
def trainer_fields() -> tuple[dict, ...]:
    """One description per flag: ``name`` (the field), ``flags``, ``kind`` (how a value is parsed), ``nargs``,
    ``const``, ``choices``, ``help``, ``metavar``."""
    if os.path.exists(SNAPSHOT):
        with open(SNAPSHOT) as f:
            snapshot = json.load(f)
        if snapshot.get("versions") == installed():
            return tuple(snapshot["fields"])
    return tuple(describe())


def trainer_field_names() -> frozenset:
    return frozenset(f["name"] for f in trainer_fields())


def describe() -> list[dict]:
    """The flags of ``SFTConfig``'s fields as ``HfArgumentParser`` makes them, described as plain data."""
    import copy
    import dataclasses
    import typing

    from transformers import HfArgumentParser
    from transformers.hf_argparser import string_to_bool
    from trl import SFTConfig

    hints = typing.get_type_hints(SFTConfig)
    out = []
    for f in dataclasses.fields(SFTConfig):
        if not f.init or f.name in NOT_FLAGS:
            continue
        parser = argparse.ArgumentParser(add_help=False)
        f = copy.copy(f)
        f.type = hints[f.name]
        HfArgumentParser._parse_dataclass_field(parser, f)
        for action in parser._actions:
            kinds = set(typing.get_args(hints[f.name]) or (hints[f.name],))
            if isinstance(action, argparse._StoreFalseAction):
                kind = "store_false"
            elif dict in kinds or any(typing.get_origin(k) is dict for k in kinds):
                kind = "json"  # a JSON object on the command line, as TRL's CLI takes it
            elif kinds >= {str, bool}:
                kind = "bool_or_str"  # include_num_input_tokens_seen: true / false / "all" / "non_padding"
            elif action.type is string_to_bool:
                kind = "bool"
            elif action.type in (int, float):
                kind = action.type.__name__
            else:
                kind = "str"  # strings, choices of enums and literals (SFTConfig converts them)
            out.append(
                {
                    "name": f.name,
                    "flags": list(action.option_strings),
                    "kind": kind,
                    "nargs": action.nargs,
                    "const": action.const,
                    "choices": None
                    if action.choices is None
                    else [str(getattr(c, "value", c)) for c in action.choices],
                    "help": action.help,
                    "metavar": action.metavar,
                }
            )
    return out


def write_snapshot(path: str = SNAPSHOT) -> None:
    with open(path, "w") as f:
        json.dump({"versions": installed(), "fields": describe()}, f, indent=1, default=str)
        f.write("\n")


def _json_mapping(text: str):
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"expected a JSON object such as '{{\"key\": 1}}', got {text!r} ({e})"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _bool(text: str) -> bool:
    t = str(text).strip().lower()
    if t in ("1", "true", "yes", "y", "on", "t"):
        return True
    if t in ("0", "false", "no", "n", "off", "f"):
        return False
    raise argparse.ArgumentTypeError(f"Truthy value expected: got {text} but expected one of yes/no, true/false.")


def _bool_or_str(text: str):
    return {"true": True, "false": False}.get(str(text).strip().lower(), text)


KINDS = {"str": str, "int": int, "float": float, "bool": _bool, "json": _json_mapping, "bool_or_str": _bool_or_str}


def add_trainer_arguments(parser: argparse.ArgumentParser, owned: set) -> None:
    """Every ``SFTConfig`` field not in ``owned`` (the job's own names: ``--fsdp``, ``--deepspeed`` are hf_dtrain's
    engines, which set the Trainer's) as a top-level flag. Only the flags given reach the config (their defaults are
    the job's, ``FinetuneJob.training_defaults``)."""
    group = parser.add_argument_group(
        "the Trainer (every field of trl.SFTConfig and transformers.TrainingArguments; the job's defaults differ "
        "where FinetuneJob.training_defaults says)"
    )
    for f in trainer_fields():
        if f["name"] in owned:
            continue
        help = f["help"] if f["help"] is None or "%%" in f["help"] else f["help"].replace("%", "%%")
        if f["kind"] == "store_false":
            group.add_argument(*f["flags"], dest=f["name"], action="store_false", default=argparse.SUPPRESS, help=help)
            continue
        nargs, const = f["nargs"], f["const"]
        if f["kind"] == "bool" and nargs is None:
            nargs, const = "?", True  # --bf16 alone means true, as for the other booleans
        group.add_argument(
            *f["flags"],
            dest=f["name"],
            type=KINDS[f["kind"]],
            nargs=nargs,
            const=const,
            choices=f["choices"],
            default=argparse.SUPPRESS,
            help=help,
            metavar=f["metavar"],
        )


if __name__ == "__main__":
    write_snapshot()
    print(f"wrote {SNAPSHOT} for {installed()}")
