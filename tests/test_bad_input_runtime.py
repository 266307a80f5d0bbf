"""Malformed input met while a job runs, as a new user hands it over: data files, model and adapter directories,
output and snapshot directories, endpoints, losses that diverge. Each case runs ``hf-dtrain`` (in this process, as
the console script does) and asserts what the user sees: exit status 1, one line naming the job and the input, no
traceback (Python's or C++ frames), no training (no results written), in under 60 s. A few run the real console
script and ``torchrun`` in subprocesses, for the status and the output of a launched rank."""

import json
import os
import re
import socket
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

from hf_dtrain import cli, processes

pytestmark = [pytest.mark.timeout(60), pytest.mark.default_base]  # the base is built before any guard runs
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


PAIRS = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(40)]
TEXTS = [{"text": f"line {i} of a small corpus"} for i in range(40)]

# name -> bytes: the files the cases hand over
FILES = {
    "empty.jsonl": b"",
    "blank.jsonl": b"\n\n   \n",
    "empty_array.json": b"[]",
    "array_of_numbers.json": b"[1, 2, 3]",
    "latin1.jsonl": _jsonl(PAIRS[:5]).encode() + '{"prompt": "caf\xe9=", "completion": "x"}\n'.encode("latin-1"),
    "latin1.txt": "caf\xe9 au lait\n".encode("latin-1") * 50,
    "null_completion.jsonl": _jsonl([*PAIRS[:3], {"prompt": "1+1=", "completion": None}, *PAIRS[3:20]]).encode(),
    "missing_completion.jsonl": _jsonl([*PAIRS[:3], {"prompt": "1+1="}, *PAIRS[3:20]]).encode(),
    "number_completion.jsonl": _jsonl([*PAIRS[:2], {"prompt": "1+1=", "completion": 2}, *PAIRS[2:20]]).encode(),
    "null_text.jsonl": _jsonl([*TEXTS[:5], {"text": None}, *TEXTS[5:]]).encode(),
    "number_text.jsonl": _jsonl([{"text": 5}, *TEXTS]).encode(),
    "bad_line.jsonl": (_jsonl(PAIRS[:4]) + "{not json\n" + _jsonl(PAIRS[4:10])).encode(),
    "list_line.jsonl": (_jsonl(PAIRS[:4]) + "[1, 2]\n").encode(),
    "no_format.jsonl": _jsonl([{"question": "q", "answer": "a"}] * 20).encode(),
    "one_row.jsonl": _jsonl(PAIRS[:1]).encode(),
    "ten_rows.jsonl": _jsonl(PAIRS[:10]).encode(),
    "extra_fields.csv": b"prompt,completion\n1+1=,2\n2+2=,4,extra\n3+3=,6\n",
    "missing_fields.csv": b"prompt,completion\n1+1=,2\n2+2=\n3+3=,6\n",
    "no_header.csv": b"\n\n",
    "bad_messages.jsonl": _jsonl([{"messages": "hello"}] * 20).encode(),
    "messages_without_content.jsonl": _jsonl([{"messages": [{"role": "user"}]}] * 20).encode(),
    "chat.jsonl": _jsonl(
        [{"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}] * 20
    ).encode(),
    "texts.jsonl": _jsonl(TEXTS).encode(),
    "data.xml": b"<rows/>",
    "tiny.txt": b"a b c\n",
    "a_file": b"not a directory",
}


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    """The bad files and directories, once for the module."""
    root = tmp_path_factory.mktemp("bad_input")
    for name, data in FILES.items():
        (root / name).write_bytes(data)
    (root / "a_directory.jsonl").mkdir()
    (root / "no_weights").mkdir()
    (root / "no_weights" / "config.json").write_text('{"model_type": "llama"}')
    (root / "no_config").mkdir()
    (root / "bad_config").mkdir()
    (root / "bad_config" / "config.json").write_text('{"model_type": "no_such_architecture"}')
    save_file({"w": torch.zeros(2)}, str(root / "bad_config" / "model.safetensors"))
    (root / "truncated").mkdir()
    (root / "truncated" / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": torch.zeros(256, 256)}, str(root / "truncated" / "model.safetensors"))
    data = (root / "truncated" / "model.safetensors").read_bytes()
    (root / "truncated" / "model.safetensors").write_bytes(data[: len(data) // 3])
    from hf_dtrain.testing import tiny_llama

    tiny_llama(hidden_size=32).save_pretrained(root / "no_tokenizer")  # weights and config, no tokenizer files
    (root / "unknown_peft").mkdir()
    (root / "unknown_peft" / "adapter_config.json").write_text('{"peft_type": "NO_SUCH_TUNER"}')
    (root / "template.jinja").write_text("{{ messages }}")
    return root


def _run(argv, capfd):
    """``hf-dtrain argv`` in this process: (exit status, what it printed on both streams, seconds)."""
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    seconds = time.monotonic() - t0
    code = info.value.code
    captured = capfd.readouterr()
    out = captured.out + captured.err + (code if isinstance(code, str) else "")
    return (1 if isinstance(code, str) else code), out, seconds


def _assert_refused(argv, message, capfd, out_dir=None):
    code, out, seconds = _run(argv, capfd)
    job = argv[0] if argv[0] != "fed" else "fed simulate"
    assert code == 1, (code, out[-3000:])
    assert "Traceback" not in out and "frame #" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith(f"hf-dtrain {job}")]
    assert len(lines) == 1, out[-3000:]  # the error, once, on one line
    assert re.search(message, lines[0]), lines[0]
    assert seconds < 60
    if out_dir is not None:  # nothing trained: no results, no model
        assert not os.path.exists(os.path.join(out_dir, "results.json"))
        assert not any(n.endswith(".safetensors") for n in os.listdir(out_dir)) if os.path.isdir(out_dir) else True
    return lines[0]


FAST = ["--max-steps", "2", "--progress", "false"]
PRETRAIN = ["--seq-len", "16", "--per-device-train-batch-size", "2", "--data-bytes", "60000", "--eval-blocks", "2"]

# (id, argv with {d} for the files' directory and {o} for a fresh output directory, regex the line must match)
CASES = [
    # pretrain: data
    ("pt-batch-larger-than-corpus", ["pretrain", "--per-device-train-batch-size", "100000"], r"100000.*--per-device"),
    ("pt-empty", ["pretrain", "--dataset", "{d}/empty.jsonl"], r"empty.jsonl is empty"),
    ("pt-blank", ["pretrain", "--dataset", "{d}/blank.jsonl"], r"blank.jsonl is empty"),
    ("pt-latin1", ["pretrain", "--dataset", "{d}/latin1.txt"], r"latin1.txt: line 1 .*0xe9.*not UTF-8.*iconv"),
    ("pt-null-text", ["pretrain", "--dataset", "{d}/null_text.jsonl"], r"null_text.jsonl: row 5 .*'text'"),
    ("pt-number-text", ["pretrain", "--dataset", "{d}/number_text.jsonl"], r"row 0 .*'text' holds int"),
    ("pt-bad-line", ["pretrain", "--dataset", "{d}/bad_line.jsonl"], r"bad_line.jsonl: line 5 is not a JSON object"),
    ("pt-list-line", ["pretrain", "--dataset", "{d}/list_line.jsonl"], r"line 5 is a JSON list, not an object"),
    ("pt-array-numbers", ["pretrain", "--dataset", "{d}/array_of_numbers.json"], r"element 0 .*not an object"),
    ("pt-too-few-blocks", ["pretrain", "--dataset", "{d}/tiny.txt"], r"tiny.txt gives 0 training blocks"),
    ("pt-text-column", ["pretrain", "--dataset", "{d}/ten_rows.jsonl", "--text-column", "nope"], r"no column 'nope'"),
    ("pt-xml", ["pretrain", "--dataset", "{d}/data.xml"], r"data.xml: unsupported file type 'xml'"),
    ("pt-directory", ["pretrain", "--dataset", "{d}/a_directory.jsonl"], r"a_directory.jsonl is a directory"),
    ("pt-hub-offline", ["pretrain", "--dataset", "no-such-user/no-such-set"], r"'no-such-user/no-such-set' is not a"),
    (
        "pt-stream-number",
        ["pretrain", "--dataset", "{d}/number_text.jsonl", "--streaming", "true"],
        r"number_text.jsonl \(streamed row 0\).*holds int",
    ),
    (
        "pt-blocks-longer-than-corpus",
        ["pretrain", "--seq-len", "100000", "--per-device-train-batch-size", "1"],
        r"--data-bytes \(the default corpus, \d+ bytes\) gives 0 training blocks of 100000 tokens",
    ),
    # pretrain: settings only checked at run time, files, divergence
    ("pt-sp-with-tp1", ["pretrain", "--tensor-parallel.sequence-parallel", "true"], r"sequence_parallel given.*--tp"),
    ("pt-schedule-with-pp1", ["pretrain", "--pipeline.schedule", "1f1b"], r"pipeline.schedule given.*--pp is 1"),
    ("pt-comm-hook-1-process", ["pretrain", "--comm-hook", "acp_sgd"], r"acp_sgd needs >= 2 processes"),
    (
        "pt-shared-ft-dir",
        ["pretrain", "--fault-tolerance.directory", "/tmp"],
        r"^(?!.*chmod).*/tmp has mode.*e\.g\. /tmp/hf_dtrain",  # a private directory suggested, never chmod /tmp
    ),
    (
        "pt-persist-dir",
        ["pretrain", "--fault-tolerance.persist-dir", "{d}/a_file/snapshots"],
        r"persist.dir .*a_file/snapshots cannot be written",
    ),
    ("pt-output-dir", ["pretrain", "--output-dir", "{d}/a_file/out"], r"--output-dir .*a_file/out cannot be written"),
    (
        "pt-nan-loss",
        ["pretrain", "--learning-rate", "1e30", "--warmup-steps", "0", "--max-steps", "6"],
        r"training loss is nan at step \d.*--stop-on-nonfinite-loss false",
    ),
    ("pt-fsdp-layer-class", ["pretrain", "--fsdp.layer-classes", "NoSuchLayer"], r"NoSuchLayer"),
    # finetune: data
    ("ft-empty", ["finetune", "--dataset", "{d}/empty.jsonl"], r"empty.jsonl is empty"),
    ("ft-empty-array", ["finetune", "--dataset", "{d}/empty_array.json"], r"JSON array is empty"),
    ("ft-null-completion", ["finetune", "--dataset", "{d}/null_completion.jsonl"], r"row 3 .*'completion' \(null"),
    ("ft-missing-completion", ["finetune", "--dataset", "{d}/missing_completion.jsonl"], r"row 3 .*'completion'"),
    ("ft-number-completion", ["finetune", "--dataset", "{d}/number_completion.jsonl"], r"'completion' holds int"),
    ("ft-extra-fields", ["finetune", "--dataset", "{d}/extra_fields.csv"], r"line 3 has 3 fields, the header 2"),
    ("ft-missing-fields", ["finetune", "--dataset", "{d}/missing_fields.csv"], r"line 3 has 1 fields, the header 2"),
    ("ft-no-header", ["finetune", "--dataset", "{d}/no_header.csv"], r"no_header.csv is empty"),
    ("ft-latin1", ["finetune", "--dataset", "{d}/latin1.jsonl"], r"latin1.jsonl: line 6 .*0xe9.*not UTF-8"),
    ("ft-one-row", ["finetune", "--dataset", "{d}/one_row.jsonl"], r"one_row.jsonl' has 1 row"),
    ("ft-bad-line", ["finetune", "--dataset", "{d}/bad_line.jsonl"], r"line 5 is not a JSON object"),
    ("ft-no-format", ["finetune", "--dataset", "{d}/no_format.jsonl"], r"columns \['question', 'answer'\], none"),
    ("ft-bad-messages", ["finetune", "--dataset", "{d}/bad_messages.jsonl"], r"column 'messages' holds"),
    ("ft-no-content", ["finetune", "--dataset", "{d}/messages_without_content.jsonl"], r"'messages' holds .*role"),
    (
        "ft-fewer-than-a-batch",
        ["finetune", "--dataset", "{d}/ten_rows.jsonl", "--per-device-train-batch-size", "16"],
        r"ten_rows.jsonl gives 8 training examples, fewer than the 16",
    ),
    (
        "ft-text-field",
        ["finetune", "--dataset", "{d}/texts.jsonl", "--dataset-text-field", "body"],
        r"texts.jsonl has columns \['text'\], none of TRL's formats.*now 'body'",
    ),
    ("ft-xml", ["finetune", "--dataset", "{d}/data.xml"], r"unsupported file type 'xml'"),
    ("ft-default-task-batch", ["finetune", "--train-size", "4"], r"--train-size .*gives 4 training examples"),
    # finetune: models, adapters, files, settings read at run time, divergence
    ("ft-model-no-weights", ["finetune", "--model", "{d}/no_weights"], r"no_weights holds no weights"),
    ("ft-model-no-config", ["finetune", "--model", "{d}/no_config"], r"no_config holds no config.json"),
    ("ft-model-bad-config", ["finetune", "--model", "{d}/bad_config"], r"bad_config: config.json does not build"),
    ("ft-model-truncated", ["finetune", "--model", "{d}/truncated"], r"model.safetensors is damaged or truncated"),
    ("ft-model-no-tokenizer", ["finetune", "--model", "{d}/no_tokenizer"], r"no_tokenizer: its tokenizer does not"),
    ("ft-peft-config-unknown", ["finetune", "--peft-config", "{d}/unknown_peft"], r"adapter_config.json is not a"),
    ("ft-chat-template", ["finetune", "--chat-template-path", "{d}/none.jinja"], r"none.jinja is not a file"),
    ("ft-resume", ["finetune", "--resume-from-checkpoint", "{d}/no_checkpoint"], r"no_checkpoint is not a checkpoint"),
    (
        "ft-assistant-only",
        ["finetune", "--dataset", "{d}/ten_rows.jsonl", "--assistant-only-loss", "true"]
        + ["--per-device-train-batch-size", "2"],
        r"--assistant-only-loss needs conversational data",
    ),
    ("ft-output-dir", ["finetune", "--output-dir", "{d}/a_file/out"], r"--output-dir .*cannot be written"),
    ("ft-shared-ft-dir", ["finetune", "--fault-tolerance.directory", "/tmp"], r"^(?!.*chmod).*/tmp has mode"),
    ("ft-comm-hook-1-process", ["finetune", "--comm-hook", "s2_reducer"], r"s2_reducer needs >= 2 processes"),
    ("ft-mesh-flag", ["finetune", "--tp", "2"], r"--tp is a pretrain flag"),
    (
        "ft-nan-loss",
        ["finetune", "--method", "lora", "--adam-epsilon", "0", "--warmup-steps", "0", "--max-steps", "4"]
        + ["--train-size", "64"],
        r"training loss is nan at step \d",
    ),
    # sweep and fed: the same data and model checks, and their own refusals
    ("sweep-null-completion", ["sweep", "--dataset", "{d}/null_completion.jsonl"], r"row 3 .*'completion'"),
    ("sweep-model", ["sweep", "--model", "{d}/no_weights"], r"no_weights holds no weights"),
    ("sweep-dora", ["sweep", "--method", "dora"], r"dora"),
    ("sweep-comm-hook", ["sweep", "--comm-hook", "acp_sgd"], r"comm.hook"),
    ("fed-latin1", ["fed", "simulate", "--dataset", "{d}/latin1.jsonl"], r"latin1.jsonl: line 6 .*not UTF-8"),
    ("fed-model", ["fed", "simulate", "--model", "{d}/no_config"], r"no_config holds no config.json"),
    ("fed-per-round", ["fed", "simulate", "--clients", "2", "--per-round", "5"], r"per.round"),
    ("fed-chat-template", ["fed", "simulate", "--chat-template-path", "{d}/none.jinja"], r"none.jinja is not a file"),
    # plan
    (
        "plan-world-0",
        ["plan", "--world-size", "0"],
        r"world_size must be an integer >= 1, got 0; set world_size \(--world-size\)",
    ),
    (
        "plan-seq-len-0",
        ["plan", "--world-size", "8", "--seq-len", "0"],
        r"seq_len must be .* got 0; set seq_len \(--seq-len\)",
    ),
    ("plan-batch-0", ["plan", "--world-size", "8", "--global-batch", "0"], r"global_batch must be .*--global-batch"),
    ("plan-profile", ["plan", "--world-size", "8", "--profile", "{d}/none.json"], r"--profile .*none.json: no such"),
    ("plan-model-config", ["plan", "--world-size", "8", "--model-config", "{d}/no_config"], r"--model-config"),
    # elastic
    ("elastic-no-port", ["elastic", "--endpoint", "nohostport"], r"'nohostport' is not host:port"),
    ("elastic-port-range", ["elastic", "--endpoint", "127.0.0.1:99999"], r"port '99999' is not a number from 1"),
    ("elastic-no-host", ["elastic", "--endpoint", "no-such-host.invalid:29400"], r"no-such-host.invalid' does not"),
    ("elastic-timeout-0", ["elastic", "--connect-timeout", "0"], r"--connect-timeout must be a positive"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_at_run_time(place, tmp_path, capfd, monkeypatch, argv, message, tiny_base):
    monkeypatch.chdir(tmp_path)
    import datasets.config
    import huggingface_hub.constants

    # a hub id fails at once, not after network retries (the libraries read HF_HUB_OFFLINE when imported)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    out_dir = str(tmp_path / "out")
    argv = [a.replace("{d}", str(place)) for a in argv]
    if argv[0] in ("pretrain", "finetune", "sweep", "fed"):
        if "--output-dir" not in argv:
            argv += ["--output-dir", out_dir]
        argv += FAST if "--max-steps" not in argv and argv[0] != "fed" else ["--progress", "false"]
        if argv[0] != "pretrain" and "--model" not in argv:  # what is refused is the input, not the default base
            argv += ["--model", tiny_base(5)]
        if argv[0] == "pretrain" and "--seq-len" not in argv and "100000" not in argv:
            argv += PRETRAIN
        elif argv[0] == "pretrain":
            argv += ["--data-bytes", "60000"]
    _assert_refused(argv, message, capfd, out_dir)


def test_an_endpoint_where_no_store_answers_is_named_within_the_timeout(capfd):
    port = _free_port()
    line = _assert_refused(
        ["elastic", "--endpoint", f"127.0.0.1:{port}", "--store-host", "false", "--connect-timeout", "2"],
        rf"no rendezvous store answers at --endpoint 127.0.0.1:{port} after 2 s",
        capfd,
    )
    assert "Connection refused" in line


def test_debug_shows_the_traceback(place, tmp_path, capfd, monkeypatch):
    """``--debug`` (or HF_DTRAIN_DEBUG=1): the same one line, after the traceback."""
    monkeypatch.delenv("HF_DTRAIN_DEBUG", raising=False)
    code, out, _ = _run(["pretrain", "--dataset", f"{place}/empty.jsonl", "--debug", *FAST], capfd)
    assert code == 1 and "Traceback" in out and "DataError" in out and "empty.jsonl is empty" in out
    assert "HF_DTRAIN_DEBUG" not in os.environ  # the flag is this run's, not the process's
    monkeypatch.setenv("HF_DTRAIN_DEBUG", "1")
    code, out, _ = _run(["pretrain", "--dataset", f"{place}/empty.jsonl", *FAST], capfd)
    assert code == 1 and "Traceback" in out and "empty.jsonl is empty" in out


def test_a_bug_keeps_its_traceback(monkeypatch):
    """An error hf_dtrain did not raise on purpose (here a torch error inside our code) is not dressed up as bad
    input: it reaches the user with its traceback."""
    from hf_dtrain.jobs import pretrain

    def broken(*args, **kwargs):
        return torch.zeros(2) @ torch.zeros(3)  # a shape error raised by torch, not by a raise statement of ours

    monkeypatch.setattr(pretrain, "run_pretrain", broken)
    with pytest.raises(RuntimeError):
        cli.main(["pretrain", *FAST])


def test_train_on_through_a_nan_when_asked(tmp_path, capfd):
    """The opt-out: --stop-on-nonfinite-loss false trains on (as the Trainer would) and exits 0."""
    out = tmp_path / "out"
    argv = ["pretrain", "--learning-rate", "1e30", "--warmup-steps", "0", "--max-steps", "4", "--progress", "false"]
    assert (
        cli.main(
            [*argv, *PRETRAIN, "--save-model", "false", "--output-dir", str(out)]
            + [
                "--stop-on-nonfinite-loss",
                "false",
            ]
        )
        == 0
    )
    history = [json.loads(line) for line in open(out / "history_rank0.jsonl")]
    assert any(h["loss"] != h["loss"] for h in history)  # it did go through NaN


def test_the_console_script_exits_1_with_one_line(place, tmp_path):
    """The real ``hf-dtrain`` process: status 1 and one line on stderr, no traceback."""
    script = os.path.join(os.path.dirname(sys.executable), "hf-dtrain")
    command = [script] if os.path.exists(script) else [sys.executable, "-m", "hf_dtrain.cli"]
    proc = processes.run(
        [*command, "pretrain", "--per-device-train-batch-size", "100000", "--output-dir", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("hf-dtrain pretrain: --data-bytes (the default corpus")


# adapters: hf_dtrain.load_adapter (PeftModel.from_pretrained behind a check), for peft's tuners and ours
@pytest.fixture(scope="module")
def saved_adapters(tmp_path_factory):
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import hf_dtrain
    from hf_dtrain.testing import tiny_llama

    root = tmp_path_factory.mktemp("adapters")
    base_dir = root / "base"
    tiny_llama(seed=0, hidden_size=32).save_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir)  # as users load it: the adapter records base_dir
    configs = {
        "lora": LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
        "lora_head": LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]),
        "lorafa": hf_dtrain.LoraFAConfig(r=4, target_modules=["q_proj"]),
        "qbara": hf_dtrain.QBaRAConfig(target_modules=["q_proj"]),
        "smt": hf_dtrain.SMTConfig(block_size=8, num_blocks=2, target_modules=["q_proj"]),
    }
    for name, config in configs.items():
        model = get_peft_model(copy.deepcopy(base), config)
        if name == "smt":
            hf_dtrain.set_smt_block_indices(model, {key: [[0, 0], [1, 1]] for key in _smt_keys(model)})
        model.save_pretrained(root / name)
    (root / "no_weights").mkdir()
    (root / "no_weights" / "adapter_config.json").write_text((root / "lora" / "adapter_config.json").read_text())
    return root


def _smt_keys(model):
    from hf_dtrain.tuners.smt.layer import SMTLayer

    return [m.smt_layer_key["default"] for m in model.modules() if isinstance(m, SMTLayer)]


ADAPTER_CASES = [
    (
        "lora",
        dict(num_hidden_layers=1),
        r"saved on .*base\): num_hidden_layers is 2 in .*base, 1 in this base; it adapts 2 decoder layers",
    ),
    ("lora", dict(hidden_size=64), r"hidden_size is 32 in .*base, 64|size mismatch"),
    ("lora_head", dict(hidden_size=64), r"lm_head.weight is \[128, 32\] in the adapter, \[128, 64\]|hidden_size"),
    ("lorafa", dict(num_hidden_layers=1), r"adapts 2 decoder layers.*lorafa_A"),
    ("qbara", dict(num_hidden_layers=1), r"adapts 2 decoder layers.*qbara_A"),
    ("smt", dict(num_hidden_layers=1), r"adapts 2 decoder layers.*smt_"),
    ("no_weights", dict(), r"holds no adapter_model.safetensors"),
]


@pytest.mark.parametrize("name, base_kwargs, message", ADAPTER_CASES, ids=[f"{c[0]}-{c[1]}" for c in ADAPTER_CASES])
def test_an_adapter_onto_another_base_is_refused(saved_adapters, name, base_kwargs, message):
    """``hf_dtrain.load_adapter`` refuses, naming what differs, what peft itself loads without a word (an adapter of
    2 decoder layers onto a 1-layer base: peft drops the layer that does not fit)."""
    from peft import PeftModel

    from hf_dtrain import load_adapter
    from hf_dtrain.errors import UserError
    from hf_dtrain.testing import tiny_llama

    kwargs = {"hidden_size": 32, **base_kwargs}
    if base_kwargs == {"num_hidden_layers": 1} and name == "lora":  # why the check exists
        PeftModel.from_pretrained(tiny_llama(seed=0, **kwargs), str(saved_adapters / name))
    with pytest.raises(UserError, match=message) as info:
        load_adapter(tiny_llama(seed=0, **kwargs), str(saved_adapters / name))
    assert str(saved_adapters / name) in str(info.value)


@pytest.mark.parametrize("name", ["lora", "lora_head", "lorafa", "qbara", "smt"])
def test_an_adapter_onto_its_own_base_loads_as_peft_would(saved_adapters, name):
    from peft import PeftModel

    from hf_dtrain import load_adapter
    from hf_dtrain.testing import tiny_llama

    ours = load_adapter(tiny_llama(seed=0, hidden_size=32), str(saved_adapters / name))
    theirs = PeftModel.from_pretrained(tiny_llama(seed=0, hidden_size=32), str(saved_adapters / name))
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_persisted_snapshot_that_cannot_be_written_fails_the_run(tmp_path):
    """The disk fills or the directory goes away mid-run: the background write's error reaches the training thread
    (the next wait) as a WriteFailure naming the path, instead of a thread traceback and a run that exits 0."""
    import contextlib
    import shutil

    from hf_dtrain.errors import WriteFailure
    from hf_dtrain.fault import SnapshotEngine
    from hf_dtrain.testing import random_batch, stop_snapshot_processes, tiny_llama

    torch.manual_seed(0)
    model = tiny_llama(seed=0, hidden_size=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    disk, ft_dir = tmp_path / "disk", str(tmp_path / "ft")
    engine = SnapshotEngine(model, opt, directory=ft_dir, parity=0, persist_dir=str(disk), persist_every=1)
    failed_at, message = None, ""
    try:
        for step in range(1, 7):
            try:  # any call on the training thread may surface it: the wait before the step, or the snapshot
                model(**random_batch(batch=2, seq=8, seed=step)).loss.backward()
                engine.wait()
                opt.step()
                opt.zero_grad()
                engine.snapshot(step, extra={"next_step": step + 1})
            except WriteFailure as e:
                failed_at, message = step, str(e)
                break
            if step == 2:  # the persisted copies of steps 1-2 are written; then the directory is gone
                engine.wait()
                engine.persister.join()
                shutil.rmtree(disk)
                disk.write_text("a file where the directory was")
        assert failed_at in (3, 4, 5), failed_at  # within two steps of the failed write
        assert f"{disk}/snapshot-3" in message and "persist_dir" in message, message
    finally:
        with contextlib.suppress(WriteFailure):
            engine.close(shutdown=True)
        stop_snapshot_processes(ft_dir)


@pytest.mark.slow
def test_under_torchrun_the_survivor_names_the_dead_rank_and_how_to_resume(tmp_path):
    """``torchrun --max-restarts 0``: when a rank dies, the agent SIGTERMs the others at once. The survivor still
    prints that it was stopped, at which step, and "relaunch the same command to resume" before it exits (before,
    only torchrun's ChildFailedError table, which names the rank that died)."""
    out = tmp_path / "out"
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.5",
        "--master-port",
        str(_free_port()),
        "-m",
        "hf_dtrain.testing.fault",
        "1:3",
        "hf_dtrain.cli",
        "pretrain",
        "--max-steps",
        "6",
        *PRETRAIN,
        "--output-dir",
        str(out),
        "--fault-tolerance.directory",
        str(tmp_path / "ft"),
        "--progress",
        "false",
        "--save-model",
        "false",
    ]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    try:
        proc = processes.run(argv, capture_output=True, text=True, timeout=120, env=env)
    finally:
        from hf_dtrain.testing import stop_snapshot_processes

        stop_snapshot_processes(tmp_path / "ft")
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    hints = [line for line in text.splitlines() if "Relaunch the same command to resume" in line]
    assert len(hints) == 1, text[-4000:]  # the survivor's line, once
    # the SIGTERM thread's line (at once), or, when the collective failed first, the dead rank named by heartbeats
    assert re.search(
        r"hf_dtrain: rank 0 \(host .*\) was stopped by the launcher \(SIGTERM\) at step [34], most likely because "
        r"another rank failed|hf_dtrain: rank 1 \(host .*last at step 3\) stopped responding while rank 0",
        hints[0],
    ), hints[0]
    assert "Root Cause" in text and "rank      : 1" in text  # torchrun's summary names the rank that died
    assert re.search(r"exitcode  : (143|1) ", text)  # rank 0 exited on its own, after saying so


def test_a_sweep_with_a_diverged_job_saves_the_others_and_exits_1(tmp_path, capfd, tiny_base):
    """The fused sweep stops a diverged job alone (docs/fused.md) and trains the rest: it says so at the end, as one
    line, and exits 1; the job that finished is saved."""
    out = tmp_path / "sweep"
    argv = ["sweep", "--lr", "1e-3,1e30", "--warmup-steps", "0", "--max-steps", "4", "--train-size", "64"]
    argv += ["--model", tiny_base(5)]
    code, text, seconds = _run([*argv, "--progress", "false", "--output-dir", str(out)], capfd)
    assert code == 1 and "Traceback" not in text and seconds < 60, text[-3000:]
    line = next(line for line in text.splitlines() if line.startswith("hf-dtrain sweep:"))
    assert re.search(r"1 of 2 jobs did not finish: \S+ stopped at step \d+: .*non-finite", line), line
    saved = [d for d in os.listdir(out) if os.path.exists(out / d / "adapter_model.safetensors")]
    assert len(saved) == 1, os.listdir(out)
