"""Sections: one object per engine, declaring everything about itself, and the registries the jobs read.

A :class:`Section` is an engine's part of a job (FSDP2, DeepSpeed, a communication hook, the optimizer, DELTA, fault
tolerance, the TP / PP layout, the partitioner, the loss guard). It declares

* its **settings**: the fields it adds to the jobs' configs (``delta: DeltaConfig | None``), each a flag and a YAML
  key (``--delta.budget``); checked with the rest of the job config by :meth:`Section.validate`;
* its **clashes**: combinations it refuses, each a :class:`Clash` with the reason and the fix (one table for all
  sections, :func:`clashes`, from which docs/compose.md's "Clashes refused" table is generated);
* and its **hooks**, called by :class:`~hf_dtrain.run.job.JobRun` in the order of ``Section.order``: ``check``
  and ``answer`` before anything starts, ``trainer_args`` / ``callbacks`` / ``attach`` / ``resume`` for the Trainer,
  ``accelerator_kwargs`` / ``prepare`` / ``after_prepare`` / ``loader`` / ``forward_backward`` /
  ``before_optimizer_step`` / ``after_step`` / ``end`` for a plain loop, ``state`` for the snapshots, ``results``.

A section lives in its engine's folder (``hf_dtrain/<engine>/section.py``) and registers itself with
:func:`register_section`; :func:`discover` imports every such module (and the ``hf_dtrain.sections`` entry points of
other packages). Job configs are built from the registry (:func:`job_config_class`), so a registered section's flags
appear in ``hf-dtrain <job> --help`` without any edit to the job. This module imports neither torch nor an engine.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hf_dtrain.errors import SettingsError


@dataclass(frozen=True)
class Clash:
    """A combination a section refuses. ``combination`` and ``why`` are the row of docs/compose.md's table;
    ``refuse(view)`` returns the refusal (naming both sides and what to change) when ``view``'s settings hold the
    combination, else None. A clash without ``refuse`` is checked by its section's own validation (``validate`` or
    ``check``), which says so in its message."""

    combination: str
    why: str
    refuse: Callable[[ClashView], str | None] | None = None


@dataclass(frozen=True)
class ClashView:
    """What a clash is checked against: the job's settings (``cfg``), the process count, the job (``finetune``,
    ``pretrain``), whether the Trainer or a plain loop trains, the fine-tuning method's entry (or None), and the
    facts the sections derive from their settings (:meth:`Section.facts`: ``zero_stage``, ``exchanging``...)."""

    cfg: Any
    world_size: int
    job: str
    trainer: bool
    method: Any = None
    facts: dict = field(default_factory=dict)

    @classmethod
    def of(cls, cfg, world_size: int, method=None) -> ClashView:
        facts = {}
        for section in sections_for(cfg.job):
            facts.update(section.facts(cfg))
        return cls(cfg, world_size, cfg.job, cfg.trainer, method, facts)

    def fact(self, name: str, default=None):
        return self.facts.get(name, default)


class Section:
    """One engine's part of a job; subclasses declare their settings, clashes and hooks (every hook is optional)."""

    name: ClassVar[str] = ""  # its first setting's name, and its key in the results
    jobs: ClassVar[tuple[str, ...]] = ("finetune", "pretrain")  # the jobs whose configs hold its settings
    order: ClassVar[int] = 50  # hooks run in this order, lowest first
    clashes: ClassVar[tuple[Clash, ...]] = ()
    resume_hint: ClassVar[str] = ""  # added to "relaunch the same command to resume" when a rank dies
    shards_parameters: ClassVar[bool] = False  # each rank holds shards (FSDP2, ZeRO-3, a mesh), not replicas
    placement_keys: ClassVar[tuple[str, ...]] = ()  # its settings that say how the model is laid out, not what trains
    elsewhere: ClassVar[str] = ""  # said when a job that does not hold its settings is given one of its flags

    @classmethod
    def settings(cls) -> list[tuple[str, Any, dataclasses.Field]]:
        """``(name, type, dataclasses.field(...))`` of every field it adds to a job config (help text in
        ``metadata["help"]``)."""
        return []

    @classmethod
    def validate(cls, cfg) -> None:
        """Checks of its settings that need no world (at config construction); ``ValueError`` naming the flag."""

    @classmethod
    def short_flags(cls) -> list[tuple[str, str, dict]]:
        """``(flag, dest, argparse keywords)`` of its short forms (``--tp`` for ``--parallel.tp``)."""
        return []

    @classmethod
    def resolve(cls, cfg) -> None:
        """Adjust its settings from the launch environment before the clashes are checked (an Accelerate launch
        config that asks for FSDP)."""

    @classmethod
    def facts(cls, cfg) -> dict:
        """What other sections' clashes and activation may read of its settings (``{"zero_stage": 3}``)."""
        return {}

    @classmethod
    def planned_world(cls, cfg) -> int | None:
        """The world the job is checked and built for when it is planned, not launched (an estimate's
        ``--world-size``); None: the launcher's."""
        return None

    @classmethod
    def reads_no_data(cls, cfg) -> bool:
        """Whether the job, with its settings, reads no data (an estimate): its data paths are then not checked."""
        return False

    @classmethod
    def alternatives(cls, cfg, world_size: int) -> list[tuple[str, Any]]:
        """Changes of its settings that would lower each rank's memory, for a step that will not fit: ``(what to
        change, the job config with it)``."""
        return []

    @classmethod
    def active(cls, view: ClashView) -> bool:
        """Whether the section takes part in the run (default: its first setting is given)."""
        return getattr(view.cfg, cls.name, None) is not None

    @classmethod
    def empty_results(cls, trainer: bool) -> dict:
        """Its entries of ``results.json`` when it is off (``{"delta": None}``)."""
        return {}

    def __init__(self, run) -> None:
        self.run = run
        self.cfg = run.cfg

    # ---- before anything starts ----------------------------------------------------------------------------------
    def check(self) -> None:
        """Checks against the launched world and the machine, before any process group and the model."""

    def setup(self) -> None:
        """Once the process group exists, before the data and the model (a plan measured on the launched ranks)."""

    def untraceable(self) -> str | None:
        """Why a memory trace of the job's step (``--estimate``) cannot take this section as it runs, or None."""
        return None

    def review_trace(self, model, forward) -> list[str]:
        """After an estimate traced the step: notes on what the section does to it that the trace did not run
        (``forward()`` runs the step's forward once more on the traced model); may refuse (a budget that cannot be
        met)."""
        return []

    def account_trace(self, memory, model):
        """After an estimate traced the step: ``(memory, notes)`` with what the section holds that the trace could
        not run replaced by its own count (DeepSpeed's model states), or None to keep the trace's."""
        return None

    def traced_ranks(self) -> list[int]:
        """Ranks whose step differs from rank 0's in memory (a pipeline's last stage holds the head), each traced
        apart by an estimate; [] when rank 0 stands for all."""
        return []

    def answer(self):
        """Before the process group, with the job's ``run.skeleton``: the job's results when this section answers
        the job without training it (an estimate), or None. May refuse the run (a step that will not fit)."""
        return None

    # ---- the Trainer ---------------------------------------------------------------------------------------------
    def trainer_args(self, given: dict) -> dict:
        """What it sets in the Trainer's arguments (``given``: the user's); refuse a given one that contradicts."""
        return {}

    def callbacks(self) -> list:
        """Trainer callbacks."""
        return []

    def attach(self, trainer) -> None:
        """After the Trainer is built, before training (a hook on its DDP model, a check of what it enabled)."""

    def resume(self, trainer) -> str | None:
        """The checkpoint the Trainer resumes from, or None."""
        return None

    # ---- a plain loop --------------------------------------------------------------------------------------------
    def accelerator_kwargs(self) -> list:
        """Accelerate ``kwargs_handlers``."""
        return []

    def prepare(self, model):
        """Transform the model in place before the optimizer is built (shard it, lay it out, schedule its memory)."""

    def after_prepare(self, model, optimizer) -> None:
        """After Accelerate prepared the model and optimizer (a hook on the DDP model)."""

    def loader(self, train, batch_size: int):
        """The training loader, when this section deals the batches: a :class:`Loader`, or None."""
        return None

    def forward_backward(self, model, blocks, accelerator):
        """One step's forward and backward when this section runs them (a pipeline): the loss, or None."""
        return None

    def before_optimizer_step(self) -> None:
        """Between backward and the optimizer step."""

    def after_step(self, step: int, loss: float) -> None:
        """After the optimizer step of ``step``."""

    def end(self) -> None:
        """After the last step, on every rank."""

    def evaluate(self, model, held_out, batch_size: int, device):
        """The held-out loss when this section computes it (a pipeline, tensor-parallel shards), or None."""
        return None

    def evaluated(self, loss: float | None, step: int) -> None:
        """After the held-out loss is computed."""

    def save(self, model, output_dir: str) -> bool:
        """Save the model when this section holds it its own way (shards gathered by every rank, one file per
        pipeline stage); True if it did (the tokenizer and results are the run's)."""
        return False

    def close(self) -> None:
        """After everything is saved."""

    # ---- both ----------------------------------------------------------------------------------------------------
    def engine_name(self) -> str | None:
        """How the results name the engine when this section is the one that holds the model (``fsdp2``)."""
        return None

    def placement(self) -> dict:
        """Facts of how the model is laid over the ranks beyond its ``placement_keys`` settings (the degrees in
        force): a snapshot taken in another placement is the same job's, resharded on restore."""
        return {}

    def state(self) -> dict:
        """``{name: object with state_dict / load_state_dict}`` to keep in fault-tolerance snapshots."""
        return {}

    def results(self) -> dict:
        """Entries of the job's ``results.json``."""
        return {}


