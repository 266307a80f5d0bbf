"""LoRA-FA: LoRA with a frozen random down-projection (arXiv 2308.03303). Importing the folder registers its
fine-tuning entry (``method.py``); the peft classes load on first use and register with peft."""

import lazy_loader as lazy

from . import method  # noqa: F401

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    submod_attrs={
        "config": ["LoraFAConfig"],
        "layer": ["Linear", "LoraFALayer"],
        "model": ["LoraFAModel"],
        "optimizer": ["create_lorafa_optimizer"],
    },
)
