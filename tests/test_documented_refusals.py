"""Every clash the sections declare (one table, :func:`hf_dtrain.run.section.clash_table`) is the table docs/compose.md
shows ("Clashes refused, and why"), and is refused: each row must have at least one concrete combination here that
the job refuses before any process group (its flags parsed as the command line parses them, its config built, the run
started as the job starts it, on the world size given) with a message naming the settings. A row added to a section
without a check here fails, as does a check that stops refusing, and a docs table that differs from the sections'."""

import os
import re

import pytest

from hf_dtrain import cli
from hf_dtrain.run.flags import job_config_from_args
from hf_dtrain.run.job import JobRun
from hf_dtrain.run.section import clash_table

pytestmark = pytest.mark.timeout(60)
DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "compose.md")


def documented_clashes() -> list[str]:
    """The first cell of each row of the "Clashes refused, and why" table."""
    text = open(DOC).read()
    section = text.split("## Clashes refused, and why", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| combination")]
    return [re.split(r"(?<!\\)\|", row)[1].strip() for row in rows]


# documented row -> [(job, flags, world size, environment, regex the refusal must match)]
EXAMPLES = {
    "`--comm-hook` with `--optimizer onebit_lamb\\|dpsgd\\|decentlam\\|diloco`": [
        ("pretrain", ["--comm-hook", "acp_sgd", "--optimizer", "dpsgd"], 2, {}, r"second exchange"),
        ("finetune", ["--comm-hook", "s2_reducer", "--optimizer", "onebit_lamb"], 2, {}, r"second exchange"),
    ],
    "`--comm-hook` or an exchanging optimizer in one process": [
        ("pretrain", ["--comm-hook", "acp_sgd"], 1, {}, r"needs >= 2 processes"),
        ("finetune", ["--optimizer", "diloco"], 1, {}, r"optimizer=diloco needs >= 2 processes"),
    ],
    "a `--method` that builds its own optimizer (`--method lorafa`) with `--optimizer` other than adamw": [
        ("finetune", ["--method", "lorafa", "--optimizer", "eva"], 2, {}, r"two optimizers.*--lorafa.optimizer false"),
    ],
    "`--fault-tolerance` with `--comm-hook dear`": [
        ("pretrain", ["--fault-tolerance", "true", "--comm-hook", "dear"], 2, {}, r"comm_hook=dear defers"),
    ],
    "`--hetero-speeds` with the Trainer (finetune)": [
        ("finetune", ["--hetero-speeds", "1", "2"], 2, {}, r"hetero_speeds: the Trainer shards its loader again"),
    ],
    "`--hetero-speeds` with a count other than the processes": [
        ("pretrain", ["--hetero-speeds", "1", "2", "3"], 2, {}, r"hetero_speeds has 3 values for 2 processes"),
    ],
    "`--deepspeed` with a comm hook or an exchanging optimizer": [
        ("finetune", ["--deepspeed", "zero2", "--comm-hook", "acp_sgd"], 2, {}, r"ZeRO-2 replaces DDP"),
        (
            "finetune",
            ["--method", "lora", "--deepspeed", "zero2", "--optimizer", "dpsgd"],
            2,
            {},
            r"dpsgd.*ZeRO-2",
        ),
    ],
    "`--deepspeed` ZeRO ≥ 1 with Eva": [
        ("finetune", ["--deepspeed", "zero2", "--optimizer", "eva"], 2, {}, r"optimizer=eva keeps per-layer"),
    ],
    "`--deepspeed` ZeRO ≥ 1 with `--fault-tolerance`": [
        (
            "finetune",
            ["--deepspeed", "zero3", "--fault-tolerance", "true"],
            2,
            {},
            r"fault_tolerance with DeepSpeed ZeRO-3",
        ),
    ],
    "`--deepspeed` with `pretrain`": [
        ("pretrain", ["--deepspeed", "zero2"], 2, {}, r"hf-dtrain pretrain runs DDP through Accelerate"),
    ],
    "`--fsdp` with `--deepspeed`": [
        ("finetune", ["--fsdp", "true", "--deepspeed", "zero2"], 2, {}, r"fsdp and deepspeed are two sharding engines"),
    ],
    "`--fsdp` with a comm hook and `fsdp.replicate` 1": [
        ("pretrain", ["--fsdp", "true", "--comm-hook", "acp_sgd"], 2, {}, r"--fsdp.replicate"),
    ],
    "`--fsdp.replicate N` with `--comm-hook dear\\|embrace\\|s2_reducer\\|noop`": [
        (
            "pretrain",
            ["--fsdp.replicate", "2", "--comm-hook", "dear"],
            4,
            {},
            r"dear cannot carry FSDP2",
        ),
        (
            "pretrain",
            ["--fsdp.replicate", "2", "--comm-hook", "s2_reducer"],
            4,
            {},
            r"s2_reducer cannot carry",
        ),
    ],
    "`--fsdp` with an exchanging optimizer": [
        (
            "pretrain",
            ["--fsdp", "true", "--optimizer", "dpsgd"],
            2,
            {},
            r"each rank holds a shard, not a",
        ),
    ],
    "`--fsdp` with an Accelerate FSDP launch config": [
        (
            "finetune",
            ["--fsdp", "true"],
            2,
            {"ACCELERATE_USE_FSDP": "true"},
            r"--fsdp and an Accelerate FSDP",
        ),
    ],
    "`--tp/--pp/--dp-*` with `--comm-hook`": [
        ("pretrain", ["--tp", "2", "--comm-hook", "acp_sgd"], 2, {}, r"comm_hook with --tp"),
    ],
    "`--tp/--pp/--dp-*` with `--delta`": [
        ("pretrain", ["--pp", "2", "--delta", "0.5"], 2, {}, r"delta with --tp"),
    ],
    "`--tp/--pp/--dp-*` with `--hetero-speeds`": [
        ("pretrain", ["--tp", "2", "--hetero-speeds", "1", "1"], 2, {}, r"hetero_speeds with --tp"),
    ],
    "`--tp/--pp/--dp-*` with `--optimizer` other than adamw": [
        ("pretrain", ["--tp", "2", "--optimizer", "eva"], 2, {}, r"optimizer=eva with --tp"),
    ],
    "`--tp/--pp/--dp-*` with `--fsdp.replicate`": [
        ("pretrain", ["--dp-shard", "2", "--fsdp.replicate", "2"], 2, {}, r"fsdp.replicate and --tp"),
    ],
    "`--tensor-parallel.*` / `--pipeline.*` with `--tp 1` / `--pp 1`": [
        ("pretrain", ["--tensor-parallel.sequence-parallel", "true"], 1, {}, r"sequence_parallel given but --tp is 1"),
        ("pretrain", ["--tensor-parallel.loss-parallel", "false"], 1, {}, r"loss_parallel given but --tp is 1"),
        ("pretrain", ["--pipeline.microbatches", "4"], 1, {}, r"pipeline.microbatches given but --pp is 1"),
        ("pretrain", ["--tp", "2", "--pipeline.schedule", "gpipe"], 2, {}, r"pipeline.schedule given but --pp is 1"),
    ],
    "`--plan auto` with `--tp/--pp/--dp-*`": [
        ("pretrain", ["--plan", "auto", "--tp", "2"], 2, {}, r"--plan auto chooses --tp"),
    ],
    "degrees whose product is not the process count, a `--tp` not dividing the heads / KV heads / MLP / vocabulary, "
    "more stages than layers": [
        ("pretrain", ["--tp", "2"], 3, {}, r"= 2 does not divide the 3 processes"),
        ("pretrain", ["--tp", "3"], 3, {}, r"--tp 3 does not divide the model's num_attention_heads"),
        ("pretrain", ["--pp", "64"], 64, {}, r"64 stages, but the model has 4 decoder layers"),
    ],
}


def refusal(job: str, flags: list[str], world: int, env: dict, monkeypatch) -> str | None:
    """The message with which ``job`` refuses ``flags`` on ``world`` processes before any process group, or None:
    the command line parsed, the config built, and the job's run started up to the process group (the launch
    environment resolved, the clashes, each section's checks)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # the world is given: SFTConfig would start a group on it
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        name, ns = cli.parse([job, *flags])
        cfg = job_config_from_args(ns, cli.config_class(cli.JOBS[name]))
        JobRun(cfg, world_size=world, start=False)
    except ValueError as e:
        return str(e)
    return None


def documented_table() -> str:
    text = open(DOC).read()
    section = text.split("## Clashes refused, and why", 1)[1].split("\n## ", 1)[0]
    return "\n".join(line for line in section.splitlines() if line.startswith("|"))


def test_the_docs_table_is_the_sections_table():
    """docs/compose.md shows the refusals the sections declare (regenerate it with ``python -m
    hf_dtrain.run.section``)."""
    assert documented_table() == clash_table()


def test_every_documented_clash_has_a_check():
    rows = documented_clashes()
    assert len(rows) >= 20, rows  # the table was read
    assert sorted(rows) == sorted(EXAMPLES), set(rows) ^ set(EXAMPLES)


@pytest.mark.parametrize(
    "job, flags, world, env, message",
    [example for row in EXAMPLES.values() for example in row],
    ids=[f"{e[0]}-{' '.join(e[1])}-world{e[2]}" for row in EXAMPLES.values() for e in row],
)
def test_a_documented_clash_is_refused(monkeypatch, job, flags, world, env, message):
    text = refusal(job, flags, world, env, monkeypatch)
    assert text is not None, f"hf-dtrain {job} {' '.join(flags)} on {world} processes was not refused"
    assert re.search(message, text, re.S | re.I), text


def test_the_same_settings_alone_are_taken(monkeypatch):
    """The refusals are about the combinations: each side alone (on a world it fits) passes the same checks."""
    for job, flags, world in (
        ("pretrain", ["--comm-hook", "acp_sgd"], 2),
        ("pretrain", ["--optimizer", "dpsgd"], 2),
        ("pretrain", ["--tp", "2", "--tensor-parallel.sequence-parallel", "true"], 2),
        ("pretrain", ["--pp", "2", "--pipeline.microbatches", "4"], 2),
        ("finetune", ["--method", "lora", "--optimizer", "eva"], 2),
        ("finetune", ["--fsdp", "true"], 2),
        ("pretrain", ["--fault-tolerance", "true", "--comm-hook", "acp_sgd"], 2),
    ):
        assert refusal(job, flags, world, {}, monkeypatch) is None, (job, flags)
