"""A section defined here, outside hf_dtrain, registers itself and is part of both jobs: its flags are in ``finetune
--help`` and ``pretrain --help``, it composes into a fine-tuning run (a Trainer callback) and a pretraining run (the
plain loop's hooks) with its results in ``results.json``, and its declared clash is refused before any step with its
own message."""

import json
import math

import pytest

from hf_dtrain.run.section import clash_table, unregister_section

from . import toy_section

JOBS = ("finetune", "pretrain")


@pytest.fixture
def section():
    yield toy_section.GradNormSection
    unregister_section(toy_section.NAME)


@pytest.fixture(autouse=True)
def registered():
    from hf_dtrain.run.section import register_section

    register_section(toy_section.GradNormSection)  # (importing toy_section registered it once; re-register per test)
    yield
    unregister_section(toy_section.NAME)


@pytest.mark.parametrize("job", JOBS)
def test_its_flags_are_in_the_jobs_help_and_its_clash_in_the_table(job):
    from hf_dtrain.cli import build_parser

    text = " ".join(build_parser(job).format_help().split())  # argparse wraps the help
    assert "--grad-norm.every" in text and "a section defined outside hf_dtrain" in text
    assert "`--grad-norm` with an optimizer that exchanges gradients itself" in clash_table()


def _norms_are_logged(results: dict, steps: int, every: int) -> None:
    logged = results[toy_section.NAME]
    assert logged["every"] == every and logged["steps"] == list(range(every, steps + 1, every)), logged
    assert all(math.isfinite(n) and n > 0 for n in logged["norms"]), logged


@pytest.mark.slow
def test_it_composes_into_finetune_and_its_results_land_in_results_json(tmp_path, tiny_base):
    from hf_dtrain.cli import main

    base = tiny_base(50)
    out = tmp_path / "ft"
    task = ["--task-digits", "1", "--train-size", "128", "--eval-size", "8", "--progress", "false"]
    flags = ["--model", base, "--output-dir", str(out), "--max-steps", "6", *task]
    assert main(["finetune", "--method", "lora", "--grad-norm.every", "2", *flags]) == 0
    _norms_are_logged(json.loads((out / "results.json").read_text()), steps=6, every=2)


@pytest.mark.slow
def test_it_composes_into_pretrain_and_its_results_land_in_results_json(tmp_path):
    from hf_dtrain.cli import main

    out = tmp_path / "pt"
    flags = ["--preset", "test", "--max-steps", "4", "--seq-len", "32", "--data-bytes", "50000", "--progress", "false"]
    assert main(["pretrain", "--grad-norm", *flags, "--output-dir", str(out), "--save-model", "false"]) == 0
    _norms_are_logged(json.loads((out / "results.json").read_text()), steps=4, every=1)


@pytest.mark.parametrize("job", JOBS)
def test_its_clash_is_refused_before_any_step_with_its_own_message(tmp_path, job):
    import torch.distributed as dist

    from hf_dtrain.cli import main

    out = tmp_path / job
    with pytest.raises(SystemExit, match=toy_section.REFUSAL):
        main([job, "--grad-norm", "--optimizer", "onebit_lamb", "--output-dir", str(out)])
    assert not out.exists() and not dist.is_initialized()  # refused before the process group and any writing
