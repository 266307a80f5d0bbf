"""DDP communication hooks for Accelerate, the Trainer, plain DDP and DeepSpeed stage 0.

``register(model, config)`` after ``accelerator.prepare(model)`` (Accelerate's ``DistributedDataParallelKwargs``
silently ignores a callable ``comm_hook``), :class:`hf_dtrain.callbacks.CommHookCallback` with the Trainer, or
:func:`hf_dtrain.comm.deepspeed.register_deepspeed` on a DeepSpeed engine.

Methods: ``"allreduce"`` (the dense baseline, counted), ``"bf16"`` / ``"fp16"`` (the same in half precision, torch's
compress hooks, counted), ``"acp_sgd"`` (:mod:`hf_dtrain.comm.acp_sgd`),
``"s2_reducer"`` (:mod:`hf_dtrain.comm.s2_reducer`), ``"dear"`` (:mod:`hf_dtrain.comm.dear`; needs the optimizer),
``"embrace"`` (:mod:`hf_dtrain.comm.embrace`; call :func:`exclude_embeddings` before wrapping), ``"noop"`` (DDP
sends nothing: for optimizers that exchange gradients themselves, such as :class:`hf_dtrain.optim.OneBitLamb`).

FSDP2 has no DDP hooks: under HSDP, :func:`register_fsdp` (:mod:`hf_dtrain.comm.fsdp`) compresses the exchange across
replica groups with ``allreduce``, ``bf16``, ``fp16`` or ``acp_sgd``.
"""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    submod_attrs={
        "acp_sgd": ["ACPSGDState", "acp_sgd_hook", "acp_sgd_step_bytes"],
        "config": ["CommHookConfig", "FSDP_METHODS"],
        "deepspeed": ["register_deepspeed"],
        "dear": ["DeARState", "dear_step_bytes"],
        "embrace": ["EmbRaceState", "embrace_dense_hook", "embrace_step_bytes", "exclude_embeddings"],
        "embrace_sharded": [
            "ColumnShardedEmbedding",
            "clip_sharded_grad_norm_",
            "shard_embeddings",
            "unshard_embeddings",
        ],
        "fsdp": ["FSDPExchangeState", "fsdp_exchange_step_bytes", "register_fsdp"],
        "s2_reducer": ["S2ReducerState", "s2_reducer_hook"],
        "hooks": ["DenseState", "dense_allreduce_hook", "register"],
    },
)
