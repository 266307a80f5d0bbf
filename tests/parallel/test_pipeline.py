"""Pipeline parallelism (torch.distributed.pipelining, 4 gloo ranks, an 8-layer tiny LLaMA) against one process on the
same global batch: every step's loss within 1e-5 relative and the first step's gradient of every parameter within
float32's rounding (common.assert_grads_match), for each schedule (GPipe, 1F1B, Interleaved1F1B,
InterleavedZeroBubble) and composed with tensor parallelism (pp 2 x tp 2) and with FSDP2 (pp 2 x dp_shard 2). In the
pp x tp case each rank's profile differs (as noisy timings do): every rank must still cut the layers alike, or the tp
peers of a stage deadlock."""

import json
import os

import pytest
import torch

from hf_dtrain.testing import random_batch

from .common import assert_grads_match, float64_grads, full_grads, one_process_run

pytestmark = pytest.mark.slow

STEPS, LR, LAYERS, BATCH, SEQ = 6, 1e-2, 8, 8, 16
# (pp, dp_shard, tp, schedule, stages_per_rank, microbatches)
CASES = [
    (4, 1, 1, "GPipe", 1, 4),
    (4, 1, 1, "1F1B", 1, 8),
    (4, 1, 1, "Interleaved1F1B", 2, 8),
    (4, 1, 1, "InterleavedZeroBubble", 2, 4),
    (2, 1, 2, "1F1B", 1, 4),
    (2, 2, 1, "1F1B", 1, 2),
]


def _model():
    from hf_dtrain.testing import tiny_llama

    return tiny_llama(seed=0, num_hidden_layers=LAYERS)


def _batch(step):
    return random_batch(batch=BATCH, seq=SEQ, seed=500 + step)


def _loss(model, step):
    return model(input_ids=_batch(step)["input_ids"], labels=_batch(step)["labels"]).loss


def _reference():
    """One process: the losses and first-step gradients (float32), and that step's float64 gradients."""
    losses, grads = one_process_run(_model(), _loss, STEPS, LR)
    return losses, grads, float64_grads(_model(), lambda m: _loss(m, 0))


def _pp_rank(rank, world, cases, out):
    from torch.distributed.device_mesh import init_device_mesh

    from hf_dtrain.parallel import (
        FSDPConfig,
        PipelineConfig,
        TensorParallelConfig,
        apply_fsdp,
        apply_pipeline,
        apply_tensor_parallel,
    )

    for c, (pp, dp, tp, schedule, v, micro) in enumerate(cases):
        mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp_shard", "tp"))

        def shard(stage):
            if tp > 1:
                apply_tensor_parallel(stage, mesh["tp"], TensorParallelConfig())
            if dp > 1:
                apply_fsdp(stage, FSDPConfig(), mesh=mesh["dp_shard"])
            return stage

        per_replica = BATCH // dp
        import hf_dtrain.parallel.pipeline as pipeline_module

        real_profile = pipeline_module.profile_costs
        if tp > 1:  # timings differ between ranks (noise): a cut of each rank's own would differ between tp peers
            pipeline_module.profile_costs = lambda model, example, flops=False: {
                "embed": 0.0,
                "layer": 1.0,
                "head": 0.1 if rank % 2 == 0 else 3.0,
            }
        pipe = apply_pipeline(
            _model(),
            mesh["pp"],
            PipelineConfig(schedule=schedule, stages_per_rank=v, microbatches=micro),
            batch_size=per_replica,
            seq_len=SEQ,
            after_split=shard,
        )
        pipeline_module.profile_costs = real_profile
        opt = torch.optim.AdamW(list(pipe.parameters()), lr=LR)
        d = mesh["dp_shard"].get_local_rank()
        losses, grads = [], None
        for step in range(STEPS):
            b = _batch(step)
            part = slice(d * per_replica, (d + 1) * per_replica)
            loss = pipe.step(b["input_ids"][part], b["labels"][part])
            if dp > 1:
                torch.distributed.all_reduce(loss, group=mesh["dp_shard"].get_group())
                loss /= dp
            if step == 0:
                grads = {k: v.tolist() for k, v in full_grads(pipe.named_parameters()).items()}
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        with open(os.path.join(out, f"case{c}-rank{rank}.json"), "w") as f:
            json.dump({"losses": losses, "grads": grads, "bounds": pipe.bounds}, f)


@pytest.fixture(scope="module")
def pp_run(mesh_runs):  # the shared 4-rank run (conftest.py)
    from pathlib import Path

    return Path(mesh_runs) / "pp"


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.mark.smoke
@pytest.mark.parametrize("case", range(len(CASES)), ids=["pp{}-dp{}-tp{}-{}-v{}-m{}".format(*c) for c in CASES])
def test_pipeline_trains_like_one_process(pp_run, reference, case):
    want_losses, want_grads, exact = reference
    runs = [json.loads((pp_run / f"case{case}-rank{r}.json").read_text()) for r in range(4)]
    for run in runs:  # every rank reports the batch's loss (broadcast from the last stage)
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(want_losses), rtol=1e-5, atol=0)
    grads = {}
    for run in runs:
        grads.update(run["grads"])
    assert all(run["bounds"] == runs[0]["bounds"] for run in runs)  # every rank cut alike (global rank 0's profile)
    assert_grads_match(grads, want_grads, exact)  # every parameter lives on some stage, under its own name


