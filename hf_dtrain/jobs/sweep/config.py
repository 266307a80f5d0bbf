"""The sweep's settings and grid: :class:`SweepConfig`, :func:`expand_grid`, what may differ between fused jobs
and what must not (:func:`check_fusable`), and the command line (``hf-dtrain sweep`` flags). Light to import:
``hf-dtrain sweep --help`` reads it."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
from dataclasses import dataclass

from hf_dtrain.fused.config import FusedConfig
from hf_dtrain.jobs.sft.config import FinetuneJob, finetune_config_class
from hf_dtrain.run.flags import add_config_arguments, add_job_arguments, args_to_data, flag_of, list_of, load_recipe
from hf_dtrain.settings import SettingsError, merge, setting
from hf_dtrain.tuners.finetune_method import FINETUNE_METHODS, WHOLE_MODEL


def fusable_methods() -> list[str]:
    """The registered methods that train fused (their form, or a whole model's copies)."""
    return [name for name, m in FINETUNE_METHODS.items() if m.fused is not None and not _refused(m)]


def _refused(method) -> bool:
    return isinstance(method.fused, str) and method.fused != WHOLE_MODEL


# settings a job may set for itself (FinetuneConfig fields, the Trainer's settings in its `training`, and what each
# method declares of its own section: FinetuneMethod.sweep_settings); every other setting must be the same for all
# jobs of a sweep
SHARED_PER_JOB = (
    "learning_rate",
    "seed",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "weight_decay",
    "warmup_steps",
    "output_dir",
    "logging_steps",
    "report",
    "progress",
    "disable_tqdm",
)
# the grid's axes on the command line (--lr 1e-4,3e-4 --r 8,16 --alpha 16 --seed 0,1 ...) -> (setting, type, label)
SHARED_AXES = {
    "lr": ("learning_rate", float, "lr"),
    "r": ("lora_r", int, "r"),
    "alpha": ("lora_alpha", int, "alpha"),
    "seed": ("seed", int, "seed"),
    "dropout": ("lora_dropout", float, "dropout"),
    "weight_decay": ("weight_decay", float, "wd"),
    "warmup_steps": ("warmup_steps", int, "warmup"),
}


def per_job() -> tuple[str, ...]:
    own = (f"{m.name}.{s}" for m in FINETUNE_METHODS.values() for s in m.sweep_settings)
    return (*SHARED_PER_JOB, *own)


def grid_axes() -> dict[str, tuple[str, type, str]]:
    """Every grid axis: its short name on the command line -> (the setting, its type, its label in job names); the
    methods' own (``<method>_<setting>`` -> ``<method>.<setting>``) from their registrations."""
    out = dict(SHARED_AXES)
    for m in FINETUNE_METHODS.values():
        for name, (kind, label) in m.sweep_axes.items():
            out[f"{m.name}_{name}"] = (f"{m.name}.{name}", kind, label)
    return out


def axis_types() -> dict[str, type]:
    return {name: kind for name, kind, _ in grid_axes().values()}


@dataclass
class SweepConfig:
    """A fused sweep: its jobs (each a full ``FinetuneConfig``) and how they are fused."""

    jobs: list = setting(help="The jobs (FinetuneConfig each); see expand_grid.", factory=list)
    fused: FusedConfig = setting(help="How the jobs are fused.", factory=FusedConfig)
    output_dir: str | None = setting(
        None, "Where the jobs' directories and the sweep table go; default outputs/sweep-<method>."
    )
    progress: bool = setting(True, "Show the progress bar (per-job losses).")
    report: bool = setting(True, "Print the sweep table.")

    def __post_init__(self):
        if isinstance(self.fused, dict):
            from hf_dtrain.settings import build

            self.fused = build(FusedConfig, self.fused, where="SweepConfig.fused")
        jobs = []
        for i, j in enumerate(self.jobs):
            if isinstance(j, dict):
                j = finetune_config_class().from_dict(j, where=f"SweepConfig.jobs[{i}]")
            if not isinstance(j, FinetuneJob):
                raise TypeError(
                    f"SweepConfig.jobs[{i}] is a {type(j).__name__}; give FinetuneConfig objects "
                    "(or mappings of its fields)."
                )
            jobs.append(j)
        self.jobs = jobs
        if not self.jobs:
            raise SettingsError(
                "SweepConfig.jobs is empty: give at least one job (expand_grid, or --lr/--r/--seed "
                "lists, or --recipes)."
            )
        check_fusable(self.jobs)


def expand_grid(base: FinetuneJob, **axes) -> list[FinetuneJob]:
    """The cartesian product of ``axes`` (FinetuneConfig field -> list of values) over ``base``, in the order given
    (the last axis varies fastest)."""
    for name, values in axes.items():
        if name not in per_job():
            raise SettingsError(
                f"expand_grid: {name!r} cannot vary between fused jobs (one of {', '.join(per_job())} can): "
                "jobs of one fused sweep share the base model, the data source and the step count."
            )
        if not isinstance(values, (list, tuple)) or not values:
            raise SettingsError(f"expand_grid: {name}={values!r}: give a non-empty list of values.")
    jobs = []
    for combo in itertools.product(*axes.values()):
        data = _plain(base)
        for name, value in zip(axes, combo):
            section, _, key = name.rpartition(".")
            if section:
                data[section] = {**(data.get(section) or {}), key: value}
            else:
                data[name] = value
        jobs.append(finetune_config_class().from_dict(data, where="the sweep grid"))
    return jobs


def job_setting(job: FinetuneJob, name: str):
    """A job's value of a grid setting: a field, a section's (``<method>.<setting>``) or the Trainer's (``seed``)."""
    section, _, key = name.rpartition(".")
    if section:
        return getattr(getattr(job, section), key)
    if name in {f.name for f in dataclasses.fields(job)}:
        return getattr(job, name)
    return getattr(job_args(job), name)


def job_args(job: FinetuneJob):
    """The job's Trainer settings (``SFTConfig``), as ``hf-dtrain finetune`` would train it."""
    return job.training_args()


def _plain(cfg: FinetuneJob) -> dict:
    data = dataclasses.asdict(cfg)
    training = data.pop("training")
    return {**{k: v for k, v in data.items() if v is not None or k in per_job()}, **training}


def check_fusable(jobs: list[FinetuneJob]) -> None:
    """Refuse, naming the job and the reason, a list of jobs that cannot be trained as one fused model."""
    first = jobs[0]
    for i, job in enumerate(jobs):
        who = f"job {i} ({job_name(job, jobs, i)})"
        try:
            job.method_entry.fused_form()
        except ValueError as e:
            raise SettingsError(f"{who}: {e}. Fusable methods: {', '.join(fusable_methods())}.") from None
        for name in job.engine_settings_given():
            raise SettingsError(
                f"{who}: {name} is set, but a fused sweep runs its own loop (fused AdamW, one process or DDP over the "
                f"fused array); leave {name} at its default, or run the job alone with hf-dtrain finetune."
            )
        unsupported = sorted(set(job.training) - FUSED_TRAINER_SETTINGS)
        if unsupported:
            raise SettingsError(
                f"{who}: {', '.join('--' + k.replace('_', '-') for k in unsupported)} given, but the fused "
                "loop takes only these Trainer settings: "
                f"{', '.join(sorted(FUSED_TRAINER_SETTINGS))}; run the job alone with hf-dtrain finetune."
            )
        if job_args(job).gradient_accumulation_steps != 1:
            raise SettingsError(
                f"{who}: gradient_accumulation_steps={job_args(job).gradient_accumulation_steps}; the "
                "fused loop takes one micro-batch per job per step: raise per_device_train_batch_size "
                "instead."
            )
        mine, theirs = _settings(job), _settings(first)
        for name in sorted(set(mine) | set(theirs)):
            if name in per_job() or mine.get(name) == theirs.get(name):
                continue
            what = (
                "different base models"
                if name in ("model", "gguf_file", "base_preset", "base_steps", "quantize", "quant_group_size")
                else "different methods"
                if name == "method"
                else f"a different {name}"
            )
            raise SettingsError(
                f"{who}: {what} ({name}={mine.get(name)!r}, job 0 has {theirs.get(name)!r}); fused jobs "
                "share one base model, method, data source, batch size and step count. Split the grid "
                "into one sweep per value."
            )


# the Trainer settings the fused loop honours (each job's own where per_job() says so); others are refused
FUSED_TRAINER_SETTINGS = {
    "learning_rate",
    "seed",
    "weight_decay",
    "warmup_steps",
    "max_steps",
    "num_train_epochs",
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "gradient_accumulation_steps",
    "output_dir",
    "logging_steps",
    "disable_tqdm",
    "report_to",
    "max_length",
    "dataset_text_field",
    "completion_only_loss",
    "use_cpu",
}


def _settings(job: FinetuneJob) -> dict:
    """Every setting of a job by name: its fields, its sections' as ``section.field``, the Trainer's given ones."""
    out = {}
    for f in dataclasses.fields(job):
        value = getattr(job, f.name)
        if f.name == "training":
            out.update(value)
        elif dataclasses.is_dataclass(value):
            out.update({f"{f.name}.{k}": v for k, v in dataclasses.asdict(value).items()})
        else:
            out[f.name] = value
    return out


def max_steps_of(job: FinetuneJob, train_rows: int, world: int) -> int:
    """The optimizer steps the Trainer would take: ``max_steps``, or the epochs over the sharded loader."""
    args = job_args(job)
    if args.max_steps > 0:
        return args.max_steps
    per_epoch = math.ceil(train_rows / (args.per_device_train_batch_size * world))
    return max(1, math.ceil(args.num_train_epochs * per_epoch))


def job_name(job: FinetuneJob, jobs: list[FinetuneJob], index: int) -> str:
    """A name from the settings that vary across the sweep (``lr0p0003-r8-seed1``: no dots, since peft adapter names
    are module names), unique within it."""
    varying = [(f, short) for f, _, short in grid_axes().values() if len({job_setting(j, f) for j in jobs}) > 1]

    def label(j):
        return (
            "-".join(
                f"{short}{job_setting(j, f):g}".replace(".", "p")
                if isinstance(job_setting(j, f), float)
                else f"{short}{job_setting(j, f)}"
                for f, short in varying
            )
            or "job"
        )

    same = [i for i, j in enumerate(jobs) if label(j) == label(job)]
    return f"{label(job)}-{same.index(index)}" if len(same) > 1 else label(job)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hf-dtrain finetune``'s flags (the settings every job shares), the grid's axes as comma-separated lists
    (``--lr 1e-4,3e-4 --r 8,16 --seed 0,1``), ``--recipes`` (one job per YAML) and ``--fused.*`` (FusedConfig)."""
    FinetuneConfig = finetune_config_class()
    add_job_arguments(parser, FinetuneConfig)
    grid = parser.add_argument_group("the grid (comma-separated values; every combination is one job)")
    for short, (name, kind, _) in grid_axes().items():
        flags = [flag_of(name)] + ([flag_of(short)] if short != name else [])
        grid.add_argument(
            *flags,
            dest=f"grid.{name}",
            type=list_of(kind),
            default=argparse.SUPPRESS,
            metavar="V[,V...]",
            help=f"Values of {name}, one job each.",
        )
    grid.add_argument(
        "--recipes",
        dest="grid.recipes",
        type=list_of(str),
        default=argparse.SUPPRESS,
        metavar="A.yaml[,B.yaml...]",
        help="One job per finetune recipe (the grid's axes then expand each); flags given here apply to all.",
    )
    add_config_arguments(parser, FusedConfig, "fused", f"fused (FusedConfig, {FusedConfig.__module__})")


def config_from_args(ns: argparse.Namespace) -> SweepConfig:
    """The ``SweepConfig`` of ``hf-dtrain sweep``'s arguments. A recipe (``--recipe``, or each of ``--recipes``) holds
    finetune fields, and optionally ``grid:`` (axis -> list of values) and ``fused:`` (FusedConfig) mappings; flags
    given on the command line win, field by field (a grid axis flag replaces that axis)."""
    FinetuneConfig = finetune_config_class()
    axes_by_short = {short: name for short, (name, _, _) in grid_axes().items()}
    given = vars(ns)
    flag_axes = {k.split(".", 1)[1]: v for k, v in given.items() if k.startswith("grid.") and k != "grid.recipes"}
    flag_fused = {k.split(".", 1)[1]: v for k, v in given.items() if k.startswith("fused.")}
    shared = argparse.Namespace(
        **{k: v for k, v in given.items() if not k.startswith(("grid.", "fused.")) and k != "recipe"}
    )
    jobs, fused = [], {}
    for path in given.get("grid.recipes") or [given.get("recipe")]:
        data = load_recipe(path) if path else {}
        grid = data.pop("grid", None) or {}
        if not isinstance(grid, dict):
            raise SettingsError(f"recipe {path}: grid must be a mapping of axis -> list of values.")
        unknown = [k for k in grid if k not in axes_by_short and k not in axes_by_short.values()]
        if unknown:
            raise SettingsError(f"recipe {path}: grid axes {unknown} are unknown; use {sorted(axes_by_short)}.")
        axes = {axes_by_short.get(k, k): (v if isinstance(v, list) else [v]) for k, v in grid.items()}
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
