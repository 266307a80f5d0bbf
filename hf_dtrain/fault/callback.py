"""``InMemoryFaultToleranceCallback``: the snapshot engine driven by Trainer events, and the restart path that hands
the restored state to the Trainer's own resume (so its data skipping and RNG hand-off stay exactly as in a checkpoint
resume)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from typing import Optional

import torch
from transformers import TrainerCallback

from .config import SnapshotConfig
from .snapshot import Restored, SnapshotEngine, SnapshotError, _unwrap, job_key_for

logger = logging.getLogger(__name__)


class InMemoryFaultToleranceCallback(TrainerCallback):
    """Snapshots every ``every_n_steps`` optimizer steps into the node's snapshot process::

        ft = InMemoryFaultToleranceCallback(SnapshotConfig(every_n_steps=1))
        trainer = Trainer(..., callbacks=[ft])
        trainer.train(resume_from_checkpoint=ft.resume_checkpoint(trainer))   # None on a fresh start

    ``resume_checkpoint`` restores the newest snapshot every rank has (memory, else parity, else disk; logged and in
    ``self.restored``) and writes it as a Trainer checkpoint in a private directory, which ``train`` then resumes
    from. Every setting is a field of :class:`~hf_dtrain.fault.SnapshotConfig` (also accepted as keywords:
    ``InMemoryFaultToleranceCallback(every_n_steps=1, parity=1)``)."""

    # TrainingArguments that change what is trained: part of the run identity every snapshot records
    IDENTITY_ARGS = ("seed", "data_seed", "learning_rate", "lr_scheduler_type", "warmup_steps", "warmup_ratio",
                     "weight_decay", "max_steps", "num_train_epochs", "per_device_train_batch_size",
                     "gradient_accumulation_steps", "optim", "adam_beta1", "adam_beta2", "adam_epsilon",
                     "max_grad_norm", "bf16", "fp16")

    def __init__(self, config: Optional[SnapshotConfig] = None, *, stateful: Optional[dict] = None,
                 identity: Optional[dict] = None, **settings):
        self.config = SnapshotConfig.from_any(config, **settings)
        self.identity = dict(identity or {})
        self.every_n_steps = self.config.every_n_steps
        self.stateful = dict(stateful or {})
        self.engine: Optional[SnapshotEngine] = None
        self.restored: Optional[Restored] = None
        self.snapshots = 0  # taken in this process's run (after train: the count)

    def add_stateful(self, name: str, obj) -> None:
        """Keep ``obj`` (``state_dict()`` / ``load_state_dict()``) in every snapshot, for example a communication
        hook's error feedback; call before ``resume_checkpoint``."""
        if self.engine is not None:
            raise RuntimeError("add_stateful() must come before resume_checkpoint() and train().")
        self.stateful[name] = obj

    def _engine(self, model, args, train_dataset=None) -> SnapshotEngine:
        """The engine, keyed to this job: its directory derived from ``args.output_dir``, its identity from the
        training arguments that change what is trained, the training set's fingerprint and ``identity=``."""
        if self.engine is None:
            identity = {"trainer": {k: getattr(args, k, None) for k in self.IDENTITY_ARGS}, "job": self.identity}
            if train_dataset is not None:
                identity["train_dataset"] = getattr(train_dataset, "_fingerprint", None) or len(train_dataset)
            self.engine = SnapshotEngine(model, config=self.config, stateful=self.stateful, identity=identity,
                                         job_key=job_key_for(args.output_dir))
        return self.engine

    def resume_checkpoint(self, trainer) -> Optional[str]:
        """Restore before ``trainer.train``; returns the checkpoint directory to resume from, or ``None``."""
        trainer.args.device  # noqa: B018  (sets up the process group, as Trainer does)
        engine = self._engine(trainer.model, trainer.args, trainer.train_dataset)
        restored = engine.restore(apply=False)
        self.restored = restored
        if restored is None:
            return None
        if restored.source == "completed":
            raise SnapshotError(f"This job already completed ({restored.detail}); its snapshots are gone. To train "
                                "it again, relaunch with --fault-tolerance.fresh-start true "
                                "(InMemoryFaultToleranceCallback(fresh_start=True)).")
        state = restored.state
        for name, obj in engine.stateful.items():  # e.g. the comm hook's state (CommHookCallback applies it later)
            if name in state.get("stateful", {}):
                obj.load_state_dict(state["stateful"][name])
        out = os.path.join(engine.dir, f"resume-rank{engine.rank}", f"checkpoint-{restored.step}")
        shutil.rmtree(os.path.dirname(out), ignore_errors=True)
        os.makedirs(out, mode=0o700)
        model = _unwrap(trainer.model)
        with torch.no_grad():
            live = engine._model_state()
            for name, t in state["model"].items():
                live[name].copy_(t)
        model.save_pretrained(out, safe_serialization=True)
        # the files Trainer._save_checkpoint writes; Trainer loads them with torch.load(weights_only=True)
        torch.save(state["optimizer"], os.path.join(out, "optimizer.pt"))
        if "scheduler" in state:
            torch.save(state["scheduler"], os.path.join(out, "scheduler.pt"))
        rng = state["rng"]
        rng_file = "rng_state.pth" if engine.world == 1 else f"rng_state_{engine.rank}.pth"
        torch.save({"python": rng["python"], "numpy": rng["numpy"], "cpu": rng["torch"],
                    **({"cuda": rng["cuda"]} if "cuda" in rng else {})}, os.path.join(out, rng_file))
        with open(os.path.join(out, "trainer_state.json"), "w") as f:
            f.write(restored.extra["trainer_state"])
        logger.warning("resuming from step %d restored from %s (%s)", restored.step, restored.source,
                       restored.detail)
        return out

    # ---------------------------------------------------------------- Trainer events
    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        engine = self._engine(model, args)
        engine.optimizer, engine.scheduler = optimizer, lr_scheduler

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.engine is not None:
            self.engine.wait()  # the copy in flight reads what this step is about to change

    def on_step_end(self, args, state, control, **kwargs):
        if self.engine is not None and state.global_step % self.every_n_steps == 0:
            trainer_state = json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"
            self.engine.snapshot(state.global_step, extra={"trainer_state": trainer_state})

    def on_train_end(self, args, state, control, **kwargs):
        if self.engine is not None:
            self.engine.wait()
            self.snapshots = self.engine.stats["snapshots"]
            self.engine.close(shutdown=True)  # the run is over: its snapshots are no longer needed
            self.engine = None
