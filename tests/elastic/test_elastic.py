"""Elastic training (hf_dtrain.elastic): hosts leave and join a torchrun c10d run while it trains."""

import itertools
import os

import pytest

from hf_dtrain.cli import main as cli_main
from hf_dtrain.jobs.elastic import ElasticConfig
from hf_dtrain.testing import free_port
from hf_dtrain.testing.elastic_hosts import kill_strays, launch_host, lose_host, wait_for_log

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_hosts_leave_and_join_and_training_continues(tmp_path):
    out = str(tmp_path / "run")
    port = free_port()
    endpoint, run_id = f"127.0.0.1:{port}", f"test-{port}"
    steps = 160
    base = dict(output_dir=out, steps=steps, global_batch_size=8, min_nodes=1, max_nodes=4, collective_timeout=20.0)
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in "ABCD"}
    hosts = {}
    try:
        hosts["A"] = launch_host(ElasticConfig(**base), endpoint, run_id, logs["A"], store_host=True)
        hosts["B"] = launch_host(ElasticConfig(**base, slowdown=3.0), endpoint, run_id, logs["B"], store_host=False)
        wait_for_log(
            out, lambda log: sum(r["world_size"] == 2 for r in log) >= 5, 120, hosts.values(), "A and B training"
        )
        lose_host(hosts["B"])
        wait_for_log(out, lambda log: log[-1]["world_size"] == 1, 120, hosts.values(), "A alone after B left")
        hosts["C"] = launch_host(ElasticConfig(**base), endpoint, run_id, logs["C"], store_host=False)
        hosts["D"] = launch_host(ElasticConfig(**base), endpoint, run_id, logs["D"], store_host=False)
        log = wait_for_log(out, lambda log: log[-1]["step"] == steps - 1, 240, hosts.values(), "the run's last step")
        for name in ("A", "C", "D"):
            assert hosts[name].wait(timeout=60) == 0, open(tmp_path / f"{name}.log").read()[-3000:]
    finally:
        for h in hosts.values():
            if h.poll() is None:
                lose_host(h)
        for f in logs.values():
            f.close()
        kill_strays(out)  # this run's snapshot processes (they outlive their workers)

    # every step exactly once, in order: the timeline is continuous across the changes
    assert [r["step"] for r in log] == list(range(steps))
    worlds = [r["world_size"] for r in log]
    changes = [worlds[0]] + [w for prev, w in itertools.pairwise(worlds) if w != prev]
    # A (the rendezvous store's host, which stays) and B start together (should B arrive after the first generation
    # formed, the run begins with A alone)
    assert changes[-3:] == [2, 1, 3] and changes[:-3] in ([], [1]), changes
    starts = [r["generation"] for r in log if "restored_from" in r]
    assert starts == list(range(len(changes))), [r for r in log if "restored_from" in r]
    # the slowed host got the smaller share of every global batch while it trained
    two = next(r for r in log if r["world_size"] == 2)
    assert two["batch_sizes"][0] > two["batch_sizes"][1] and sum(two["batch_sizes"]) == 8, two
    for i in range(1, len(log)):
        if log[i]["generation"] != log[i - 1]["generation"]:
            # a new generation resumed from the snapshot of the step before it, on its new world size (from the
            # survivors' snapshots when they hold every old rank's, else from the persisted copy)
            assert log[i].get("restored_from") in ("memory", "memory-resharded", "resharded", "disk"), log[i]
            before = [r["loss"] for r in log[max(0, i - 3) : i]]
            # the loss curve continues where it was (no restart from the initial loss)
            assert abs(log[i]["loss"] - sum(before) / len(before)) < 0.5, (before, log[i])
            assert log[i]["loss"] < log[0]["loss"] - 0.5 * (log[0]["loss"] - before[-1]), (log[0], before, log[i])
    assert log[-1]["loss"] < log[0]["loss"] - 1.0
    assert os.path.exists(os.path.join(out, "model", "model.safetensors"))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="min_nodes"):
        ElasticConfig(min_nodes=3, max_nodes=2)
    with pytest.raises(ValueError, match="global_batch_size"):
        ElasticConfig(global_batch_size=2, max_nodes=4)
    with pytest.raises(ValueError, match="preset"):
        ElasticConfig(preset="huge")
    with pytest.raises(SystemExit, match="min_nodes"):  # the command says what to change, before any launch
        cli_main(["elastic", "--min-nodes", "0"])
