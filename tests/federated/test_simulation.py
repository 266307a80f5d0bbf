"""hf_dtrain.federated: a 1-client federation equals centralized training; Parrot's two-step aggregation equals the
flat one; client state survives between rounds; crashes and bad input."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_dtrain.federated import (
    ClientStateStore,
    FederatedConfig,
    FederatedSimulation,
    compress_delta,
    dirichlet_split,
    flat_average,
    global_average,
    local_aggregate,
)
from hf_dtrain.testing import tiny_llama


def _dataset(n, seed, seq=10):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, 128, (seq,), generator=g)
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return rows


def _collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _peft_model():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    return get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))


def test_one_client_with_full_participation_equals_centralized_training(tmp_path):
    cfg = FederatedConfig(
        clients=1, per_round=1, rounds=3, local_steps=4, batch_size=4, keep_client_optimizer=True, dirichlet_alpha=None
    )
    data = [_dataset(10, 0)]
    model = _peft_model()
    reference = copy.deepcopy(model)
    sim = FederatedSimulation(model, data, _collate, cfg, state_dir=str(tmp_path / "state"))
    history = sim.run(progress=False)
    # centralized: one AdamW over the same 12 steps, the client's data in the same order
    params = [p for p in reference.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.client_lr, weight_decay=0.0)
    batches = []
    pos_epochs = [sim.client_order(0, e) for e in range(4)]
    for order in pos_epochs:
        for i in range(0, len(order), cfg.batch_size):
            batches.append(order[i : i + cfg.batch_size])
    losses = []
    for step in range(12):
        loss = reference(**_collate([data[0][i] for i in batches[step]])).loss
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    for (n, p), q in zip(((n, p) for n, p in model.named_parameters() if p.requires_grad), params):
        assert float((p - q).detach().norm() / q.detach().norm()) < 1e-5, n
    fed_losses = [h["train_loss"] for h in history]
    central = [sum(losses[4 * r : 4 * r + 4]) / 4 for r in range(3)]
    assert max(abs(a - b) / b for a, b in zip(fed_losses, central)) < 1e-5
    # the client's state carried the optimizer state between its rounds: a fresh optimizer each round is another run
    fresh = FederatedSimulation(
        _peft_model(),
        data,
        _collate,
        FederatedConfig(**{**cfg.__dict__, "keep_client_optimizer": False}),
        state_dir=str(tmp_path / "fresh"),
    )
    fresh.run(progress=False)
    assert max(abs(a - b) / b for a, b in zip([h["train_loss"] for h in fresh.history], central)) > 1e-4


def test_parrot_local_then_global_aggregation_equals_flat_aggregation():
    g = torch.Generator().manual_seed(0)
    deltas = [{"a": torch.randn(64, 8, generator=g), "b": torch.randn(17, generator=g) * 1e-3} for _ in range(10)]
    weights = [float(w) for w in torch.randint(1, 500, (10,), generator=g).tolist()]
    flat = flat_average(deltas, weights)
    groups = [[0, 4, 7], [1, 2], [3, 5, 6, 8, 9]]  # three processes' clients
    partials = [local_aggregate([deltas[i] for i in grp], [weights[i] for i in grp]) for grp in groups]
    parrot = global_average(partials)
    for n in flat:
        assert torch.equal(flat[n], parrot[n]), n


def test_scaffold_client_control_variates_survive_between_rounds(tmp_path):
    """Full participation from zero: the server's control variate is the mean of the clients' at every round, which
    holds only if each client's own variate is loaded back at its next round."""
    cfg = FederatedConfig(
        clients=3,
        per_round=3,
        rounds=3,
        local_steps=2,
        batch_size=4,
        algorithm="scaffold",
        client_optimizer="sgd",
        client_lr=0.05,
        dirichlet_alpha=None,
    )
    data = [_dataset(8, s) for s in range(3)]
    sim = FederatedSimulation(_peft_model(), data, _collate, cfg, state_dir=str(tmp_path / "state"))
    sim.run(progress=False)
    store = ClientStateStore(str(tmp_path / "state"))
    for n, c in sim.control.items():
        mean = sum(store.load(i)[0][f"control.{n}"] for i in range(3)) / 3
        assert torch.allclose(c, mean, rtol=1e-5, atol=1e-8), n
        assert c.abs().max() > 0
    assert all(store.load(i)[1]["rounds"] == 3 for i in range(3))


