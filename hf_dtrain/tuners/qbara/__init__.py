"""Q-BaRA (Shen et al., arXiv 2407.17029, TACL 2025): a pooled, higher-rank LoRA at LoRA's parameter count for
4-bit bases. Importing the folder registers its fine-tuning entry; the peft classes load on first use."""

import lazy_loader as lazy

from . import method  # noqa: F401

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    submod_attrs={"config": ["QBaRAConfig"], "layer": ["Linear", "QBaRALayer"], "model": ["QBaRAModel"]},
)
