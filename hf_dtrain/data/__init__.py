"""Data: the default task, heterogeneity-aware partitioning and CRAIG coresets."""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    submod_attrs={
        "coreset": ["craig_select", "craig_subset", "lm_gradient_proxies"],
        "partition": ["HeterogeneityAwareSampler", "partition_indices", "speed_quotas"],
    },
)