class _Broken(list):
    def __getitem__(self, i):
        raise RuntimeError("the client's device went away")


def test_a_client_that_crashes_is_left_out_of_the_round_which_says_so(tmp_path):
    cfg = FederatedConfig(clients=3, per_round=3, rounds=1, local_steps=2, batch_size=4, dirichlet_alpha=None)
    data = [_dataset(8, 0), _Broken(_dataset(8, 1)), _dataset(8, 2)]
    model = _peft_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    sim = FederatedSimulation(model, data, _collate, cfg, state_dir=str(tmp_path / "s"))
    (record,) = sim.run(progress=False)
    assert record["failed"] == [1] and record["trained"] == 2
    assert "client 1: RuntimeError: the client's device went away" in record["failures"]
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters() if p.requires_grad)


def test_uplink_compression_counts_bytes_and_error_feedback_loses_nothing():
    g = torch.Generator().manual_seed(0)
    shape = {"w": (32, 16), "v": (16,)}
    residual = {n: torch.zeros(s) for n, s in shape.items()}
    sent_total = {n: torch.zeros(s) for n, s in shape.items()}
    true_total = {n: torch.zeros(s) for n, s in shape.items()}
    for method, expected in (
        ("int8", 32 * 16 + 4 + 16 + 4),
        ("int4", 32 * 8 + 4 + 8 + 4),
        ("lowrank", 4 * 2 * (32 + 16) + 4 * 16),
        ("none", 4 * (32 * 16 + 16)),
    ):
        d = {n: torch.randn(s, generator=g) for n, s in shape.items()}
        _, sent, _ = compress_delta(d, method, 2, None)
        assert sent == expected, method
    for _ in range(5):
        d = {n: torch.randn(s, generator=g) for n, s in shape.items()}
        received, _, residual = compress_delta(d, "lowrank", 2, residual)
        for n in shape:
            sent_total[n] += received[n]
            true_total[n] += d[n]
    for n in shape:  # what was sent plus what is still owed is exactly what was produced
        torch.testing.assert_close(sent_total[n] + residual[n], true_total[n], rtol=1e-5, atol=1e-5)


def test_dirichlet_split_is_a_partition_and_skewed():
    labels = [i % 4 for i in range(400)]
    iid = dirichlet_split(labels, 10, None, seed=0)
    skew = dirichlet_split(labels, 10, 0.1, seed=0)
    for split in (iid, skew):
        assert sorted(i for c in split for i in c) == list(range(400)) and all(split)
    distinct = [len({labels[i] for i in c}) for c in skew]
    assert sum(distinct) / 10 < sum(len({labels[i] for i in c}) for c in iid) / 10


def test_bad_federated_settings_are_refused():
    with pytest.raises(ValueError, match="per_round=11 is more than clients=10"):
        FederatedConfig(clients=10, per_round=11)
    with pytest.raises(ValueError, match="client-optimizer sgd"):
        FederatedConfig(algorithm="scaffold")
    with pytest.raises(ValueError, match="uplink"):
        FederatedConfig(uplink="fp8")
    with pytest.raises(ValueError, match="at least one"):
        dirichlet_split([0, 1], 3, 0.5)


def test_two_processes_simulate_the_same_federation_as_one(tmp_path):
    """Parrot on 2 gloo ranks: the sampled clients dealt to the processes, one all-reduce per round; the global
    adapter, the bytes and the losses equal the one-process simulation."""
    import json

    from safetensors.torch import load_file

    from hf_dtrain.testing import run_distributed
    from tests.federated.fed_jobs import build, ranks_run

    out = str(tmp_path / "global.safetensors")
    run_distributed(ranks_run, world_size=2, args=(str(tmp_path / "shared"), out), timeout=240)
    two = load_file(out)
    with open(out + ".json") as f:
        history2 = json.load(f)
    one = build(str(tmp_path / "single"))
    history1 = one.run(progress=False)
    for n, v in one.global_state.items():
        assert float((two[n] - v).norm() / v.norm()) < 1e-5, n
    for a, b in zip(history1, history2):
        assert a["clients"] == b["clients"] and a["uplink_bytes"] == b["uplink_bytes"]
        assert abs(a["train_loss"] - b["train_loss"]) < 1e-5 * abs(a["train_loss"])


