"""``hf-dtrain`` console script (also ``python -m hf_dtrain.cli``).

Subcommands:
  finetune     fine-tune a base model with lora / dora / lorafa / smt / full (see :mod:`hf_dtrain.finetune`)
  build-base   build (and cache) the embedded default base model
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

from hf_dtrain.finetune import METHODS, FinetuneConfig


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


def _field_type(f: dataclasses.Field):
    """(argparse type, nargs) for a FinetuneConfig field from its annotation."""
    hints = typing.get_type_hints(FinetuneConfig)
    tp = hints[f.name]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    optional = type(None) in typing.get_args(tp)
    base = args[0] if args else tp
    if typing.get_origin(base) is list:
        return str, "+"
    conv = {bool: _bool, int: int, float: float, str: str}.get(base, str)
    return (_none_or(conv) if optional else conv), None


def add_finetune_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", metavar="FILE.yaml",
                        help="YAML file whose keys are finetune fields; flags given explicitly override it.")
    for f in dataclasses.fields(FinetuneConfig):
        conv, nargs = _field_type(f)
        flag = "--" + f.name.replace("_", "-")
        kwargs = dict(dest=f.name, type=conv, default=argparse.SUPPRESS, help=f.metadata.get("help", ""))
        if nargs:
            kwargs["nargs"] = nargs
        if f.name == "method":
            kwargs["choices"] = METHODS
        if conv is _bool:
            kwargs["metavar"] = "{true,false}"
        parser.add_argument(flag, **kwargs)


def load_recipe(path: str) -> dict:
    """Read a recipe YAML; raise ``ValueError`` naming any key that is not a FinetuneConfig field."""
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"recipe {path}: expected a mapping of finetune fields, got {type(data).__name__}.")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    known = set(FinetuneConfig.field_names())
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"recipe {path}: unknown key(s) {unknown}; valid keys are the finetune fields: "
                         f"{', '.join(sorted(known))}.")
    return data


def finetune_config_from_args(ns: argparse.Namespace) -> FinetuneConfig:
    """Recipe values first, then the flags given explicitly on the command line (flags win)."""
    values = load_recipe(ns.recipe) if getattr(ns, "recipe", None) else {}
    values.update({k: v for k, v in vars(ns).items() if k in FinetuneConfig.field_names()})
    return FinetuneConfig(**values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-dtrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    ft = sub.add_parser("finetune", help="fine-tune a base model and report eval loss / accuracy before and after")
    add_finetune_arguments(ft)
    bb = sub.add_parser("build-base", help="build and cache the embedded default base model")
    bb.add_argument("--preset", default="tiny", help="LlamaConfig preset (hf_dtrain.models.PRESETS)")
    bb.add_argument("--steps", type=int, default=None, help="pretraining steps (default per preset)")
    bb.add_argument("--seed", type=int, default=0)
    bb.add_argument("--cache-dir", default=None, help="cache root (default $HF_DTRAIN_CACHE or ~/.cache/hf_dtrain)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command == "build-base":
        from hf_dtrain.models import build_default_model

        print(build_default_model(ns.preset, cache_dir=ns.cache_dir, steps=ns.steps, seed=ns.seed))
        return 0
    if ns.command == "finetune":
        try:
            cfg = finetune_config_from_args(ns)
        except (ValueError, TypeError, OSError) as e:
            raise SystemExit(f"hf-dtrain finetune: {e}") from None
        from hf_dtrain.finetune import run_finetune

        run_finetune(cfg)
        return 0
    parser.error(f"unknown command {ns.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
