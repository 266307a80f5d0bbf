"""``hf-dtrain`` console script (also ``python -m hf_dtrain.cli``).

Subcommands:
  finetune     fine-tune any causal LM with lora / dora / lorafa / smt / qbara / qahira / full, or a saved peft
               config, through TRL's SFTTrainer (see :mod:`hf_dtrain.finetune`)
  pretrain     pretrain a LLaMA from a LlamaConfig preset; --tp / --pp / --dp-* lay it out on a mesh
               (see :mod:`hf_dtrain.pretrain`)
  sweep        a grid of finetune jobs trained fused, as one model (see :mod:`hf_dtrain.sweep`)
  fed          federated fine-tuning, simulated on the launched processes: fed simulate (see :mod:`hf_dtrain.fed`)
  elastic      elastic data-parallel training on hosts that join and leave (hf-dtrain elastic --help)
  plan         rank the parallelism plans of a model on a machine (hf-dtrain plan --help)
  build-base   build (and cache) the embedded default base model

Every setting is a flag and a recipe YAML key, generated from the typed configs: the engine sections of
:class:`hf_dtrain.compose.ComposeOptions` (--comm-hook.*, --eva.* / --onebit-lamb.* / --gossip.* / --diloco.*,
--delta.*, --fault-tolerance.*, --fsdp.*), pretrain's --parallel.* / --tensor-parallel.* / --pipeline.*, each
fine-tuning method's own section (--smt.*, --lorafa.*, --qbara.*, --qahira.*), and for finetune every field of TRL's
SFTConfig and transformers' TrainingArguments at the top level (--bf16, --gradient-checkpointing, --learning-rate,
--lr-scheduler-type, --num-train-epochs, --eval-steps, --save-steps, --resume-from-checkpoint, --packing,
--assistant-only-loss, --report-to ...). A recipe YAML gives the same, sections as nested mappings.

Errors in the input or the run are printed as one line naming the flag, key, file or rank and the fix, with exit
status 1; --debug (anywhere on the line) or HF_DTRAIN_DEBUG=1 adds the traceback.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import typing

import yaml
from transformers import HfArgumentParser
from transformers.hf_argparser import string_to_bool
from trl import SFTConfig

from hf_dtrain.errors import RunFailure, debug_requested, is_user_error, report_and_exit
from hf_dtrain.fed import FedSimulateConfig
from hf_dtrain.federated import FederatedConfig
from hf_dtrain.finetune import METHODS, FinetuneConfig
from hf_dtrain.fused import FusedConfig
from hf_dtrain.pretrain import PretrainConfig
from hf_dtrain.settings import SettingsError, build, help_of, merge, section_type, unwrap_optional, walk_fields
from hf_dtrain.sweep import AXIS_TYPES, GRID_AXES


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


def _converter(tp) -> tuple:
    """(argparse type, nargs) for a field's annotation."""
    base, optional = unwrap_optional(tp)
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


def add_job_arguments(parser: argparse.ArgumentParser, cls=FinetuneConfig) -> None:
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
                conv, _ = _converter(typing.get_type_hints(inner)[short])
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
    for path, f, tp, owner in walk_fields(cls):
        if f.metadata.get("flatten"):
            continue
        conv, nargs = _converter(tp)
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
        if path == "method" and hasattr(cls, "training_args"):
            kwargs["choices"] = METHODS
        if conv is _bool:
            kwargs["metavar"] = "{true,false}"
        groups[section].add_argument(flag_of(path), **kwargs)
    if any(f.name == "parallel" for f in dataclasses.fields(cls)):  # the degrees' short forms, as torchtitan names them
        for name in ("tp", "pp", "dp_shard", "dp_replicate"):
            groups["parallel"].add_argument(
                flag_of(name),
                dest=f"parallel.{name}",
                type=int,
                default=argparse.SUPPRESS,
                metavar="N",
                help=f"Short for {flag_of('parallel.' + name)}.",
            )
        groups["parallel"].add_argument(
            "--plan",
            dest="parallel.plan",
            default=argparse.SUPPRESS,
            choices=["auto"],
            help="Short for --parallel.plan.",
        )
    if any(f.metadata.get("flatten") for f in dataclasses.fields(cls)):
        add_trainer_arguments(parser, cls)


