"""``hf-dtrain`` console script (also ``python -m hf_dtrain.cli``).

Subcommands:
  finetune     fine-tune a base model with lora / dora / lorafa / smt / full (see :mod:`hf_dtrain.finetune`)
  pretrain     pretrain a LLaMA from a LlamaConfig preset (see :mod:`hf_dtrain.pretrain`)
  build-base   build (and cache) the embedded default base model

Both jobs take the switches of :class:`hf_dtrain.compose.ComposeOptions` (a communication hook or a 1-bit /
decentralized optimizer, Eva, DELTA, in-memory fault tolerance, the heterogeneity-aware sampler).
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


def _field_type(f: dataclasses.Field, cls=FinetuneConfig):
    """(argparse type, nargs) for a config field from its annotation."""
    hints = typing.get_type_hints(cls)
    tp = hints[f.name]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    optional = type(None) in typing.get_args(tp)
    base = args[0] if args else tp
    if typing.get_origin(base) is list:
        inner = (typing.get_args(base) or (str,))[0]
        return {float: float, int: int}.get(inner, str), "+"
    conv = {bool: _bool, int: int, float: float, str: str}.get(base, str)
    return (_none_or(conv) if optional else conv), None


def add_finetune_arguments(parser: argparse.ArgumentParser, cls=FinetuneConfig) -> None:
    parser.add_argument("--recipe", metavar="FILE.yaml",
                        help="YAML file whose keys are the job's fields; flags given explicitly override it.")
    for f in dataclasses.fields(cls):
        conv, nargs = _field_type(f, cls)
        flag = "--" + f.name.replace("_", "-")
        kwargs = dict(dest=f.name, type=conv, default=argparse.SUPPRESS, help=f.metadata.get("help", ""))
        if nargs:
            kwargs["nargs"] = nargs
        if f.name == "method":
            kwargs["choices"] = METHODS
        if conv is _bool:
            kwargs["metavar"] = "{true,false}"
        parser.add_argument(flag, **kwargs)


def load_recipe(path: str, cls=FinetuneConfig) -> dict:
    """Read a recipe YAML; raise ``ValueError`` naming any key that is not a field of the job's config."""
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"recipe {path}: expected a mapping of finetune fields, got {type(data).__name__}.")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    known = set(cls.field_names())
    unknown = sorted(set(data) - known)
    if unknown:
        job = "finetune" if cls is FinetuneConfig else "pretrain"
        raise ValueError(f"recipe {path}: unknown key(s) {unknown}; valid keys are the {job} fields: "
                         f"{', '.join(sorted(known))}.")
    return data


def finetune_config_from_args(ns: argparse.Namespace, cls=FinetuneConfig):
    """Recipe values first, then the flags given explicitly on the command line (flags win)."""
    values = load_recipe(ns.recipe, cls) if getattr(ns, "recipe", None) else {}
    values.update({k: v for k, v in vars(ns).items() if k in cls.field_names()})
    return cls(**values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-dtrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    ft = sub.add_parser("finetune", help="fine-tune a base model and report eval loss / accuracy before and after")
    add_finetune_arguments(ft)
    from hf_dtrain.pretrain import PretrainConfig

    pt = sub.add_parser("pretrain", help="pretrain a LLaMA from a LlamaConfig preset with any compatible parts")
    add_finetune_arguments(pt, PretrainConfig)
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
    if ns.command in ("finetune", "pretrain"):
        if ns.command == "finetune":
            from hf_dtrain.finetune import run_finetune as run
            cls = FinetuneConfig
        else:
            from hf_dtrain.pretrain import PretrainConfig as cls
            from hf_dtrain.pretrain import run_pretrain as run
        try:
            cfg = finetune_config_from_args(ns, cls)
        except (ValueError, TypeError, OSError) as e:
            raise SystemExit(f"hf-dtrain {ns.command}: {e}") from None
        try:
            run(cfg)
        except ValueError as e:
            if "cannot be combined" in str(e):  # ComposeOptions.check: the clash, named, before any training
                raise SystemExit(f"hf-dtrain {ns.command}: {e}") from None
            raise
        finally:
            if ns.command == "pretrain":
                from hf_dtrain.distributed import release_process_group

                release_process_group()  # DDP freed while its gloo group exists, then the group
        return 0
    parser.error(f"unknown command {ns.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
