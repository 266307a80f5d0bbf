"""``CommHookConfig``: which gradient-communication method a DDP model uses, and its settings. Every field is a
``--comm-hook.<field>`` flag of ``hf-dtrain finetune`` / ``pretrain`` and a key of the ``comm_hook:`` YAML section
(``comm_hook: acp_sgd`` is short for ``comm_hook: {method: acp_sgd}``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hf_dtrain.settings import build, check_choice, check_fields, setting

# EmbRace's ways of exchanging embedding rows
EXCHANGES = ("allgather", "alltoall", "sharded")
# the methods that carry FSDP2's exchange across HSDP replica groups (comm/fsdp.py), and why the others do not
FSDP_METHODS = ("allreduce", "bf16", "fp16", "acp_sgd")
FSDP_REFUSALS = {
    "dear": "DeAR splits the all-reduce into a reduce-scatter in backward and an all-gather before the next forward; "
    "FSDP2 already does exactly that for every unit",
    "embrace": "EmbRace exchanges the rows of replicated embedding tables; FSDP2 shards the tables and "
    "reduce-scatters their gradients densely",
    "s2_reducer": "the S2 Reducer sketches sparse whole-tensor gradients; FSDP2's replica exchange carries dense row "
    "shards (not built)",
    "noop": "noop leaves gradients local for optimizers that exchange themselves; under FSDP2 a rank holds a shard, "
    "not a replica",
}


METHODS = ("allreduce", "bf16", "fp16", "acp_sgd", "s2_reducer", "dear", "embrace", "noop")


@dataclass
class CommHookConfig:
    """A communication method and its settings (validated on construction)."""

    section_key: ClassVar[str] = "comm_hook"  # flags --comm-hook.<field>, YAML comm_hook:

    shorthand: ClassVar[str] = "method"

    method: str = setting(
        "acp_sgd",
        "allreduce (DDP's dense all-reduce, counted), bf16 / fp16 (the same in half precision: torch's "
        "bf16_compress_hook / fp16_compress_hook, counted), acp_sgd (alternating PowerSGD factors, error "
        "feedback), s2_reducer (sparse bitmap + count sketch), dear (reduce-scatter in backward, all-gather in the "
        "next forward; exact), embrace (embedding rows as index/row pairs; exact), noop (nothing: for optimizers "
        "that exchange themselves).",
    )
    rank: int = setting(4, "acp_sgd: rank r of the P (n x r) and Q (m x r) factors.", min=1)
    start_iter: int = setting(
        10,
        "acp_sgd: steps of plain all-reduce before compressing (>= 2: DDP rebuilds its buckets after step 1).",
        min=2,
        why="DDP rebuilds its buckets after the first step",
    )
    min_compression_rate: float = setting(
        2.0, "acp_sgd: compress an n x m gradient only if n*m >= this * (n + m) * rank; smaller ones go dense.", min=0
    )
    use_error_feedback: bool = setting(
        True, "acp_sgd, s2_reducer: add the local compression error to the next step's gradient."
    )
    seed: int = setting(
        0, "acp_sgd: seed of the initial Q factors; s2_reducer: seed of the sketch hashes (same on all ranks)."
    )
    sketch_rows: int = setting(
        3, "s2_reducer: count-sketch rows d (odd, so the median is one of the estimates).", min=1
    )
    sketch_width_factor: float = setting(
        4.0, "s2_reducer: counters per row per nonzero position of the union of the ranks' nonzeros.", gt=0
    )
    fusion_mb: float = setting(
        1.0,
        "dear: MB of gradients per fusion group (consecutive layers merged until a group holds this much; "
        "0 = one group per module). Each group's reduce-scatter starts in backward as soon as its gradients are "
        "ready, its all-gather just before its layer's forward.",
        min=0,
    )
    exchange: str = setting(
        "allgather",
        "embrace: allgather or alltoall (replicated tables, the touched rows' gradients travel), or "
        "sharded (the paper's column-sharded tables: lookups and gradients by all-to-all, no table-sized exchange).",
    )

    def __post_init__(self):
        check_fields(self)

        check_choice(self, "method", METHODS, "comm_hook.method (--comm-hook)")
        check_choice(self, "exchange", EXCHANGES, "comm_hook.exchange")

    @classmethod
    def from_any(cls, config: CommHookConfig | dict | str | None) -> CommHookConfig:
        """A config from itself, a method name, or a dict of fields (unknown keys refused, naming the valid ones)."""
        if config is None:
            return cls()
        if isinstance(config, cls):
            return config
        if isinstance(config, str):
            return cls(method=config)
        if isinstance(config, dict):
            return build(cls, config, "comm hook config")
        raise TypeError(
            f"comm hook config must be a CommHookConfig, a dict or a method name, got {type(config).__name__}."
        )
