"""Seeded random token batches (torch only: a process that imports this does not import transformers)."""

from __future__ import annotations

import torch


def random_batch(batch: int = 2, seq: int = 16, vocab: int = 128, seed: int = 0) -> dict[str, torch.Tensor]:
    """``batch`` x ``seq`` token ids drawn from ``vocab`` with a generator seeded by ``seed``, an all-ones attention
    mask and the ids as labels (a causal LM shifts them)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
