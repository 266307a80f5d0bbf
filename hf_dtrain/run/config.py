"""Job configs: each job's own settings (a dataclass subclassing :class:`JobConfig`) plus every registered section's,
built into one class from the registries (:func:`job_config_class`): a section or method registered before a job's
config is used gets its flags and YAML keys with no edit to the job."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

from hf_dtrain.settings import build, check_fields, coerce_section, sections

from .section import registry_version, sections_for

_classes: dict[tuple, type] = {}


@dataclasses.dataclass
class JobConfig:
    """What every job config does on construction: its plain fields checked against their annotations and bounds,
    sections given as plain data built (``comm_hook="acp_sgd"``), the job's own checks (:meth:`check_own`), then
    each section's (``Section.validate``)."""

    job: ClassVar[str] = ""
    trainer: ClassVar[bool] = False  # the Trainer trains it (else a plain loop)

    def __post_init__(self):
        check_fields(self)
        for name, _, _ in sections(type(self)):
            coerce_section(self, name)
        self.check_own()
        for section in sections_for(self.job):
            section.validate(self)

    def check_own(self) -> None:
        """The job's own checks of its fields."""

    def collective_timeout(self) -> float:
        """Seconds a collective of the job's process group waits for the other ranks before it fails (torch's
        default, 1800; a job with its own setting answers with it)."""
        return 1800.0

    @classmethod
    def from_dict(cls, data: dict | None, where: str | None = None):
        """The config from plain data (a YAML recipe, JSON, the CLI's parsed flags): sections as mappings or their
        short forms, unknown keys refused naming the valid ones."""
        data = {str(k).replace("-", "_"): v for k, v in (data or {}).items()}
        return build(cls, data, where or cls.__name__)


def job_config_class(
    base: type, extra: Callable[[], list] | None = None, extra_version: Callable[[], Any] | None = None
):
    """``base`` (a :class:`JobConfig` subclass holding the job's own fields) with every registered section's settings
    for ``base.job`` and ``extra()``'s fields (another registry of the job's: the fine-tuning methods' sections),
    built once per state of the registries (``extra_version()`` says when the other registry changed)."""
    sections_for(base.job)  # (every section found before the registry's state is read)
    key = (base, registry_version(), extra_version() if extra_version else None)
    if key not in _classes:
        fields: list[tuple[str, Any, dataclasses.Field]] = [f for s in sections_for(base.job) for f in s.settings()]
        fields += extra() if extra else []
        own = {f.name for f in dataclasses.fields(base)}
        twice = sorted({name for name, _, _ in fields if name in own})
        if twice:
            raise TypeError(f"{base.__name__}: sections declare settings the job has already: {twice}.")
        cls = dataclasses.make_dataclass(base.__name__.removesuffix("Job") + "Config", fields, bases=(base,))
        cls.__module__ = base.__module__
        cls.__doc__ = base.__doc__
        _classes[key] = cls
    return _classes[key]
