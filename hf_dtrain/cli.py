"""``hf-dtrain`` console script (also ``python -m hf_dtrain.cli``).

Subcommands:
  finetune     fine-tune any causal LM with a registered method or a saved peft config, through TRL's SFTTrainer
               (see :mod:`hf_dtrain.jobs.finetune`)
  pretrain     pretrain a LLaMA from a LlamaConfig preset, on one process or laid out over many
               (see :mod:`hf_dtrain.jobs.pretrain`)
  sweep        a grid of finetune jobs trained fused, as one model (see :mod:`hf_dtrain.jobs.sweep`)
  fed          federated fine-tuning, simulated on the launched processes: fed simulate (see :mod:`hf_dtrain.jobs.fed`)
  elastic      elastic data-parallel training on hosts that join and leave (see :mod:`hf_dtrain.jobs.elastic`)
  plan         rank the parallelism plans of a model on a machine (see :mod:`hf_dtrain.jobs.plan`)
  build-base   build (and cache) the embedded default base model

Every setting is a flag and a recipe YAML key, generated from the typed configs: the job's own, every registered
engine section's and each registered fine-tuning method's own section (``hf-dtrain <job> --help`` lists them, one
group per section: --<section>.<setting>), and for the fine-tuning jobs every field of TRL's SFTConfig and
transformers' TrainingArguments at the top level (--bf16, --gradient-checkpointing, --learning-rate ...). A recipe
YAML gives the same, sections as nested mappings.

The jobs are registered lazily: ``hf-dtrain --help`` imports no job, and a job imports only what it uses.

Errors in the input or the run are printed as one line naming the flag, key, file or rank and the fix, with exit
status 1; --debug (anywhere on the line) or HF_DTRAIN_DEBUG=1 adds the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass

from hf_dtrain.errors import debug_requested, report_and_exit


@dataclass(frozen=True)
class Job:
    """A subcommand, loaded on use: ``config`` names the config class (or a function returning it) whose fields are
    the flags, ``run`` the function that runs a config; or ``arguments`` / ``main`` a job that parses its own flags
    (``main(namespace)``). Each is ``"module:attribute"``."""

    help: str
    config: str | None = None
    run: str | None = None
    arguments: str | None = None
    main: str | None = None
    actions: tuple[str, ...] = ()  # sub-subcommands (fed simulate)


JOBS = {
    "finetune": Job(
        "fine-tune a base model and report eval loss / accuracy before and after",
        config="hf_dtrain.jobs.sft.config:finetune_config_class",
        run="hf_dtrain.jobs.finetune:run_finetune",
    ),
    "pretrain": Job(
        "pretrain a LLaMA from a LlamaConfig preset with any compatible parts",
        config="hf_dtrain.jobs.pretrain.config:pretrain_config_class",
        run="hf_dtrain.jobs.pretrain:run_pretrain",
    ),
    "sweep": Job(
        "train a grid of finetune jobs fused, as one model (HFTA): --lr 1e-4,3e-4 --r 8,16 --seed 0,1",
        arguments="hf_dtrain.jobs.sweep.config:add_arguments",
        main="hf_dtrain.jobs.sweep.run:main",
    ),
    "fed": Job(
        "federated fine-tuning: hf-dtrain fed simulate --clients 100 --per-round 10",
        arguments="hf_dtrain.jobs.fed.config:add_arguments",
        main="hf_dtrain.jobs.fed.run:main",
        actions=("simulate",),
    ),
    "elastic": Job(
        "elastic data-parallel training: hosts join and leave while it trains",
        config="hf_dtrain.jobs.elastic.config:ElasticJob",
        run="hf_dtrain.jobs.elastic.run:run_elastic",
    ),
    "plan": Job(
        "rank the parallelism plans of a model on a machine",
        config="hf_dtrain.jobs.plan:PlanConfig",
        run="hf_dtrain.jobs.plan:run_plan",
    ),
    "build-base": Job(
        "build and cache the embedded default base model",
        arguments="hf_dtrain.cli:add_build_base_arguments",
        main="hf_dtrain.cli:build_base",
    ),
}


def load(target: str):
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def config_class(job: Job) -> type:
    found = load(job.config)
    return found if isinstance(found, type) else found()


def top_parser() -> argparse.ArgumentParser:
    """``hf-dtrain``: the subcommands and their one-line help (no job loaded)."""
    parser = argparse.ArgumentParser(
        prog="hf-dtrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(JOBS) + "}")
    for name, job in JOBS.items():
        sub.add_parser(name, help=job.help, add_help=False)
    return parser


def job_parser(name: str) -> argparse.ArgumentParser:
    """The flags of job ``name`` (its module is imported here, and only it)."""
    from hf_dtrain.run.flags import add_job_arguments

    job = JOBS[name]
    parser = argparse.ArgumentParser(prog=f"hf-dtrain {name}", description=job.help, conflict_handler="resolve")
    flags = parser
    if job.actions:  # hf-dtrain fed simulate
        sub = parser.add_subparsers(dest="action", required=True)
        flags = sub.add_parser(job.actions[0], conflict_handler="resolve", help=job.help)
    if job.arguments is not None:
        load(job.arguments)(flags)
    else:
        add_job_arguments(flags, config_class(job))
    return parser


def build_parser(name: str) -> argparse.ArgumentParser:
    """The parser of job ``name`` (tests and tools build one job's flags with it)."""
    return job_parser(name)


def parse(argv: list[str]):
    """``(job name, namespace)`` of a command line; ``--help`` prints and exits."""
    if not argv or argv[0].startswith("-") or argv[0] not in JOBS:
        top_parser().parse_args(argv)  # --help, or an unknown command: argparse says so and exits
    name = argv[0]
    if JOBS[name].config is not None:  # another job's section flag: refused in that section's words
        from hf_dtrain.run.section import foreign_flag
        from hf_dtrain.settings import SettingsError

        refusal = foreign_flag(name, argv[1:])
        if refusal:
            raise SettingsError(refusal)
    return name, job_parser(name).parse_args(argv[1:])


def _job_name(args: list[str]) -> str:
    """``finetune``, ``fed simulate``, ...: how the one-line errors name the job."""
    words = [a for a in args[:2] if not a.startswith("-")]
    if words[:1] == ["fed"]:
        return " ".join(words)
    return words[0] if words else ""


def main(argv: list[str] | None = None) -> int:
    """``hf-dtrain``: every job runs inside one error boundary. An error hf_dtrain raised about the input or the run
    (:class:`hf_dtrain.errors.UserError`) is printed as one line, ``hf-dtrain <job>: <what and the fix>``, and the
    status is 1; ``--debug`` (anywhere on the line) or ``HF_DTRAIN_DEBUG=1`` prints the traceback too. Any other
    exception is a bug and keeps its traceback."""
    from hf_dtrain.errors import UserError

    args = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in args or debug_requested()
    args = [a for a in args if a != "--debug"]
    job = _job_name(args)
    try:
        return run(args)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        print(f"hf-dtrain {job}: interrupted.", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except UserError as e:
        report_and_exit(job, e, debug)
    finally:  # the DDP model (the Trainer's, the loop's) freed while its gloo group exists, then the group: freed at
        # interpreter exit instead, a rank could abort ("terminate called without an active exception") after the
        # run had saved everything
        if "torch" in sys.modules:
            from hf_dtrain.distributed.groups import release_process_group

            release_process_group()
    return 1


def run(args: list[str]) -> int:
    """Parse ``args`` for its job and run it."""
    name, ns = parse(args)
    job = JOBS[name]
    if job.main is not None:
        status = load(job.main)(ns)
    else:
        from hf_dtrain.run.flags import job_config_from_args

        status = load(job.run)(job_config_from_args(ns, config_class(job)))
    return status if isinstance(status, int) else 0  # the jobs return their results


def add_build_base_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny", help="LlamaConfig preset (hf_dtrain.models.PRESETS)")
    parser.add_argument("--steps", type=int, default=None, help="pretraining steps (default per preset)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=None, help="cache root (default $HF_DTRAIN_CACHE or ~/.cache/hf_dtrain)")


def build_base(ns: argparse.Namespace) -> int:
    from hf_dtrain.models import build_default_model

    print(build_default_model(ns.preset, cache_dir=ns.cache_dir, steps=ns.steps, seed=ns.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
