"""Sharded and parallel engines on torch's and DeepSpeed's own: FSDP2 (``fsdp``), whole state dicts and
``save_pretrained`` from FSDP2 or ZeRO-3 runs (``state``), tensor + sequence parallelism (``tensor``),
pipeline parallelism (``pipeline``), all of them on one mesh and a laid-out step traced on fake tensors
(``mesh``: ``trace_layout``)."""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    submod_attrs={
        "config": ["FSDPConfig", "ParallelConfig", "PipelineConfig", "TensorParallelConfig"],
        "fsdp": ["apply_fsdp", "fsdp_mesh", "fsdp_units"],
        "mesh": ["apply_parallelism", "build_mesh", "trace_layout"],
        "pipeline": ["Pipeline", "apply_pipeline"],
        "state": ["full_state_dict", "is_fsdp2", "is_zero3", "local_param_bytes", "save_pretrained"],
        "tensor": ["apply_tensor_parallel", "tensor_parallel_loss"],
    },
)
