"""``hf-dtrain pretrain --fsdp --fault-tolerance`` on gloo, one emulated node per rank: the model is sharded with
FSDP2, each rank snapshots its own shards every step and every 2nd snapshot is persisted (also as a DCP checkpoint).

* rank 1 SIGKILLed after step 6, the job relaunched on 2 ranks: it resumes from the snapshot processes and the
  steps after the restore equal the uninterrupted run's bit for bit;
* killed again after step 7 and relaunched on 3 ranks: the in-memory snapshots (2 ranks) cannot load rank by rank
  there, but the two nodes' snapshot processes hold both old ranks' snapshots of step 7 (newer than the persisted
  step 6): they are resharded onto 3 ranks, no step is lost, and the job trains to the end.
"""

import json
import re
import sys

import pytest

from hf_dtrain.testing import elastic_launch, stop_snapshot_processes

pytestmark = pytest.mark.slow

JOB = [
    "hf_dtrain.cli",
    "pretrain",
    "--preset",
    "tiny",
    "--max-steps",
    "8",
    "--per-device-train-batch-size",
    "4",
    "--seq-len",
    "64",
    "--data-bytes",
    "300000",
    "--save-model",
    "false",
    "--learning-rate",
    "2e-3",
    "--warmup-steps",
    "2",
    "--progress",
    "false",
    "--fsdp",
    "--fault-tolerance.persist-every",
    "2",
]


@pytest.mark.resume_cell("full training", "FSDP2, plain loop", "another world size")
def test_fsdp_pretraining_resumes_exactly_then_reshards_onto_more_ranks(tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "run"
    ref.mkdir()
    out.mkdir()

    def launch(directory, world, fault=None):
        cli = [
            *JOB,
            "--fault-tolerance.directory",
            str(tmp_path / f"{directory.name}_ft"),
            "--output-dir",
            str(directory),
        ]
        if fault:  # the testing fault injector: rank:step killed after that step's snapshot
            cli = ["hf_dtrain.testing.fault", fault, *cli]
        return elastic_launch([sys.executable, "-m", *cli], world, timeout=600, log_dir=str(directory), preloaded=True)

    def results(directory, world):
        return [json.load(open(directory / f"results_rank{r}.json")) for r in range(world)]

    try:
        assert launch(ref, 2) == [0, 0], open(ref / "rank0.out").read()[-3000:]
        reference = results(ref, 2)
        assert reference[0]["engine"] == "fsdp2" and reference[0]["fault_tolerance"]["snapshots"] == 8

        codes = launch(out, 2, fault="1:6:2")  # killed 2 s after step 6's snapshot: its persisted copy is complete
        assert codes[1] == -9, codes
        # resumes from memory, then rank 1 is killed 2 s after step 7's snapshot (step 6's persisted copy is done)
        codes = launch(out, 2, fault="1:7:2")
        assert codes[1] == -9, codes
        restored = int(re.search(r"resumed after step (\d+) from memory", open(out / "rank0.out").read())[1])
        assert restored in (5, 6)  # 5 when the agent stopped rank 0 before its step-6 copy was committed
        for r in range(2):
            second = {}  # the relaunch's steps: the last entries of the step log (it is appended to)
            for line in open(out / f"history_rank{r}.jsonl"):
                h = json.loads(line)
                second[h["step"]] = h["loss"]
            want = {h["step"]: h["loss"] for h in reference[r]["history"] if restored < h["step"] <= 7}
            assert {s: v for s, v in second.items() if s > restored} == want  # bit for bit

        assert launch(out, 3) == [0, 0, 0], open(out / "rank0.out").read()[-3000:]
        resumed = results(out, 3)
        for r in range(3):
            assert resumed[r]["fault_tolerance"]["restored"] == {"step": 7, "source": "memory-resharded"}
            assert [h["step"] for h in resumed[r]["history"]] == [8]
        assert resumed[0]["world_size"] == 3 and resumed[0]["engine"] == "fsdp2"
        assert abs(resumed[0]["history"][-1]["loss"] - reference[0]["history"][-1]["loss"]) < 0.5
    finally:
        for d in ("ref_ft", "run_ft"):
            stop_snapshot_processes(tmp_path / d)
