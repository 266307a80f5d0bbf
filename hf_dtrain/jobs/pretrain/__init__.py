"""``hf-dtrain pretrain``: LLaMA-architecture pretraining from a ``LlamaConfig`` preset, with any compatible
combination of the engine sections.

``run_pretrain(PretrainConfig(...))`` (one process, or under ``accelerate launch`` / ``torchrun``) reads as
torchtitan's trainer: :func:`build` everything from the config (the tokenizer and token blocks, the model, the
sections' preparation, the optimizer and schedule, the loader, Accelerate), then :func:`train` calls
:func:`train_step` once per step, then :func:`report` (held-out loss, ``results.json``, the model). Which sections take
part (a communication hook or an exchanging optimizer, Eva, DELTA, fault tolerance, the partitioner, the TP / PP
mesh) is the run's business (:mod:`hf_dtrain.run`); this module names none of them.
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    submod_attrs={"loop": ["Parts", "build", "report", "run_pretrain", "train", "train_step"]},
)
_lazy_getattr = __getattr__


def __getattr__(name: str):
    if name == "PretrainConfig":
        from .config import pretrain_config_class

        return pretrain_config_class()
    return _lazy_getattr(name)


__all__ = [*__all__, "PretrainConfig"]
