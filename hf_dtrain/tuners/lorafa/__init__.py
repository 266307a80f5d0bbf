"""LoRA-FA: LoRA with a frozen random down-projection A; only B trains, and only x @ A.T is kept for backward."""

from .config import LoraFAConfig
from .layer import Linear, LoraFALayer
from .model import LoraFAModel
from .optimizer import create_lorafa_optimizer

__all__ = ["Linear", "LoraFAConfig", "LoraFALayer", "LoraFAModel", "create_lorafa_optimizer"]
