"""Optimizers (issue 5, in progress): Eva and vectorized FOOF preconditioning around any torch optimizer, and 1-bit
LAMB over torch.distributed."""

from .eva import Eva
from .onebit_lamb import OneBitLamb, onebit_lamb_step_bytes

__all__ = ["Eva", "OneBitLamb", "onebit_lamb_step_bytes"]
