"""DELTA memory scheduling (Tang et al., arXiv 2203.15980) on stock PyTorch: profile a step, plan keep / offload /
recompute per decoder layer under a budget of saved-activation bytes, apply the plan with non-reentrant
checkpointing and saved-tensor hooks, and re-plan when the batch shape changes or the budget is exceeded.

``scheduler = apply_delta(model, DeltaConfig(budget=0.5))`` (a fraction of the profiled no-saving activation bytes,
or bytes); ``DeltaCallback(DeltaConfig(...))`` for the Trainer. :class:`DeltaConfig` holds every setting.
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    submod_attrs={
        "config": ["DeltaConfig"],
        "executor": ["FileTier", "PinnedTier", "profile_step"],
        "planner": ["Plan", "make_plan", "minimum_budget"],
        "profiler": ["Profile", "decoder_layers", "plan_units"],
        "scheduler": ["DeltaCallback", "DeltaScheduler", "apply_delta"],
    },
)
