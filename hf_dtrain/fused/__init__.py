"""Horizontally fused training (HFTA, Wang et al., MLSys 2021): many fine-tuning or pretraining jobs trained as one.

* :func:`fuse_adapters` / :func:`fuse_models`: K jobs' adapters on one frozen base, or K full copies of a model, as
  one model of fused operators (:mod:`hf_dtrain.fused.layers`);
* :class:`FusedTrainer` + :class:`FusedConfig`: the loop, each job with its own AdamW state, learning rate, schedule,
  clipping and data order; diverged jobs stop alone;
* :func:`plan_groups` / :func:`measure_job_bytes`: the memory guard;
* ``hf-dtrain sweep`` (:mod:`hf_dtrain.sweep`) runs a grid of ``hf-dtrain finetune`` jobs this way.
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    submod_attrs={
        "config": ["FusedConfig"],
        "engine": [
            "FusedJob",
            "FusedMemoryError",
            "FusedTrainer",
            "measure_job_bytes",
            "per_job_loss",
            "plan_groups",
            "stack_batches",
        ],
        "fuse": ["FusedAdapters", "FusedModels", "fuse_adapters", "fuse_models"],
        "layers": ["FusedBlockSparse", "FusedEmbedding", "FusedLinear", "FusedLowRank", "FusedRMSNorm"],
        "optim": ["FusedAdamW", "JobSchedules"],
    },
)
