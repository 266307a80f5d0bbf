"""In-memory fault tolerance's section of the jobs (``--fault-tolerance.*``): snapshots held by a snapshot process per
node; a relaunched job resumes from them (the Trainer through its own resume, a plain loop in place, resharded when
the placement changed)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import field

from hf_dtrain.errors import SettingsError
from hf_dtrain.run.section import Section, register_section

from .config import SnapshotConfig

# job fields (and Trainer settings, in a fine-tuning job's ``training``) that do not change what is trained: left out
# of the run identity a snapshot records
NOT_IDENTITY = (
    "output_dir",
    "logging_steps",
    "progress",
    "report",
    "save_model",
    "fault_tolerance",
    "report_to",
    "disable_tqdm",
    "resume_from_checkpoint",
    "logging_dir",
    "logging_strategy",
    "run_name",
)


def run_identity(cfg, placement: tuple = ()) -> dict:
    """What identifies a job for its snapshots: every field of its config except how it reports and where it
    writes (``NOT_IDENTITY``) and the ``placement`` fields; a restore into a job whose identity differs is refused
    naming the difference."""
    out = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_IDENTITY and k not in placement}
    if isinstance(out.get("training"), dict):
        out["training"] = {k: v for k, v in out["training"].items() if k not in NOT_IDENTITY}
    return out


def snapshot_config_for(config: SnapshotConfig, output_dir: str) -> SnapshotConfig:
    """The jobs' one default on top of the user's config: disk snapshots go under ``<output_dir>/snapshots`` when
    ``persist_every`` or ``preempt_deadline`` is set (a preemption notice writes the step it stops after) and
    ``persist_dir`` is not."""
    if (config.persist_every or config.preempt_deadline) and not config.persist_dir:
        return dataclasses.replace(config, persist_dir=os.path.join(output_dir, "snapshots"))
    return config


@register_section
class FaultToleranceSection(Section):
    """``--fault-tolerance``: snapshots every ``every_n_steps`` steps; a relaunch restores the newest every rank has
    (memory, parity, disk), and a completed job is not trained again."""

    name = "fault_tolerance"
    order = 95  # after every section whose state it keeps, and after the loss guard has checked a step
    resume_hint = " from the snapshot processes, which keep the state"

    @classmethod
    def settings(cls):
        help = (
            "In-memory snapshots held by a snapshot process per node, erasure coded across nodes; a relaunched run "
            "resumes from them (hf_dtrain.fault). None: off."
        )
        return [("fault_tolerance", SnapshotConfig | None, field(default=None, metadata={"help": help}))]

    @classmethod
    def empty_results(cls, trainer: bool) -> dict:
        return {"fault_tolerance": None}

    def __init__(self, run) -> None:
        super().__init__(run)
        self.callback = None  # the Trainer's
        self.engine = None  # a plain loop's
        self.restored = None

    def check(self) -> None:
        from .wire import private_dir

        if self.cfg.fault_tolerance.directory:  # a shared or foreign directory refused now, not after the model loads
            try:
                private_dir(self.cfg.fault_tolerance.directory)
            except PermissionError as e:
                raise SettingsError(str(e)) from None

    def _config(self) -> SnapshotConfig:
        return snapshot_config_for(self.cfg.fault_tolerance, self.run.output_dir)

    # ---- the Trainer ---------------------------------------------------------------------------------------------
    def callbacks(self) -> list:
        from .callback import InMemoryFaultToleranceCallback

        self.callback = InMemoryFaultToleranceCallback(self._config(), identity=run_identity(self.cfg))
        return [self.callback]

    def attach(self, trainer) -> None:
        for name, obj in self.run.stateful().items():  # e.g. the comm hook's error feedback
            self.callback.add_stateful(name, obj)

    def resume(self, trainer) -> str | None:
        return self.callback.resume_checkpoint(trainer)

    # ---- a plain loop --------------------------------------------------------------------------------------------
    def after_prepare(self, model, optimizer) -> None:
        """Restore the newest snapshot into what this rank trains (its tensor-parallel shards, its pipeline stages)
        and set where the loop starts; a completed job sets the previous results instead."""
        from .snapshot import SnapshotEngine, job_key_for

        placement = self.run.placement()
        self.engine = SnapshotEngine(
            self.run.trained,
            optimizer,
            self.run.scheduler,
            config=self._config(),
            stateful=self.run.stateful() or None,
            identity=run_identity(self.cfg, tuple(placement)),
            placement=placement,
            job_key=job_key_for(self.run.output_dir),
        )
        restored = self.restored = self.engine.restore()
        if restored is not None and restored.source == "completed":
            if self.run.is_main:
                print(
                    f"this job already completed ({restored.detail}); nothing to do. To run it again, relaunch with "
                    "--fault-tolerance.fresh-start true",
                    flush=True,
                )
            self.engine.close()
            self.engine = None
            previous = os.path.join(self.run.output_dir, f"results_rank{self.run.rank}.json")
            self.run.completed = json.load(open(previous)) if os.path.exists(previous) else None
            self.run.start_step = None
            return
        if restored is not None:
            if self.run.is_main:
                print(f"resumed after step {restored.step} from {restored.source} ({restored.detail})", flush=True)
            self.run.start_step = restored.extra["next_step"]

    def before_optimizer_step(self) -> None:
        if self.engine is not None:
            self.engine.wait()  # the snapshot in flight reads what this step changes

    def after_step(self, step: int, loss: float) -> None:
        if self.engine is None:
            return
        if step % self.cfg.fault_tolerance.every_n_steps == 0:
            self.engine.snapshot(step, extra={"next_step": step + 1})
        signum = self.engine.notice()  # a preemption notice on any rank: every rank stops after this step
        if signum:
            self.engine.stop_for_notice(step, {"next_step": step + 1}, signum)

    def end(self) -> None:
        if self.engine is not None:
            self.engine.wait()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close(shutdown=True)

    def results(self) -> dict:
        if self.callback is not None:
            restored = self.callback.restored
            return {
                "fault_tolerance": {
                    "snapshots": self.callback.snapshots,
                    "restored": None if restored is None else {"step": restored.step, "source": restored.source},
                }
            }
        restored = self.restored
        return {
            "fault_tolerance": {
                "snapshots": self.engine.stats["snapshots"],
                "snapshot_bytes": self.engine.stats["bytes"],
                "restored": None if restored is None else {"step": restored.step, "source": restored.source},
            }
        }
