"""SMT, Sparse Matrix Tuning (He et al., arXiv 2405.15525, ICLR 2025)."""

from .config import SMT_SCORES, SMTConfig
from .layer import BlockSparseDelta, Linear, SMTLayer
from .model import SMTModel, resolve_num_blocks
from .selection import (
    SMTSelectionCallback,
    select_smt_blocks,
    set_smt_block_indices,
    smt_warmup,
    start_smt_scoring,
)

__all__ = [
    "SMT_SCORES",
    "BlockSparseDelta",
    "Linear",
    "SMTConfig",
    "SMTLayer",
    "SMTModel",
    "SMTSelectionCallback",
    "resolve_num_blocks",
    "select_smt_blocks",
    "set_smt_block_indices",
    "smt_warmup",
    "start_smt_scoring",
]
