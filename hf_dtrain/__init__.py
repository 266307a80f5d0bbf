"""hf_dtrain: efficient, distributed and fault-tolerant fine-tuning and pretraining inside the Hugging Face stack.

``import hf_dtrain`` registers its peft methods (SMT, LoRA-FA, Q-BaRA, QA-HiRA) with peft, so ``get_peft_model``,
``PeftModel.from_pretrained`` and ``AutoPeftModelForCausalLM.from_pretrained`` work with them. Import it before
loading a saved hf_dtrain adapter. ``hf_dtrain.load_adapter(base, path)`` is ``PeftModel.from_pretrained`` that first
checks the adapter fits the base (peft drops what does not fit without a word).
"""

from .settings import RELEASE as __version__
from .tuners import LoraFAConfig, LoraFAModel, QAHiRAConfig, QAHiRAModel, QBaRAConfig, QBaRAModel, SMTConfig, SMTModel
from .tuners.lorafa import create_lorafa_optimizer
from .tuners.smt import SMTSelectionCallback, select_smt_blocks, set_smt_block_indices, smt_warmup

__all__ = [
    "LoraFAConfig",
    "LoraFAModel",
    "QAHiRAConfig",
    "QAHiRAModel",
    "QBaRAConfig",
    "QBaRAModel",
    "SMTConfig",
    "SMTModel",
    "SMTSelectionCallback",
    "__version__",
    "check_adapter_fits",
    "create_lorafa_optimizer",
    "load_adapter",
    "select_smt_blocks",
    "set_smt_block_indices",
    "smt_warmup",
]


def __getattr__(name: str):
    """``hf_dtrain.load_adapter`` / ``check_adapter_fits`` on first use: they import transformers' model loading,
    which the snapshot processes and ``hf-dtrain --help`` do not need."""
    if name in ("load_adapter", "check_adapter_fits"):
        from . import adapters

        return getattr(adapters, name)
    raise AttributeError(f"module 'hf_dtrain' has no attribute {name!r}")
