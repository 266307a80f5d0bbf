"""Sharded and parallel engines on torch's own: FSDP2 (``fsdp``)."""

from .fsdp import FSDPConfig, apply_fsdp, fsdp_mesh, fsdp_units, full_state_dict, save_pretrained

__all__ = ["FSDPConfig", "apply_fsdp", "fsdp_mesh", "fsdp_units", "full_state_dict", "save_pretrained"]