# SFTConfig fields no flag can give: an object (set it from Python: FinetuneConfig(training={...}))
NOT_FLAGS = ("parallelism_config",)


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


def _bool_or_str(text: str):
    t = str(text).strip().lower()
    return {"true": True, "false": False}.get(t, text)


def add_trainer_arguments(parser: argparse.ArgumentParser, cls=FinetuneConfig) -> None:
    """Every field of TRL's ``SFTConfig`` (so every ``TrainingArguments`` field) as a top-level flag, made by
    transformers' own ``HfArgumentParser`` field by field (``--learning-rate`` / ``--learning_rate``, ``--bf16``,
    ``--no-remove-unused-columns``, choices and JSON dicts as ``trl sft`` takes them), except the names the job
    owns (``--fsdp``, ``--deepspeed``: hf_dtrain's engines, which set the Trainer's). Only the flags given reach the
    config (their defaults are the job's, ``FinetuneConfig.training_defaults``)."""

    owned = {f.name for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(SFTConfig)
    group = parser.add_argument_group(
        "the Trainer (every field of trl.SFTConfig and transformers.TrainingArguments; the job's defaults differ "
        "where FinetuneConfig.training_defaults says)"
    )
    before = len(parser._actions)
    for f in dataclasses.fields(SFTConfig):
        if not f.init or f.name in owned or f.name in NOT_FLAGS:
            continue
        f = copy.copy(f)
        f.type = hints[f.name]
        HfArgumentParser._parse_dataclass_field(group, f)
    for action in parser._actions[before:]:
        action.default = argparse.SUPPRESS
        action.required = False
        kinds = set(typing.get_args(hints.get(action.dest)) or (hints.get(action.dest),))
        if action.type is string_to_bool and action.nargs is None and action.option_strings:
            action.nargs, action.const = "?", True  # --bf16 alone means true, as for the other booleans
        if dict in kinds or any(typing.get_origin(k) is dict for k in kinds):
            action.type = _json_mapping  # a JSON object on the command line, as TRL's CLI takes it
        elif kinds >= {str, bool}:
            action.type = _bool_or_str  # include_num_input_tokens_seen: true / false / "all" / "non_padding"
        if action.help:
            action.help = action.help.replace("%", "%%") if "%%" not in action.help else action.help


def load_recipe(path: str) -> dict:
    """A recipe YAML's mapping (checked against the job's fields when the config is built)."""

    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"recipe {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"recipe {path}: expected a mapping of job fields, got {type(data).__name__}.")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def args_to_data(ns: argparse.Namespace, cls=FinetuneConfig) -> dict:
    """The flags given explicitly, as nested plain data (``--comm-hook.rank 8`` -> ``{"comm_hook": {"rank": 8}}``)."""
    data: dict = {}
    given = {k: v for k, v in vars(ns).items() if k not in ("command", "recipe")}
    for key, value in sorted(given.items(), key=lambda kv: kv[0].count(".")):  # short forms before fields
        section, _, name = key.partition(".")
        data = merge(data, {section: {name: value}} if name else {key: value}, cls)
    return data


def job_config_from_args(ns: argparse.Namespace, cls=FinetuneConfig):
    """Recipe values first, then the flags given explicitly on the command line (flags win, field by field)."""
    recipe = load_recipe(ns.recipe) if getattr(ns, "recipe", None) else {}
    where = f"recipe {ns.recipe}" if getattr(ns, "recipe", None) else cls.__name__
    return cls.from_dict(merge(recipe, args_to_data(ns, cls), cls), where=where)


def _list_of(conv):
    def parse(text):
        items = [t for t in str(text).split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return [conv(t.strip()) for t in items]

    parse.__name__ = f"list of {conv.__name__}"
    return parse


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """``hf-dtrain finetune``'s flags (the settings every job shares), the grid's axes as comma-separated lists
    (``--lr 1e-4,3e-4 --r 8,16 --seed 0,1``), ``--recipes`` (one job per YAML) and ``--fused.*`` (FusedConfig)."""

    add_job_arguments(parser, FinetuneConfig)
    grid = parser.add_argument_group("the grid (comma-separated values; every combination is one job)")
    for short, name in GRID_AXES.items():
        flags = [flag_of(name)] + ([flag_of(short)] if short != name else [])
        grid.add_argument(
            *flags,
            dest=f"grid.{name}",
            type=_list_of(AXIS_TYPES[name]),
            default=argparse.SUPPRESS,
            metavar="V[,V...]",
            help=f"Values of {name}, one job each.",
        )
    grid.add_argument(
        "--recipes",
        dest="grid.recipes",
        type=_list_of(str),
        default=argparse.SUPPRESS,
        metavar="A.yaml[,B.yaml...]",
        help="One job per finetune recipe (the grid's axes then expand each); flags given here apply to all.",
    )
    fused = parser.add_argument_group(f"fused (FusedConfig, {FusedConfig.__module__})")
    fh = typing.get_type_hints(FusedConfig)
    for f in dataclasses.fields(FusedConfig):
        conv, _ = _converter(fh[f.name])
        fused.add_argument(
            flag_of(f"fused.{f.name}"), dest=f"fused.{f.name}", type=conv, default=argparse.SUPPRESS, help=help_of(f)
        )


def sweep_config_from_args(ns: argparse.Namespace):
    """The ``SweepConfig`` of ``hf-dtrain sweep``'s arguments. A recipe (``--recipe``, or each of ``--recipes``) holds
    finetune fields, and optionally ``grid:`` (axis -> list of values) and ``fused:`` (FusedConfig) mappings; flags
    given on the command line win, field by field (a grid axis flag replaces that axis)."""
    from hf_dtrain.sweep import GRID_AXES, SweepConfig, expand_grid

    given = vars(ns)
    flag_axes = {k.split(".", 1)[1]: v for k, v in given.items() if k.startswith("grid.") and k != "grid.recipes"}
    flag_fused = {k.split(".", 1)[1]: v for k, v in given.items() if k.startswith("fused.")}
    shared = argparse.Namespace(
        **{k: v for k, v in given.items() if not k.startswith(("grid.", "fused.")) and k != "recipe"}
    )
    recipes = given.get("grid.recipes") or [given.get("recipe")]
    jobs, fused = [], {}
    for path in recipes:
        data = load_recipe(path) if path else {}
        grid = data.pop("grid", None) or {}
        if not isinstance(grid, dict):
            raise ValueError(f"recipe {path}: grid must be a mapping of axis -> list of values.")
        unknown = [k for k in grid if k not in GRID_AXES and k not in GRID_AXES.values()]
        if unknown:
            raise ValueError(f"recipe {path}: grid axes {unknown} are unknown; use {sorted(GRID_AXES)}.")
        axes = {GRID_AXES.get(k, k): (v if isinstance(v, list) else [v]) for k, v in grid.items()}
        axes.update(flag_axes)
        fused = {**(data.pop("fused", None) or {}), **fused}
        where = f"recipe {path}" if path else "FinetuneConfig"
        base = FinetuneConfig.from_dict(merge(data, args_to_data(shared, FinetuneConfig), FinetuneConfig), where=where)
        jobs += expand_grid(base, **axes)
    base = jobs[0]
    return SweepConfig(
        jobs=jobs,
        fused={**fused, **flag_fused},
        output_dir=base.training.get("output_dir"),
        progress=base.progress,
        report=base.report,
    )


FED_SHORT = {
    "clients": "clients",
    "per-round": "per_round",
    "rounds": "rounds",
    "local-steps": "local_steps",
    "algorithm": "algorithm",
    "uplink": "uplink",
}


def add_fed_arguments(parser: argparse.ArgumentParser) -> None:
    """``hf-dtrain fed simulate``: finetune's model / method / data flags, ``--fed.*`` (FederatedConfig) and the
    short forms ``--clients --per-round --rounds --local-steps --algorithm --uplink``."""

    add_job_arguments(parser, FinetuneConfig)
    group = parser.add_argument_group(f"fed (FederatedConfig, {FederatedConfig.__module__})")
    hints = typing.get_type_hints(FederatedConfig)
    for f in dataclasses.fields(FederatedConfig):
        conv, _ = _converter(hints[f.name])
        group.add_argument(
            flag_of(f"fed.{f.name}"), dest=f"fed.{f.name}", type=conv, default=argparse.SUPPRESS, help=help_of(f)
        )
    for short, name in FED_SHORT.items():
        conv, _ = _converter(hints[name])
        group.add_argument(
            f"--{short}", dest=f"fed.{name}", type=conv, default=argparse.SUPPRESS, help=f"Short for --fed.{short}."
        )


def fed_config_from_args(ns: argparse.Namespace):

    given = vars(ns)
    fed = {k.split(".", 1)[1]: v for k, v in given.items() if k.startswith("fed.")}
    data = load_recipe(ns.recipe) if getattr(ns, "recipe", None) else {}
    fed = {**(data.pop("fed", None) or {}), **fed}
    shared = argparse.Namespace(
        **{k: v for k, v in given.items() if not k.startswith("fed.") and k not in ("recipe", "action")}
    )
    job = FinetuneConfig.from_dict(
        merge(data, args_to_data(shared, FinetuneConfig), FinetuneConfig),
        where=f"recipe {ns.recipe}" if getattr(ns, "recipe", None) else "FinetuneConfig",
    )
    return FedSimulateConfig(job=job, fed=build(FederatedConfig, fed, where="fed"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-dtrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ft = sub.add_parser("finetune", help="fine-tune a base model and report eval loss / accuracy before and after")
    add_job_arguments(ft)

    pt = sub.add_parser("pretrain", help="pretrain a LLaMA from a LlamaConfig preset with any compatible parts")
    add_job_arguments(pt, PretrainConfig)
    sw = sub.add_parser(
        "sweep",
        conflict_handler="resolve",
        help="train a grid of finetune jobs fused, as one model (HFTA): --lr 1e-4,3e-4 --r 8,16 --seed 0,1",
    )
    add_sweep_arguments(sw)
    fed = sub.add_parser("fed", help="federated fine-tuning: hf-dtrain fed simulate --clients 100 --per-round 10")
    fed_sub = fed.add_subparsers(dest="action", required=True)
    add_fed_arguments(fed_sub.add_parser("simulate", help="simulate N clients on the launched processes (Parrot)"))
    sub.add_parser(
        "elastic",
        help="elastic data-parallel training: hosts join and leave while it trains (hf-dtrain elastic --help)",
        add_help=False,
    )
    sub.add_parser(
        "plan", help="rank the parallelism plans of a model on a machine (hf-dtrain plan --help)", add_help=False
    )
    bb = sub.add_parser("build-base", help="build and cache the embedded default base model")
    bb.add_argument("--preset", default="tiny", help="LlamaConfig preset (hf_dtrain.models.PRESETS)")
    bb.add_argument("--steps", type=int, default=None, help="pretraining steps (default per preset)")
    bb.add_argument("--seed", type=int, default=0)
    bb.add_argument("--cache-dir", default=None, help="cache root (default $HF_DTRAIN_CACHE or ~/.cache/hf_dtrain)")
    return parser


def _job_name(args: list[str]) -> str:
    """``finetune``, ``fed simulate``, ...: how the one-line errors name the job."""
    words = [a for a in args[:2] if not a.startswith("-")]
    if words[:1] == ["fed"]:
        return " ".join(words)
    return words[0] if words else ""


def main(argv: list[str] | None = None) -> int:
    """``hf-dtrain``: every job runs inside one error boundary. An error hf_dtrain raised about the input or the run
    (:mod:`hf_dtrain.errors`) is printed as one line, ``hf-dtrain <job>: <what and the fix>``, and the status is 1;
    ``--debug`` (anywhere on the line) or ``HF_DTRAIN_DEBUG=1`` prints the traceback too. Any other exception is a bug
    and keeps its traceback."""
    args = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in args or debug_requested()
    args = [a for a in args if a != "--debug"]
    job = _job_name(args)
    try:
        return _dispatch(args)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        print(f"hf-dtrain {job}: interrupted.", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except Exception as e:
        if not is_user_error(e):
            raise
        report_and_exit(job, e, debug)
    finally:  # the DDP model (the Trainer's, the loop's) freed while its gloo group exists, then the group: freed at
        # interpreter exit instead, a rank could abort ("terminate called without an active exception") after the
        # run had saved everything
        from hf_dtrain.distributed.groups import release_process_group

        release_process_group()
    return 1


def _settings(parse, *args):
    """A job's typed config from the parsed flags and recipe: any error building it is a settings error (the
    message names the flag or the YAML key)."""
    try:
        return parse(*args)
    except (ValueError, TypeError, OSError) as e:
        if isinstance(e, SettingsError):
            raise
        raise SettingsError(str(e)) from e


def _dispatch(args: list[str]) -> int:
    if args[:1] == ["elastic"]:  # its own parser (hf-dtrain elastic --help): runs torchrun for this host
        from hf_dtrain.elastic import main as elastic_main

        return elastic_main(args[1:])
    if args[:1] == ["plan"]:  # its own parser (hf-dtrain plan --help)
        from hf_dtrain.plan import plan_main

        return plan_main(args[1:])
    if args[:1] == ["finetune"]:
        mesh_flags = [
            a
            for a in args
            if a.split("=")[0] in ("--tp", "--pp", "--dp-shard", "--dp-replicate", "--plan")
            or a.startswith(("--parallel", "--pipeline.", "--tensor-parallel."))
        ]
        if mesh_flags:
            raise SettingsError(
                f"{mesh_flags[0]} is a pretrain flag: the Trainer cannot drive a "
                "pipeline (it calls model(**batch) once per step on every rank) and does not lay a "
                "model out on a tp / pp mesh. Use hf-dtrain pretrain --tp/--pp, or the Accelerate loop "
                "in docs/parallel.md; for sharded fine-tuning use --fsdp or --deepspeed zero3."
            )
    parser = build_parser()
    ns = parser.parse_args(args)
    if ns.command == "build-base":
        from hf_dtrain.models import build_default_model

        print(build_default_model(ns.preset, cache_dir=ns.cache_dir, steps=ns.steps, seed=ns.seed))
        return 0
    if ns.command == "fed":
        from hf_dtrain.fed import run_fed_simulate

        run_fed_simulate(_settings(fed_config_from_args, ns))
        return 0
    if ns.command == "sweep":
        from hf_dtrain.sweep import run_sweep

        cfg = _settings(sweep_config_from_args, ns)
        stopped = [r for r in run_sweep(cfg)["jobs"] if r["status"] != "ok"]
        if stopped:  # the others trained and were saved; the run still says it is not all right, at the end
            raise RunFailure(
                f"{len(stopped)} of {len(cfg.jobs)} jobs did not finish: "
                + "; ".join(f"{os.path.basename(r['output_dir'])} {r['status']}" for r in stopped)
                + f". The other jobs trained and were saved under {cfg.output_dir} (sweep.md has every row)."
            )
        return 0
    if ns.command in ("finetune", "pretrain"):
        if ns.command == "finetune":
            from hf_dtrain.finetune import run_finetune as run

            cls = FinetuneConfig
        else:
            from hf_dtrain.pretrain import PretrainConfig as cls
            from hf_dtrain.pretrain import run_pretrain as run
        run(_settings(job_config_from_args, ns, cls))
        return 0
    parser.error(f"unknown command {ns.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
