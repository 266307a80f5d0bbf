"""Optimizers: Eva and vectorized FOOF preconditioning around any torch optimizer, and 1-bit LAMB over
torch.distributed; their settings as typed configs (:class:`EvaConfig`, :class:`OneBitLambConfig`)."""

from .config import EvaConfig, OneBitLambConfig
from .eva import Eva
from .onebit_lamb import OneBitLamb, onebit_lamb_step_bytes

__all__ = ["Eva", "EvaConfig", "OneBitLamb", "OneBitLambConfig", "onebit_lamb_step_bytes"]
