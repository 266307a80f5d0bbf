"""Sharded and parallel engines on torch's and DeepSpeed's own: FSDP2 (``fsdp``), whole state dicts and
``save_pretrained`` from FSDP2 or ZeRO-3 runs (``state``)."""

from .fsdp import FSDPConfig, apply_fsdp, fsdp_mesh, fsdp_units
from .state import full_state_dict, is_fsdp2, is_zero3, local_param_bytes, save_pretrained

__all__ = ["FSDPConfig", "apply_fsdp", "fsdp_mesh", "fsdp_units", "full_state_dict", "save_pretrained", "is_fsdp2",
           "is_zero3", "local_param_bytes"]
