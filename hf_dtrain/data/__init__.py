"""Data: the default task, heterogeneity-aware partitioning and CRAIG coresets."""

from .coreset import craig_select, craig_subset, lm_gradient_proxies
from .partition import HeterogeneityAwareSampler, partition_indices, speed_quotas

__all__ = [
    "HeterogeneityAwareSampler",
    "craig_select",
    "craig_subset",
    "lm_gradient_proxies",
    "partition_indices",
    "speed_quotas",
]
