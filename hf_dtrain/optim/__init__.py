"""Optimizers: Eva (and vectorized FOOF) preconditioning around any torch optimizer (issue 5, in progress; 1-bit LAMB
next)."""

from .eva import Eva

__all__ = ["Eva"]
