"""The lean paths' section of the fine-tuning job (``--fast``, on by default): the one switch, peft's own LoRA layers
through the lean function, and the count of layers that took each path in ``results.json``."""

from __future__ import annotations

from dataclasses import field

from hf_dtrain.run.section import Section, register_section

from . import enabled, set_enabled


@register_section
class FastSection(Section):
    """``--fast true`` (the default): every tuner layer takes its lean path where it is exact (peft LoRA layers
    through :func:`hf_dtrain.fast.apply`); ``--fast false``: the plain paths. ``results.json``'s ``fast`` says how
    many layers took the lean path in the last training step and why the others did not."""

    name = "fast"
    jobs = ("finetune",)
    order = 5

    @classmethod
    def settings(cls):
        help = (
            "Lean adapter layers where they are exact: the base and adapter products in one autograd function, "
            "only what the gradients need kept for backward (hf_dtrain.fast; peft's own LoRA layers too). false: "
            "the plain paths. results.json's fast says which layers took which path."
        )
        return [("fast", bool, field(default=True, metadata={"help": help}))]

    @classmethod
    def active(cls, view) -> bool:
        return True  # false is a setting too: the switch is set either way

    @classmethod
    def empty_results(cls, trainer: bool) -> dict:
        return {"fast": None, "step_settings": None}

    def setup(self) -> None:
        self.was = enabled()
        set_enabled(self.cfg.fast)
        self.model = None

    def prepare(self, model):
        from .paths import apply

        self.model = model
        if self.cfg.fast:
            apply(model)

    def results(self) -> dict:
        from .paths import report

        if self.model is None:
            return {"fast": None}
        paths = report(self.model, training=True)
        lean = paths["lean"] + paths["lean adapter"]
        return {
            "fast": {"enabled": bool(self.cfg.fast), **paths},
            # for the job's step settings: tuner layers on a lean path, of those that trained
            "step_settings": {"lean_layers": f"{lean}/{paths['layers']}"},
        }

    def close(self) -> None:  # the switch as it was before the run (a later run in the process starts from it)
        set_enabled(self.was)
