"""Sharded and parallel engines on torch's and DeepSpeed's own: FSDP2 (``fsdp``), whole state dicts and
``save_pretrained`` from FSDP2 or ZeRO-3 runs (``state``), tensor + sequence parallelism (``tensor``),
pipeline parallelism (``pipeline``)."""

from .fsdp import FSDPConfig, apply_fsdp, fsdp_mesh, fsdp_units
from .pipeline import Pipeline, PipelineConfig, apply_pipeline
from .state import full_state_dict, is_fsdp2, is_zero3, local_param_bytes, save_pretrained
from .tensor import TensorParallelConfig, apply_tensor_parallel, tensor_parallel_loss

__all__ = [
    "FSDPConfig",
    "Pipeline",
    "PipelineConfig",
    "TensorParallelConfig",
    "apply_fsdp",
    "apply_pipeline",
    "apply_tensor_parallel",
    "fsdp_mesh",
    "fsdp_units",
    "full_state_dict",
    "is_fsdp2",
    "is_zero3",
    "local_param_bytes",
    "save_pretrained",
    "tensor_parallel_loss",
]
