"""Optimizers: Eva and vectorized FOOF preconditioning around any torch optimizer, and 1-bit LAMB over
torch.distributed; their settings as typed configs (:class:`EvaConfig`, :class:`OneBitLambConfig`)."""

import lazy_loader as lazy

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    submod_attrs={
        "config": ["EvaConfig", "OneBitLambConfig"],
        "eva": ["Eva"],
        "onebit_lamb": ["OneBitLamb", "onebit_lamb_step_bytes"],
    },
)
