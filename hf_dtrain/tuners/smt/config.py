from __future__ import annotations

from dataclasses import dataclass

from hf_dtrain.errors import SettingsError
from hf_dtrain.settings import setting

from .._registry import HfDtrainPeftConfig, register_folder

SMT_SCORES = ("abs_mean", "mean_abs", "l1", "l2")


@dataclass
class SMTConfig(HfDtrainPeftConfig):
    """Configuration of Sparse Matrix Tuning (SMT; He et al., arXiv 2405.15525, ICLR 2025).

    The target weight matrices are cut into ``block_size x block_size`` blocks. A warm-up of ``warmup_steps``
    ordinary backward passes sums each target matrix's dense gradient; every block gets a score from that sum; the
    ``num_blocks`` best blocks across *all* target matrices are selected, and from then on only those blocks train
    (as a delta added to the frozen weight, so the adapter applies to the unchanged base and merges exactly).

    Give the budget as ``num_blocks`` or as ``trainable_ratio`` (fraction of the model's parameters), or give
    ``block_indices`` directly (then no warm-up is needed). After selection ``block_indices`` holds the chosen blocks,
    so they are saved in ``adapter_config.json`` (and again as the ``smt_indices`` buffers in the weights file).
    """

    peft_type_name = "SMT"

    target_modules: list[str] | str | None = setting(
        None,
        "Module names (suffix match) or a regex of the nn.Linear layers SMT may select blocks from. "
        "None: the attention Q, K, V projections (the paper's default; V benefits most).",
    )
    block_size: int = setting(
        256, "Side of the square blocks (the paper uses 256). Must divide both dims of every target."
    )
    num_blocks: int | None = setting(
        None, "Number of blocks to train, selected globally across all targets. Or set trainable_ratio."
    )
    trainable_ratio: float | None = setting(
        None,
        "Trainable parameters as a fraction of all model parameters (e.g. 0.0084 for the paper's 0.84%); "
        "converted to floor(ratio * n_params / block_size**2) blocks, at least 1. Or set num_blocks.",
    )
    warmup_steps: int = setting(
        100,
        "Backward passes whose summed dense gradients score the blocks (the paper: 100). Used by "
        "SMTSelectionCallback and smt_warmup.",
    )
    score: str = setting(
        "mean_abs",
        "Block score from the gradient G summed over the warm-up: 'mean_abs' |mean(G)| over the block (the "
        "official code's default, used for the paper's runs), 'abs_mean' mean(|G|), 'l1' sum(|G|), 'l2' ||G||_F. "
        "docs/smt.md compares them on real data.",
    )
    block_indices: dict[str, list[list[int]]] | None = setting(
        None,
        "Explicit blocks per target module: {module_name: [[row_block, col_block], ...]}, module names as "
        "in base_model.named_modules(). Filled in by the selection; set it to skip the warm-up.",
    )

    def __post_init__(self):
        super().__post_init__()
        self.positive_ints("block_size", "num_blocks")
        if self.score not in SMT_SCORES:
            raise SettingsError(f"SMTConfig.score={self.score!r} is unknown; use one of {list(SMT_SCORES)}.")
        if self.num_blocks is not None and self.trainable_ratio is not None:
            raise SettingsError("Set either SMTConfig.num_blocks or SMTConfig.trainable_ratio, not both.")
        if self.block_indices is None and self.num_blocks is None and self.trainable_ratio is None:
            raise SettingsError(
                "SMTConfig needs a budget: set num_blocks (e.g. num_blocks=16), trainable_ratio (e.g. 0.01) or "
                "explicit block_indices."
            )
        if self.trainable_ratio is not None and not 0.0 < float(self.trainable_ratio) <= 1.0:
            raise SettingsError(f"SMTConfig.trainable_ratio must be in (0, 1], got {self.trainable_ratio!r}.")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 1:
            raise SettingsError(f"SMTConfig.warmup_steps must be an integer >= 1, got {self.warmup_steps!r}.")
        if self.block_indices is not None:
            if not isinstance(self.block_indices, dict):
                raise SettingsError(
                    "SMTConfig.block_indices must be a dict {module_name: [[row_block, col_block], ...]}."
                )
            cleaned = {}
            for key, pairs in self.block_indices.items():
                pairs = [list(map(int, p)) for p in (pairs.tolist() if hasattr(pairs, "tolist") else pairs)]
                if any(len(p) != 2 or min(p) < 0 for p in pairs):
                    raise SettingsError(
                        f"SMTConfig.block_indices[{key!r}] must be a list of [row_block, col_block] pairs of "
                        "non-negative integers."
                    )
                cleaned[key] = pairs
            self.block_indices = cleaned


register_folder(__name__)
