"""The run of one job, over its sections (torchtitan's ``train.py`` has this shape)::

    run = JobRun(cfg, skeleton=...)               # clashes refused, sections checked, then the process group
    if run.answered is not None: return ...       # a section answered without training (an estimate)
    with run.main_first():                        # rank 0 builds or downloads first, the others read the cache
        ...
    run.prepare(model)                            # the sections transform the model (DELTA, the mesh, FSDP2...)
    optimizer = run.optimizer(model, lr, wd)      # the optimizer section's (None: the Trainer builds AdamW)
    callbacks = run.callbacks(); run.attach(trainer)        # the Trainer's way in
    run.after_prepare(model, optimizer); run.train_step...  # a plain loop's
    with run.guard(step_of=lambda: step):         # a dead rank named, with the resume hint
        ...
    run.finish(model, tokenizer, output_dir, results)       # sharded or rank-0 save, results.json, a barrier

The run names no section: every call goes to the registered sections that are active for this job's settings, in
their order (:mod:`hf_dtrain.run.section`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable

from .section import ClashView, check_clashes, sections_for


class JobRun:
    """One job's run over its active sections. ``cfg`` is the job's config (``cfg.job`` names the job; ``cfg.trainer``
    says whether the Trainer trains it; a fine-tuning job's ``cfg.method_entry`` is its method, whose own settings
    section is ``cfg.method_settings``).

    Everything that can be refused is refused before any process group: the launch environment resolved, the
    clashes, each active section's ``check``, a section's ``answer`` (given the job's ``skeleton``: a step that will
    not fit). ``start=False`` stops there (the refusal tests and ``--help``-like
    tools), with ``world_size`` instead of the launcher's."""

    def __init__(
        self,
        cfg,
        output_dir: str | None = None,
        world_size: int | None = None,
        start: bool = True,
        skeleton: Callable | None = None,
    ):
        self.cfg, self.job, self.trainer = cfg, cfg.job, cfg.trainer
        self.method = getattr(cfg, "method_entry", None)
        self.method_settings = getattr(cfg, "method_settings", None)
        self.output_dir = output_dir if output_dir is not None else getattr(cfg, "output_dir", None)
        # what the job trains, without weights or data (a picklable callable returning an estimate's Skeleton)
        self.skeleton = skeleton
        classes = sections_for(self.job)
        # the launcher's world (PartialState can report 1 under accelerate launch on CPU), or the one a section plans
        planned = [w for cls in classes if (w := cls.planned_world(cfg)) is not None]
        self.world_size = world_size or (planned[0] if planned else int(os.environ.get("WORLD_SIZE", "1") or 1))
        self.rank = int(os.environ.get("RANK", "0") or 0)
        self.is_main = self.rank == 0
        self.wire_key = "comm" if self.trainer else "wire"  # where the results report bytes on the wire
        # what the sections hand each other while the run is built
        self.mesh = None  # the layout's DeviceMesh
        self.tracing = False  # an estimate traces the step on fake tensors (sections skip what only a run does)
        self.replica_group = None  # HSDP's replica process group, when a section carries that exchange itself
        self.trained = None  # the module whose parameters train (a plain loop's)
        self.scheduler = None  # a plain loop's learning-rate schedule
        self.start_step = 1  # where a plain loop starts (a restored snapshot moves it; None: nothing left to do)
        self.completed = None  # a completed job's previous results
        self.monitor = None
        for cls in classes:
            cls.resolve(cfg)
        self.view = ClashView.of(cfg, self.world_size, self.method)
        check_clashes(self.view)
        self.sections = [cls(self) for cls in classes if cls.active(self.view)]
        self._call("check")
        # a section may answer the job without training it (an estimate): the job returns these results
        self.answered = self.first("answer") if skeleton is not None else None
        if start and self.answered is None:
            self.start()

    def start(self) -> None:
        """The process group (Accelerate's ``PartialState``), then the sections' ``setup``."""
        from datetime import timedelta

        import torch
        from accelerate import PartialState

        from hf_dtrain.distributed.groups import init_distributed

        timeout = timedelta(seconds=self.cfg.collective_timeout())  # the job's, for every collective
        init_distributed(timeout=timeout)  # under torchrun's / accelerate's restarts: the generation's own store keys
        self.state = PartialState(cpu=not torch.cuda.is_available(), timeout=timeout)
        self.device = self.state.device
        self._call("setup")

    # ---- what the sections say about the run ---------------------------------------------------------------------
    def _call(self, hook: str, *args) -> list:
        return [getattr(section, hook)(*args) for section in self.sections]

    def any_active(self, attribute: str) -> bool:
        """Whether an active section declares ``attribute`` (``carries_replica_exchange``)."""
        return any(getattr(section, attribute, False) for section in self.sections)

    def first(self, hook: str, *args):
        """The first non-None answer of the sections to ``hook``."""
        for section in self.sections:
            value = getattr(section, hook)(*args)
            if value is not None:
                return value
        return None

    @property
    def sharded(self) -> bool:
        """A section holds shards of the parameters (FSDP2, ZeRO-3, a mesh), not replicas."""
        return any(section.shards_parameters for section in self.sections)

    @property
    def laid_out(self) -> bool:
        """A section laid the model out on a mesh itself: Accelerate must not wrap it."""
        return self.mesh is not None

    @property
    def engine(self) -> str:
        """The engine that holds the model, for the results: the first section that names one, else DDP."""
        return self.first("engine_name") or ("ddp" if self.world_size > 1 else "single process")

    @property
    def replicas(self) -> int:
        """Data-parallel replicas (each its own batches): the layout's, else one per process."""
        for section in self.sections:
            if hasattr(section, "replicas"):
                return section.replicas
        return self.world_size

    def main_first(self):
        """Rank 0 first (it builds the default base model or fills a cache), then the others."""
        return self.state.main_process_first()

    # ---- the hooks, in section order -----------------------------------------------------------------------------
    def trainer_args(self, given: dict) -> dict:
        out = {}
        for section in self.sections:
            out.update(section.trainer_args(given))
        return out

    def accelerator_kwargs(self) -> list:
        return [handler for section in self.sections for handler in section.accelerator_kwargs()]

    def prepare(self, model) -> None:
        self._call("prepare", model)

    def optimizer(self, model, lr: float, weight_decay: float):
        """The optimizer over ``model``'s trainable parameters (None: the Trainer builds its own AdamW)."""
        for section in self.sections:
            if hasattr(section, "optimizer"):
                return section.optimizer(model, lr, weight_decay)
        return None

    def callbacks(self) -> list:
        return [cb for section in self.sections for cb in section.callbacks()]

    def attach(self, trainer) -> None:
        self._call("attach", trainer)

    def resume(self, trainer, default=None):
        """The checkpoint the Trainer resumes from: a section's (a restored snapshot), else ``default``."""
        found = self.first("resume", trainer)
        return found if found is not None else default

    def after_prepare(self, model, optimizer) -> None:
        self._call("after_prepare", model, optimizer)

    def loader(self, train, batch_size: int):
        return self.first("loader", train, batch_size)

    def forward_backward(self, model, blocks, accelerator):
        return self.first("forward_backward", model, blocks, accelerator)

    def before_optimizer_step(self) -> None:
        self._call("before_optimizer_step")

    def after_step(self, step: int, loss: float) -> None:
        self._call("after_step", step, loss)

    def end(self) -> None:
        self._call("end")

    def evaluate(self, model, held_out, batch_size: int):
        return self.first("evaluate", model, held_out, batch_size, self.device)

    def evaluated(self, loss, step: int) -> None:
        self._call("evaluated", loss, step)

    def stateful(self) -> dict:
        """What the sections keep in fault-tolerance snapshots besides the model and optimizer."""
        out = {}
        for section in self.sections:
            out.update(section.state())
        return out

    def placement(self) -> dict:
        """How the model is laid over the ranks: every section's placement settings (active or not) and what the
        active ones add (the degrees in force)."""
        out = {}
        for cls in sections_for(self.job):
            for key in cls.placement_keys:
                value = getattr(self.cfg, key, None)
                out[key] = value if not hasattr(value, "__dataclass_fields__") else _plain(value)
        for section in self.sections:
            out.update(section.placement())
        return out

    def results(self) -> dict:
        """The sections' entries of ``results.json`` (an inactive section's say it is off)."""
        out = {}
        for cls in sections_for(self.job):
            for key, value in cls.empty_results(self.trainer).items():
                out.setdefault(key, value)
        for section in self.sections:
            for key, value in section.results().items():
                if value is not None or key not in out:
                    out[key] = value
        return {**out, "engine": self.engine}

    def close(self) -> None:
        self._call("close")
        self.close_guard()

    # ---- ranks and the end ---------------------------------------------------------------------------------------
    def guard(self, step_of: Callable[[], int] | None = None):
        """With 2+ ranks, a :class:`~hf_dtrain.distributed.RankMonitor`: a rank that dies makes the others exit
        naming it, with the hint to relaunch (and where the state is kept, as the sections say)."""
        if self.world_size < 2:
            return contextlib.nullcontext()
        from hf_dtrain.distributed.groups import RankMonitor

        hint = "relaunch the same command to resume" + "".join(s.resume_hint for s in self.sections)
        self.monitor = RankMonitor(resume_hint=hint)
        self.monitor.step_of = step_of
        return self.monitor.guard()

    def close_guard(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None

    def finish(self, model, tokenizer, output_dir: str, results: dict, save_model: bool = True, write=None) -> None:
        """Save ``model`` (a section that holds it sharded or laid out saves it: every rank gathers and rank 0
        writes, or one file per pipeline stage; else rank 0 alone) and its tokenizer, write ``results.json`` and call
        ``write`` on rank 0, then wait for every rank."""
        saved = save_model and any(section.save(model, output_dir) for section in self.sections)
        if self.is_main:
            os.makedirs(output_dir, exist_ok=True)
            if save_model:
                if not saved:
                    model.save_pretrained(output_dir)
                if tokenizer is not None:
                    tokenizer.save_pretrained(output_dir)
            with open(os.path.join(output_dir, "results.json"), "w") as f:
                json.dump(results, f, indent=2, default=str)
            if write is not None:
                write()
        self.state.wait_for_everyone()


def _plain(config) -> dict:
    return dataclasses.asdict(config)
