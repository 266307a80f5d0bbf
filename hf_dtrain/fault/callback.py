"""``InMemoryFaultToleranceCallback``: the snapshot engine driven by Trainer events, and the restart path that hands
the restored state to the Trainer's own resume (so its data skipping and RNG hand-off stay exactly as in a checkpoint
resume)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil

import torch
from transformers import TrainerCallback

from hf_dtrain.errors import RunFailure, SettingsError

from .config import SnapshotConfig
from .snapshot import Restored, SnapshotEngine, SnapshotError, SnapshotMismatch, job_key_for

logger = logging.getLogger(__name__)


class InMemoryFaultToleranceCallback(TrainerCallback):
    """Snapshots every ``every_n_steps`` optimizer steps into the node's snapshot process::

        ft = InMemoryFaultToleranceCallback(SnapshotConfig(every_n_steps=1))
        trainer = Trainer(..., callbacks=[ft])
        trainer.train(resume_from_checkpoint=ft.resume_checkpoint(trainer))   # None on a fresh start

    ``resume_checkpoint`` restores the newest snapshot every rank has (memory, else parity, else disk; logged and in
    ``self.restored``) and returns a private directory with the Trainer's progress and RNG states, which ``train``
    resumes from (data position, log history); ``train`` gets the model's and optimizer's state in place, each rank
    its own tensors, so DDP replicas, PEFT adapters and FSDP2 shards (hf_dtrain's or Accelerate's) resume alike.
    Every setting is a field of :class:`~hf_dtrain.fault.SnapshotConfig` (also accepted as keywords:
    ``InMemoryFaultToleranceCallback(every_n_steps=1, parity=1)``)."""

    # TrainingArguments that change what is trained: part of the run identity every snapshot records
    IDENTITY_ARGS = (
        "seed",
        "data_seed",
        "learning_rate",
        "lr_scheduler_type",
        "warmup_steps",
        "warmup_ratio",
        "weight_decay",
        "max_steps",
        "num_train_epochs",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "optim",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
        "max_grad_norm",
        "bf16",
        "fp16",
    )

    def __init__(
        self,
        config: SnapshotConfig | None = None,
        *,
        stateful: dict | None = None,
        identity: dict | None = None,
        **settings,
    ):
        self.config = SnapshotConfig.from_any(config, **settings)
        self.identity = dict(identity or {})
        self.every_n_steps = self.config.every_n_steps
        self.stateful = dict(stateful or {})
        self.engine: SnapshotEngine | None = None
        self.restored: Restored | None = None
        self.snapshots = 0  # taken in this process's run (after train: the count)
        self._deferred: int | None = None  # a step whose snapshot waits for the Trainer's log of it (on_log)
        self._notice = 0  # a preemption notice agreed at this step boundary (the signal), acted on with its snapshot
        self._trainer = None  # whose checkpoint loaders resume_checkpoint replaced until train() begins

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
            self.engine = SnapshotEngine(
                model,
                config=self.config,
                stateful=self.stateful,
                identity=identity,
                job_key=job_key_for(args.output_dir),
            )
        return self.engine

    def resume_checkpoint(self, trainer) -> str | None:
        """Restore before ``trainer.train``; returns the checkpoint directory to resume from, or ``None``."""
        if getattr(trainer, "is_deepspeed_enabled", False):  # before any snapshot process or collective
            raise SettingsError(
                "InMemoryFaultToleranceCallback with DeepSpeed under the Trainer: the Trainer resumes "
                "DeepSpeed from DeepSpeed's own checkpoint, which the in-memory snapshot does not write; "
                "use SnapshotEngine(engine, engine.optimizer) in your own DeepSpeed loop (ZeRO-1/2/3), "
                "or FSDP2 / DDP with the Trainer."
            )
        trainer.args.device  # noqa: B018  (sets up the process group, as Trainer does)
        engine = self._engine(trainer.model, trainer.args, trainer.train_dataset)
        restored = engine.restore(apply=False)
        self.restored = restored
        if restored is None:
            return None
        if restored.source == "completed":
            raise SnapshotError(
                f"This job already completed ({restored.detail}); its snapshots are gone. To train "
                "it again, relaunch with --fault-tolerance.fresh-start true "
                "(InMemoryFaultToleranceCallback(fresh_start=True))."
            )
        if restored.source in ("resharded", "memory-resharded"):
            raise SnapshotMismatch(
                f"This job's snapshots were taken on another world size ({restored.detail}). Under the Trainer, "
                "InMemoryFaultToleranceCallback resumes on the number of processes that took them: relaunch with "
                "that many, or train from step 0 with --fault-tolerance.fresh-start true "
                "(InMemoryFaultToleranceCallback(fresh_start=True)). hf-dtrain pretrain and SnapshotEngine in your "
                "own loop reshard onto another world size."
            )
        state = restored.state
        for name, obj in engine.stateful.items():  # e.g. the comm hook's state (CommHookCallback applies it later)
            if name in state.get("stateful", {}):
                obj.load_state_dict(state["stateful"][name])
        # the Trainer's resume reads its progress (data position, log history) and each rank's RNG streams from a
        # checkpoint directory: those two files, written privately; the model and optimizer are loaded in place
        out = os.path.join(engine.dir, f"resume-rank{engine.rank}", f"checkpoint-{restored.step}")
        shutil.rmtree(os.path.dirname(out), ignore_errors=True)
        os.makedirs(out, mode=0o700)
        rng = state["rng"]
        rng_file = "rng_state.pth" if engine.world == 1 else f"rng_state_{engine.rank}.pth"
        # the Trainer loads it with torch.load(weights_only=True)
        torch.save(
            {
                "python": rng["python"],
                "numpy": rng["numpy"],
                "cpu": rng["torch"],
                **({"cuda": rng["cuda"]} if "cuda" in rng else {}),
            },
            os.path.join(out, rng_file),
        )
        with open(os.path.join(out, "trainer_state.json"), "w") as f:
            f.write(restored.extra["trainer_state"])
        self._hand_over(trainer, engine, state)
        logger.warning("resuming from step %d restored from %s (%s)", restored.step, restored.source, restored.detail)
        return out

    # the Trainer methods that load a checkpoint's model and optimizer (transformers 5.x)
    TRAINER_LOADERS = ("_load_from_checkpoint", "_load_optimizer_and_scheduler")

    def _hand_over(self, trainer, engine: SnapshotEngine, state: dict) -> None:
        """Load the restored state where the Trainer loads a checkpoint's, in place: the model when ``train`` loads
        it (before Accelerate's ``prepare``, or after it when Accelerate shards the model with FSDP2), the optimizer
        and scheduler once ``train`` has built them. Each rank loads its own tensors (FSDP2's local shards, the
        optimizer's state as DTensor shards), so nothing is gathered or written to disk; a Trainer checkpoint could
        not hold FSDP2 shards laid out by hf_dtrain. This trainer's two loaders are replaced for this resume only
        (``on_train_begin`` puts the Trainer's back)."""
        missing = [name for name in self.TRAINER_LOADERS if not callable(getattr(type(trainer), name, None))]
        if missing:
            raise RunFailure(
                f"this transformers release's Trainer has no {', '.join(missing)}, where the callback "
                "loads the restored state; use the transformers release hf_dtrain supports "
                "(pyproject.toml)"
            )

        def load_model(checkpoint, model=None):
            engine.apply_model(state)

        def load_optimizer_and_scheduler(checkpoint):
            engine.optimizer, engine.scheduler = trainer.optimizer, trainer.lr_scheduler
            engine.apply_optimizer(state)
            if trainer.lr_scheduler is not None and "scheduler" in state:
                trainer.lr_scheduler.load_state_dict(state["scheduler"])

        trainer._load_from_checkpoint = load_model
        trainer._load_optimizer_and_scheduler = load_optimizer_and_scheduler
        self._trainer = trainer
        progress = json.loads(self.restored.extra["trainer_state"])
        last = progress.get("max_steps") or 0
        if 0 < last <= progress["global_step"] and callable(getattr(type(trainer), "_run_epoch", None)):
            # restored after the last step: train() would still run one more (its loop tests for the end after a
            # step); it runs no epoch instead, and ends as the uninterrupted run did
            trainer._run_epoch = lambda *args, **kwargs: None

    def _give_back_loaders(self) -> None:
        trainer = self._trainer
        if trainer is not None:
            for name in self.TRAINER_LOADERS:
                trainer.__dict__.pop(name, None)

    # ---------------------------------------------------------------- Trainer events
    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        self._give_back_loaders()  # train() has loaded the restored state by now
        engine = self._engine(model, args)
        engine.optimizer, engine.scheduler = optimizer, lr_scheduler
        if self._trainer is not None:  # restored: DDP (Accelerate wrapped the model in prepare) rebuilds its buckets
            from .ddp import rebuild_ddp_buckets

            rebuild_ddp_buckets(self._trainer.model_wrapped)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.engine is not None:
            if self._deferred is not None:  # the Trainer did not log that step: its state is gone by now (RNGs)
                logger.warning("no snapshot of step %d: the Trainer did not log it after on_step_end", self._deferred)
                self._deferred = None
            self.engine.wait()  # the copy in flight reads what this step is about to change

    def on_step_end(self, args, state, control, **kwargs):
        if self.engine is None:
            return
        self._notice = self.engine.notice()  # a preemption notice on any rank: every rank stops after this step
        if state.global_step % self.every_n_steps and not self._notice:
            return
        if control.should_log:
            # the Trainer logs this step's loss right after on_step_end: the snapshot is taken in on_log, so the
            # restored log history holds this step's line (nothing the snapshot holds changes in between)
            self._deferred = state.global_step
            return
        self._snapshot(state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._take_deferred(state)

    def _take_deferred(self, state) -> None:
        if self._deferred is not None and self._deferred == state.global_step:
            self._snapshot(state)
        self._deferred = None

    def _snapshot(self, state) -> None:
        trainer_state = json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"
        extra = {"trainer_state": trainer_state}
        if self._notice:  # the snapshot of this step, on disk, then the exit
            self.engine.stop_for_notice(state.global_step, extra, self._notice)
        self.engine.snapshot(state.global_step, extra=extra)

    def on_train_end(self, args, state, control, **kwargs):
        if self._trainer is not None:
            self._trainer.__dict__.pop("_run_epoch", None)
            self._trainer = None
        if self.engine is not None:
            self._take_deferred(state)
            self.engine.wait()
            self.snapshots = self.engine.stats["snapshots"]
            self.engine.close(shutdown=True)  # the run is over: its snapshots are no longer needed
            self.engine = None