def test_cli_fed_simulate_writes_the_adapter_and_the_round_table(tmp_path, tiny_base):
    from peft import PeftModel

    from hf_dtrain.cli import main
    from hf_dtrain.models import load_model_and_tokenizer

    base = tiny_base(50)
    out = tmp_path / "fed"
    main(
        [
            "fed",
            "simulate",
            "--method",
            "lora",
            "--model",
            base,
            "--clients",
            "6",
            "--per-round",
            "3",
            "--rounds",
            "2",
            "--local-steps",
            "2",
            "--task-digits",
            "1",
            "--train-size",
            "120",
            "--eval-size",
            "16",
            "--uplink",
            "int8",
            "--output-dir",
            str(out),
            "--progress",
            "false",
            "--report",
            "false",
        ]
    )
    import json

    result = json.loads((out / "fed.json").read_text())
    assert [len(r["clients"]) for r in result["rounds"]] == [3, 3] and result["processes"] == 1
    assert sum(result["client_sizes"]) == 120 and len(result["client_sizes"]) == 6
    assert all(r["uplink_bytes"] > 0 and r["eval_loss"] > 0 for r in result["rounds"])
    assert (out / "fed.md").exists() and (out / "fed.png").exists()
    assert oct((out / "client_states").stat().st_mode & 0o777) == "0o700"
    PeftModel.from_pretrained(load_model_and_tokenizer(base)[0], str(out))
    with pytest.raises(SystemExit, match="per_round=7 is more than clients=6"):
        main(["fed", "simulate", "--clients", "6", "--per-round", "7"])


def test_clients_are_dealt_to_processes_by_measured_speed(tmp_path):
    sim = FederatedSimulation(
        _peft_model(),
        [_dataset(4, s) for s in range(10)],
        _collate,
        FederatedConfig(clients=10, per_round=8, dirichlet_alpha=None),
        state_dir=str(tmp_path),
    )
    sim.speeds = [3.0, 1.0]  # process 0 trains clients three times as fast
    sampled = sim.sample(0)
    deal = sim.assign(sampled)
    assert [len(d) for d in deal] == [6, 2] and sorted(deal[0] + deal[1]) == sampled
    assert sim.sample(0) == sampled and sim.sample(1) != sampled  # seeded per round


def test_the_fed_recipe_reaches_the_configs():
    from hf_dtrain.cli import build_parser
    from hf_dtrain.jobs.fed import config_from_args

    ns = build_parser("fed").parse_args(["simulate", "--recipe", "recipes/fed_simulate.yaml", "--rounds", "3"])
    cfg = config_from_args(ns)
    assert cfg.job.method == "lorafa" and cfg.fed.clients == 100 and cfg.fed.uplink == "int4"
    assert cfg.fed.rounds == 3  # the flag wins over the recipe
    with pytest.raises(ValueError, match="comm_hook is set"):
        from hf_dtrain.jobs.fed import FedSimulateConfig
        from hf_dtrain.jobs.sft.config import FinetuneConfig

        FedSimulateConfig(job=FinetuneConfig(comm_hook="acp_sgd"))
    # a Trainer setting the client loop would ignore is refused, not dropped (the flags are finetune's)
    with pytest.raises(ValueError, match=r"--bf16, --packing given, but hf-dtrain fed simulate runs its own"):
        FedSimulateConfig(job=FinetuneConfig.from_dict({"bf16": True, "packing": True}))
    assert (
        FedSimulateConfig(job=FinetuneConfig.from_dict({"learning_rate": 1e-3})).job.training["learning_rate"] == 1e-3
    )
