"""Every config field that changes numerics changes them: a run with the field set away from its default differs
from the default run (parameters after a few steps, bytes on the wire, or, for DeAR's exact schedule, the number of
fused groups it sends per step), so a field the engine ignored would fail here. DELTA's fields are checked on its
plans, Eva's on its update, the communication hooks' on 2 gloo ranks."""

import dataclasses
import json

import pytest
import torch

from hf_dtrain.comm import CommHookConfig
from hf_dtrain.memory import DeltaConfig
from hf_dtrain.optim import Eva, EvaConfig
from hf_dtrain.testing import random_batch, run_distributed, tiny_llama

# field -> a value away from the default, per method (fields of other methods are ignored by design)
COMM_VARIANTS = {
    "acp_sgd": {"rank": 2, "start_iter": 3, "min_compression_rate": 60.0, "use_error_feedback": False, "seed": 1},
    "s2_reducer": {"sketch_rows": 5, "sketch_width_factor": 1.0, "seed": 1},
    "embrace": {"exchange": "alltoall"},
    "dear": {"fusion_mb": 0.0},  # exact whatever the fusion: it changes how many collectives a step sends
}


def _comm_rank(rank, world, out):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_dtrain.comm import exclude_embeddings, register

    results = {}
    for method, variants in COMM_VARIANTS.items():
        base = {"start_iter": 2} if method == "acp_sgd" else {}
        for field, value in [(None, None), *variants.items()]:
            cfg = CommHookConfig(method=method, **{**base, **({field: value} if field else {})})
            # a vocabulary of 1024 of which the batches use the first 128: sparse embedding gradients
            model = tiny_llama(seed=0, vocab_size=1024 if method == "s2_reducer" else 128)
            if method == "s2_reducer":  # sparse gradients: only the rows of the tokens seen get one
                for p in model.parameters():
                    p.requires_grad_(p is model.model.embed_tokens.weight)
            if method == "embrace":
                exclude_embeddings(model)
            ddp = DDP(model)
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
            state = register(ddp, cfg, optimizer=opt)
            for step in range(6):
                batch = random_batch(batch=2, seq=8, seed=100 * rank + step)
                ddp(**batch).loss.backward()
                opt.step()
                opt.zero_grad()
            checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
            groups = len(state.groups) if method == "dear" else None
            results[f"{method}:{field}"] = {"bytes": list(state.stats.steps), "checksum": checksum, "groups": groups}
    if rank == 0:
        json.dump(results, open(out, "w"))


@pytest.mark.slow
def test_every_comm_hook_field_changes_bytes_or_parameters(tmp_path):
    out = tmp_path / "r.json"
    run_distributed(_comm_rank, world_size=2, args=(str(out),), timeout=300)
    results = json.load(open(out))
    for method, variants in COMM_VARIANTS.items():
        default = results[f"{method}:None"]
        for field in variants:
            got = results[f"{method}:{field}"]
            assert got != default, f"CommHookConfig.{field} did not change {method}'s bytes, parameters or groups"
    fields = {f.name for f in dataclasses.fields(CommHookConfig)} - {"method"}
    assert fields == {f for v in COMM_VARIANTS.values() for f in v}  # every field is varied somewhere


def _eva_update(**changes):
    torch.manual_seed(0)
    model = tiny_llama(seed=0)
    opt = Eva.from_config(model, dataclasses.replace(EvaConfig(), **changes), model=model, base_optimizer="sgd", lr=0.1)
    for step in range(3):
        model(**random_batch(seed=step)).loss.backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize(
    "field,value",
    [
        ("damping", 0.5),
        ("kl_clip", 0.1),
        ("factor_decay", 0.5),
        ("update_interval", 2),
        ("method", "foof"),
        ("exclude", ["mlp"]),
    ],
)
def test_every_eva_field_changes_the_update(field, value):
    assert not torch.equal(_eva_update(**{field: value}), _eva_update()), f"EvaConfig.{field} changed nothing"


def test_every_delta_field_reaches_the_planner(monkeypatch):
    """Each DeltaConfig field reaches what uses it: the budget and planner settings the plan is made with (recorded
    at the planner's door: plans themselves depend on measured times, so comparing them would be flaky), and the
    planning units."""
    import hf_dtrain.memory.scheduler as memory  # where the scheduler calls the planner
    from hf_dtrain.memory import apply_delta

    seen = []
    real = memory.make_plan

    def recording(profile, budget, method="exact", allow_offload=True, overlap=False, objective="time"):
        seen.append((budget, method, allow_offload, objective))
        return real(profile, budget, method, allow_offload, overlap=overlap, objective=objective)

    monkeypatch.setattr(memory, "make_plan", recording)

    def run(**changes):
        model = tiny_llama(seed=0, num_hidden_layers=4)
        scheduler = apply_delta(model, DeltaConfig(**{"budget": 0.5, **changes}))
        model(**random_batch(batch=4, seq=32)).loss.backward()
        units = [name for name, _ in scheduler.layers]
        scheduler.remove()
        return seen.pop(), units

    (budget, method, offload, objective), units = run()
    assert (method, offload, objective) == ("exact", True, "time") and len(units) == 4
    assert abs(run(budget=0.25)[0][0] - budget / 2) <= 1  # half the fraction, half the bytes
    assert run(budget=400_000)[0][0] == 400_000
    assert run(method="delta")[0][1] == "delta"
    assert run(allow_offload=False)[0][2] is False
    assert run(objective="memory")[0][3] == "memory"
    assert len(run(granularity="submodule")[1]) == 16  # 4 sub-modules per decoder layer
