"""Q-BaRA (Shen et al., arXiv 2407.17029): pooled input, rank lambda*r at LoRA's parameter count."""

from .config import QBaRAConfig
from .layer import Linear, QBaRALayer
from .model import QBaRAModel

__all__ = ["Linear", "QBaRAConfig", "QBaRALayer", "QBaRAModel"]
