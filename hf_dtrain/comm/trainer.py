"""The HF Trainer's way in: the Trainer has no comm-hook option and its callbacks only see the unwrapped model, so the
callback is attached to a trainer and registers on ``trainer.model_wrapped`` (the DDP model) at ``on_train_begin``,
before the first backward."""

from typing import Optional, Union

from transformers import TrainerCallback

from . import CommHookConfig, register


class CommHookCallback(TrainerCallback):
    """Register an hf_dtrain communication hook on the Trainer's DDP model.

    ``CommHookCallback.attach(trainer, {"method": "acp_sgd", "rank": 4})`` (or ``trainer.add_callback(cb)`` after
    ``cb = CommHookCallback(config); cb.trainer = trainer``). After training, ``callback.state.stats.steps`` holds the
    bytes put on the wire per optimizer step.
    """

    def __init__(self, config: Union[CommHookConfig, dict, str, None] = None):
        self.config = CommHookConfig.from_any(config)
        self.trainer = None
        self.state = None

    @classmethod
    def attach(cls, trainer, config: Union[CommHookConfig, dict, str, None] = None) -> "CommHookCallback":
        callback = cls(config)
        callback.trainer = trainer
        trainer.add_callback(callback)
        return callback

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            raise ValueError("CommHookCallback needs its trainer (the DDP model is trainer.model_wrapped): use "
                             "CommHookCallback.attach(trainer, config) instead of callbacks=[CommHookCallback()].")
        if self.state is not None:  # a second train() on the same wrapped model: the hook is already in place
            return
        self.state = register(self.trainer.model_wrapped, self.config)

    def summary(self) -> Optional[dict]:
        """Bytes per step of the finished steps (None before training)."""
        if self.state is None:
            return None
        steps = self.state.stats.steps
        return {"method": self.config.method, "steps": len(steps), "bytes_per_step_mean": sum(steps) / max(1, len(steps)),
                "bytes_last_step": steps[-1] if steps else None}
