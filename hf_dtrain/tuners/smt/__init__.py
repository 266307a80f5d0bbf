"""SMT, Sparse Matrix Tuning (He et al., arXiv 2405.15525, ICLR 2025). Importing the folder registers its
fine-tuning entry (``method.py``); the peft classes load on first use and register with peft."""

import lazy_loader as lazy

from . import method  # noqa: F401

__getattr__, __dir__, __all__ = lazy.attach(
    __name__,
    submod_attrs={
        "config": ["SMT_SCORES", "SMTConfig"],
        "layer": ["BlockSparseDelta", "Linear", "SMTLayer"],
        "model": ["SMTModel", "resolve_num_blocks"],
        "selection": [
            "SMTSelectionCallback",
            "select_smt_blocks",
            "set_smt_block_indices",
            "smt_warmup",
            "start_smt_scoring",
        ],
    },
)
