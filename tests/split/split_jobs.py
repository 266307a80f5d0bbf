"""The 2-process split fine-tuning run of test_split (a module the spawned ranks import)."""

from __future__ import annotations

import json

import torch

STEPS = 6


def model_and_batches():
    from peft import LoraConfig, get_peft_model

    from hf_dtrain.testing import random_batch, tiny_llama

    torch.manual_seed(0)
    model = get_peft_model(
        tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    )
    batches = [random_batch(batch=2, seq=12, seed=s) for s in range(STEPS)]
    return model, batches


def split_run(rank: int, world: int, cut: int, compress_rank, out: str) -> None:
    from hf_dtrain.split import SplitCloud, SplitConfig, SplitEdge

    torch.set_num_threads(1)
    model, batches = model_and_batches()
    cfg = SplitConfig(cut_layer=cut, rank=compress_rank)
    side = SplitEdge(model.get_base_model(), cfg) if rank == 0 else SplitCloud(model.get_base_model(), cfg)
    opt = torch.optim.AdamW(side.parameters(), lr=1e-2)
    losses = []
    for b in batches:
        if rank == 0:
            side.step(b["input_ids"], b["labels"])
        else:
            losses.append(side.step())
        opt.step()
        opt.zero_grad()
    state = {
        n: p.detach().tolist()
        for n, p in model.named_parameters()
        if p.requires_grad and any(p is q for q in side.parameters())
    }
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(dict(losses=losses, state=state, sent=side.bytes_sent, received=side.bytes_received), f)