@dataclass
class Loader:
    """A training loader a section deals: the loader, this rank's batch, the loss scale and whether Accelerate
    should prepare it (shard it over the processes)."""

    loader: Any
    batch_size: int
    loss_scale: float = 1.0
    prepare: bool = False


SECTIONS: dict[str, type[Section]] = {}
_version = [0]  # bumped by every registration: job config classes are rebuilt from the registries


def register_section(cls: type[Section]) -> type[Section]:
    """Make a section known to the jobs (idempotent; registering a name again replaces it). Usable as a decorator."""
    if not (isinstance(cls, type) and issubclass(cls, Section)) or not cls.name.isidentifier():
        raise TypeError(f"register_section takes a Section subclass with a name, got {cls!r}.")
    SECTIONS[cls.name] = cls
    _version[0] += 1
    return cls


def unregister_section(name: str) -> None:
    if SECTIONS.pop(name, None) is not None:
        _version[0] += 1


def registry_version() -> int:
    return _version[0]


_discovered = [False]


def discover() -> None:
    """Import every ``hf_dtrain/<package>/section.py`` and the ``hf_dtrain.sections`` entry points of installed
    packages (each registers its sections), once."""
    if _discovered[0]:
        return
    _discovered[0] = True
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # hf_dtrain/
    for module in pkgutil.iter_modules([package]):  # read from the files: no package is imported to look
        if module.ispkg and os.path.exists(os.path.join(package, module.name, "section.py")):
            importlib.import_module(f"hf_dtrain.{module.name}.section")
    for entry in importlib.metadata.entry_points(group="hf_dtrain.sections"):
        entry.load()