def test_balance_minimizes_the_slowest_stage():
    import itertools
    import random

    from hf_dtrain.parallel.pipeline import balance_layers

    assert balance_layers([1.0] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # a heavy head (vocabulary projection + loss) leaves the last stage fewer layers
    assert balance_layers([1.0] * 8, 4, first_extra=0.1, last_extra=1.5) == [(0, 2), (2, 4), (4, 7), (7, 8)]
    rng = random.Random(0)
    for _ in range(30):  # against every cut of a small model
        n, k = rng.randint(3, 8), rng.randint(1, 3)
        costs = [rng.uniform(0.1, 2.0) for _ in range(n)]
        head, emb = rng.uniform(0, 3), rng.uniform(0, 1)

        def worst(bounds):
            return max(
                sum(costs[a:b]) + (emb if s == 0 else 0) + (head if s == k - 1 else 0)
                for s, (a, b) in enumerate(bounds)
            )

        best = min(worst(list(zip((0, *cuts), (*cuts, n)))) for cuts in itertools.combinations(range(1, n), k - 1))
        got = balance_layers(costs, k, emb, head)
        assert next(a for a, _ in got) == 0 and got[-1][1] == n and all(b > a for a, b in got)
        assert worst(got) == pytest.approx(best)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(schedule="zigzag"), "PipelineConfig.schedule='zigzag' is not one of"),
        (dict(schedule="Interleaved1F1B"), "set pipeline.stages_per_rank >= 2"),
        (dict(schedule="1F1B", stages_per_rank=2), "runs one stage per rank"),
        (dict(balance="even"), "pipeline.balance"),
        (dict(microbatches=0), "microbatches"),
    ],
)
def test_bad_pipeline_config_is_refused(kwargs, match):
    from hf_dtrain.parallel import PipelineConfig

    with pytest.raises(ValueError, match=match):
        PipelineConfig(**kwargs)


def test_pipeline_degree_and_micro_batches_are_checked_before_any_group():
    from hf_dtrain.models import llama_config
    from hf_dtrain.parallel import PipelineConfig
    from hf_dtrain.parallel.pipeline import check_pipeline

    with pytest.raises(
        ValueError, match=r"--pp 4 x pipeline.stages_per_rank 1 = 4 stages, but the model has 2 decoder"
    ):
        check_pipeline(llama_config("test"), 4)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        check_pipeline(llama_config("test", tie_word_embeddings=True), 2)
    with pytest.raises(ValueError, match=r"pipeline.microbatches=3 does not divide the batch of 8"):
        PipelineConfig(microbatches=3).n_microbatches(2, 8)
    with pytest.raises(ValueError, match=r"multiple of the pipeline degree 4"):
        PipelineConfig(schedule="Interleaved1F1B", stages_per_rank=2, microbatches=2).n_microbatches(4, 8)


def _disagreeing_and_silent_rank(rank, world, out, phase):
    """Phase ``disagree``: the ranks ask for different micro-batch counts. Phase ``silent``: rank 1 never steps
    (stuck elsewhere) and waits for rank 0's verdict; ``dead``: rank 1 exits at once."""
    import time

    from torch.distributed.device_mesh import init_device_mesh

    from hf_dtrain.parallel import PipelineConfig, apply_pipeline
    from hf_dtrain.parallel.pipeline import PipelineStageError

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    record = {}
    if phase == "disagree":
        try:
            apply_pipeline(
                _model(),
                mesh["pp"],
                PipelineConfig(balance="uniform", microbatches=2 if rank else 4),
                batch_size=BATCH,
                seq_len=SEQ,
            )
        except ValueError as e:
            record["error"] = str(e)
    else:
        pipe = apply_pipeline(
            _model(), mesh["pp"], PipelineConfig(balance="uniform", microbatches=2), batch_size=BATCH, seq_len=SEQ
        )
        flag = os.path.join(out, "rank0-failed")
        if rank == 0:
            b = _batch(0)
            try:
                pipe.step(b["input_ids"], b["labels"])
            except PipelineStageError as e:
                record["error"] = str(e)
            open(flag, "w").close()
        elif phase == "dead":
            os._exit(0)
        else:  # silent: still alive when rank 0 gives up (it did not wait for this rank to exit)
            deadline = time.monotonic() + 120
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.1)
            record["saw_rank0_fail_while_alive"] = os.path.exists(flag)
    with open(os.path.join(out, f"{phase}-rank{rank}.json"), "w") as f:
        json.dump(record, f)


def test_a_pipeline_whose_ranks_disagree_or_whose_neighbour_is_silent_or_dead_fails_naming_the_stage(tmp_path):
    """No hang: ranks that would build different pipelines are refused before any step, on every rank, naming what
    differs; a neighbour silent past the group's timeout (alive, stuck elsewhere) or dead makes the step fail with a
    PipelineStageError naming this rank's stage, its layers and its neighbours."""
    from hf_dtrain.testing import run_distributed

    for phase in ("disagree", "silent", "dead"):
        run_distributed(
            _disagreeing_and_silent_rank, world_size=2, args=(str(tmp_path), phase), timeout=180, pg_timeout_s=6
        )
    for rank in range(2):
        error = json.loads((tmp_path / f"disagree-rank{rank}.json").read_text())["error"]
        assert "pipeline rank 1 has microbatches 2, pipeline rank 0 has 4" in error, error
    assert json.loads((tmp_path / "silent-rank1.json").read_text()) == {"saw_rank0_fail_while_alive": True}
    for phase in ("silent", "dead"):
        error = json.loads((tmp_path / f"{phase}-rank0.json").read_text())["error"]
        assert "pipeline stage 0 of 2 (layers 0-3; next to stage 1 on rank 1) on rank 0" in error, error
