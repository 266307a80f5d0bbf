"""The HF Trainer's way in: the Trainer has no comm-hook option and its callbacks only see the unwrapped model, so the
callback is attached to a trainer and registers on ``trainer.model_wrapped`` (the DDP model) at ``on_train_begin``,
before the first backward.

EmbRace: ``attach`` excludes the embeddings from DDP at once (the Trainer wraps the model inside ``train()``). DeAR:
the deferred update is applied before every save, evaluation, and at the end of training; the Trainer's gradient
clipping would clip local gradients, so DeAR needs ``max_grad_norm=0``. An optimizer with per-rank state
(``OneBitLamb``, torch's ``ZeroRedundancyOptimizer``) is consolidated on rank 0 before every save, since the Trainer
writes rank 0's optimizer state only."""

from transformers import TrainerCallback

from hf_dtrain.errors import SettingsError

from ..distributed.engines import unwrap_optimizer
from .config import CommHookConfig
from .embrace import exclude_embeddings
from .embrace_sharded import clip_sharded_grad_norm_, shard_embeddings, unshard_embeddings
from .hooks import register


def _clip_across_shards(trainer) -> None:
    """The Trainer clips with ``accelerator.clip_grad_norm_``, whose norm is each rank's own: with sharded tables
    the ranks would scale their dense gradients differently and drift apart. This accelerator clips with the norm
    summed over the shards instead (the Trainer also logs that norm as ``grad_norm``)."""
    accelerator, model = trainer.accelerator, trainer.model

    def clip(parameters, max_norm, norm_type=2):
        accelerator.unscale_gradients()  # a GradScaler's scale comes off first, as accelerate's own does
        return clip_sharded_grad_norm_(parameters, max_norm, model, norm_type)

    accelerator.clip_grad_norm_ = clip


class CommHookCallback(TrainerCallback):
    """Register an hf_dtrain communication hook on the Trainer's DDP model.

    ``CommHookCallback.attach(trainer, {"method": "acp_sgd", "rank": 4})`` (or ``trainer.add_callback(cb)`` after
    ``cb = CommHookCallback(config); cb.trainer = trainer``). After training, ``callback.state.stats.steps`` holds the
    bytes put on the wire per optimizer step.
    """

    def __init__(self, config: CommHookConfig | dict | str | None = None):
        self.config = CommHookConfig.from_any(config)
        self.trainer = None
        self.state = None
        self._pending = None

    @classmethod
    def attach(cls, trainer, config: CommHookConfig | dict | str | None = None) -> "CommHookCallback":
        callback = cls(config)
        callback.trainer = trainer
        if callback.config.method == "embrace" and callback.config.exchange == "sharded":
            if trainer.args.save_strategy != "no":
                raise SettingsError(
                    "EmbRace exchange='sharded' holds a column slice of each embedding table per rank, "
                    "which a mid-training checkpoint would save as is; set save_strategy='no' (the "
                    "callback puts the full tables back at the end of training, before you save), or "
                    "use exchange='allgather'."
                )
            shard_embeddings(trainer.model)
            _clip_across_shards(trainer)
        elif callback.config.method == "embrace":
            exclude_embeddings(trainer.model)
        trainer.add_callback(callback)
        return callback

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            raise SettingsError(
                "CommHookCallback needs its trainer (the DDP model is trainer.model_wrapped): use "
                "CommHookCallback.attach(trainer, config) instead of callbacks=[CommHookCallback()]."
            )
        if self.state is not None:  # a second train() on the same wrapped model: the hook is already in place
            return
        if self.config.method == "dear" and args.max_grad_norm:
            raise SettingsError(
                f"DeAR averages gradients after optimizer.step() is called, so the Trainer's gradient "
                f"clipping (max_grad_norm={args.max_grad_norm}) would clip local gradients; set "
                "TrainingArguments(max_grad_norm=0) (--max_grad_norm 0)."
            )
        inner = unwrap_optimizer(self.trainer.optimizer) if self.trainer.optimizer is not None else None
        if getattr(inner, "exchanges_gradients_itself", False) and args.max_grad_norm:
            raise SettingsError(
                f"{type(inner).__name__} averages the gradients inside its step(), so the Trainer's "
                f"gradient clipping (max_grad_norm={args.max_grad_norm}) would clip each rank's local "
                "gradient; set TrainingArguments(max_grad_norm=0) (--max_grad_norm 0)."
            )
        self.state = register(self.trainer.model_wrapped, self.config, optimizer=self.trainer.optimizer)
        if self._pending is not None:  # restored by a snapshot before the hook existed
            self.state.load_state_dict(self._pending)
            self._pending = None

    def state_dict(self) -> dict:
        """The hook's state (ACP-SGD's factors and error feedback, S2's step count), for in-memory snapshots."""
        if self.state is None:
            return {}
        return self.state.state_dict() if hasattr(self.state, "state_dict") else {}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        if self.state is None:
            self._pending = state  # applied when on_train_begin registers the hook
        else:
            self.state.load_state_dict(state)

    def _flush(self):
        if self.state is not None and hasattr(self.state, "flush"):
            self.state.flush()

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        # DeAR: the last update is deferred to the next forward; apply it before the weights are read
        if (
            control.should_save
            or control.should_evaluate
            or control.should_training_stop
            or (state.max_steps and state.global_step >= state.max_steps)
        ):
            self._flush()
        # an optimizer with per-rank state (1-bit LAMB's error feedback, torch's ZeroRedundancyOptimizer): the
        # Trainer writes rank 0's state_dict() only, so every rank's part is gathered there first
        inner = unwrap_optimizer(optimizer) if optimizer is not None else None
        if control.should_save and hasattr(inner, "consolidate_state_dict"):
            inner.consolidate_state_dict(to=0)

    def on_train_end(self, args, state, control, optimizer=None, **kwargs):
        self._flush()
        if self.config.method == "embrace" and self.config.exchange == "sharded" and self.trainer is not None:
            unshard_embeddings(self.trainer.model)  # every rank: the full tables back, for saving
        inner = unwrap_optimizer(optimizer) if optimizer is not None else None
        if hasattr(inner, "finish"):  # asynchronous gossip: the last messages, on every rank
            inner.finish()

    def summary(self) -> dict | None:
        """Bytes per step of the finished steps (None before training)."""
        if self.state is None:
            return None
        steps = self.state.stats.steps
        return {
            "method": self.config.method,
            "steps": len(steps),
            "bytes_per_step_mean": sum(steps) / max(1, len(steps)),
            "bytes_last_step": steps[-1] if steps else None,
        }