def foreign_flag(job: str, argv: list[str]) -> str | None:
    """The refusal of the first flag in ``argv`` that belongs to a section of other jobs (one that says why it is not
    ``job``'s, in :attr:`Section.elsewhere`), or None."""
    discover()
    for section in SECTIONS.values():
        if job in section.jobs or not section.elsewhere:
            continue
        names = ["--" + name.replace("_", "-") for name, _, _ in section.settings()]
        names += [flag for flag, _, _ in section.short_flags()]
        for arg in argv:
            word = arg.split("=")[0]
            if word in names or any(word.startswith(name + ".") for name in names):
                return f"{word} is a {' / '.join(section.jobs)} flag: {section.elsewhere}"
    return None


def reads_no_data(cfg) -> bool:
    """A section says the job ``cfg`` reads no data (an estimate traces its step on fake tensors)."""
    return any(section.reads_no_data(cfg) for section in sections_for(cfg.job))


def sections_for(job: str) -> list[type[Section]]:
    """The registered sections whose settings the ``job``'s config holds, in hook order."""
    discover()
    return sorted((s for s in SECTIONS.values() if job in s.jobs), key=lambda s: (s.order, s.name))


def clashes(job: str | None = None) -> list[tuple[type[Section], Clash]]:
    """Every declared clash (of ``job``'s sections), in section order: the one table of cross-section refusals."""
    discover()
    out = []
    for section in sorted(SECTIONS.values(), key=lambda s: (s.order, s.name)):
        if job is None or job in section.jobs:
            out.extend((section, clash) for clash in section.clashes)
    return out


def check_clashes(view: ClashView) -> None:
    """Refuse the combinations ``view``'s settings hold, naming each clash and the fix, before anything starts."""
    found = []
    for _, clash in clashes(view.job):
        if clash.refuse is not None:
            text = clash.refuse(view)
            if text and text not in found:
                found.append(text)
    if found:
        raise SettingsError("These switches cannot be combined: " + "; ".join(found) + ".")


def clash_table() -> str:
    """docs/compose.md's "Clashes refused, and why" table, from the registry."""
    rows = ["| combination | why it is refused |", "|---|---|"]
    seen = set()
    for _, clash in clashes():
        if clash.combination not in seen:
            seen.add(clash.combination)
            rows.append(f"| {clash.combination} | {clash.why} |")
    return "\n".join(rows)


if __name__ == "__main__":  # docs/compose.md's "Clashes refused, and why" table (from the module the sections use)
    from hf_dtrain.run import section

    print(section.clash_table())
