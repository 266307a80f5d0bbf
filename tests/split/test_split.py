"""Split fine-tuning: at full rank, edge + cloud on two processes equal unsplit training; compression counts bytes."""

from __future__ import annotations

import json

import pytest
import torch

from tests.split.split_jobs import STEPS, model_and_batches, split_run


def _unsplit():
    model, batches = model_and_batches()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for b in batches:
        loss = model(input_ids=b["input_ids"], labels=b["labels"]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def _split(tmp_path, rank):
    from hf_dtrain.testing import run_distributed

    out = str(tmp_path / f"r{rank}")
    run_distributed(split_run, world_size=2, args=(1, rank, out), timeout=120)
    edge, cloud = (json.load(open(f"{out}.{r}.json")) for r in (0, 1))
    return edge, cloud


def test_split_at_full_rank_equals_unsplit_training(tmp_path):
    losses, state = _unsplit()
    edge, cloud = _split(tmp_path, None)
    assert len(cloud["losses"]) == STEPS
    assert max(abs(a - b) / b for a, b in zip(cloud["losses"], losses)) < 1e-5
    got = {**edge["state"], **cloud["state"]}
    assert set(got) == set(state)  # every adapter lives on exactly one side
    for n, v in state.items():
        assert float((torch.tensor(got[n]) - v).norm() / v.norm()) < 1e-5, n
    # the edge sent B x T x H fp32 activations and the labels (as fp32) each step; the cloud received just that
    assert edge["sent"] == cloud["received"] == STEPS * (2 * 12 * 64 * 4 + 2 * 12 * 4)


def test_a_low_rank_link_sends_less_and_still_trains(tmp_path):
    edge, cloud = _split(tmp_path, 2)
    assert edge["sent"] < 0.2 * STEPS * (2 * 12 * 64 * 4) + STEPS * 2 * 12 * 4
    assert cloud["sent"] == edge["received"] == STEPS * 2 * (24 + 64) * 4
    assert cloud["losses"][-1] < cloud["losses"][0]


def test_a_cut_outside_the_model_is_refused():
    from hf_dtrain.split import SplitConfig, SplitEdge
    from hf_dtrain.testing import tiny_llama

    with pytest.raises(ValueError, match="cut_layer=2 is outside the model: it has 2 decoder layers"):
        SplitEdge(tiny_llama(), SplitConfig(cut_layer=2))
    with pytest.raises(ValueError, match="cut_layer"):
        SplitConfig(cut_layer=0)
