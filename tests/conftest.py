import os

import pytest
import torch

from hf_dtrain import processes

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the tests' numerics in fp32 on every host: the jobs' default takes bf16 autocast on a CPU that computes it natively
# (hf_dtrain.fast.cpu_bf16), and the references the tests compare with are fp32; a test of that default sets it back
os.environ.setdefault("HF_DTRAIN_CPU_BF16", "0")
torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_finish(session):
    """The embedded default base, built (and cached) once before the first test when a collected test is marked
    ``default_base``: on a fresh machine it takes minutes, which would otherwise land inside the first such test's
    time guard (60 s for the bad-input tests), and every later one would build it again."""
    if any(item.get_closest_marker("default_base") for item in session.items):
        from hf_dtrain.errors import ModelLoadError
        from hf_dtrain.jobs.sft.config import FinetuneConfig
        from hf_dtrain.models import base_model_path

        try:  # the real default (read from its GGUF once, ~20 s) where its package is installed
            base_model_path(preset=FinetuneConfig().base_preset, progress=False)
        except ModelLoadError:  # not installed: the tests that need it say so
            pass


def _files(root) -> dict:
    """Every file under ``root`` with its size and modification time, to tell whether anything wrote there."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            stat = os.stat(path)
            out[os.path.relpath(path, root)] = (stat.st_size, stat.st_mtime_ns)
    return out


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    """``tiny_base(steps)``: the embedded default base at test size (``hf_dtrain.testing.tiny_default_base``),
    built once per ``steps`` for the whole session (4-30 s each) instead of once per test or module. The bases are
    shared, so a test must treat them as read-only: copy one before writing into it. At the end of the session every
    base is checked to be unchanged, which fails the run naming the file a test wrote."""
    from hf_dtrain.testing import tiny_default_base

    root = tmp_path_factory.mktemp("tiny_bases")
    built: dict[int, tuple[str, dict]] = {}

    def get(steps: int = 200) -> str:
        if steps not in built:
            path = tiny_default_base(root, steps=steps)
            built[steps] = (path, _files(path))
        return built[steps][0]

    yield get
    changed = []
    for path, before in built.values():
        after = _files(path)
        changed += [
            f"{path}: {name}" for name in sorted(set(before) | set(after)) if before.get(name) != after.get(name)
        ]
    assert not changed, f"a test wrote into a shared tiny base (copy it first): {changed}"


@pytest.fixture
def tiny_base_dir(tmp_path):
    """A tiny LLaMA saved with save_pretrained, so adapters record a loadable base_model_name_or_path."""
    from transformers import AutoModelForCausalLM

    from hf_dtrain.testing import tiny_llama

    path = tmp_path / "base"
    tiny_llama().save_pretrained(path)
    return str(path), AutoModelForCausalLM.from_pretrained(path)


@pytest.fixture
def merge_qahira_exactly():
    """Runs ``recipes/merge_qahira_4bit.py`` on a trained QA-HiRA adapter directory and checks the merged 4-bit
    model's logits equal the adapter model's, before and after a save and reload."""
    import json
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))

    def check(adapter_dir, eval_size: int = 50) -> dict:
        proc = processes.run(
            [
                sys.executable,
                os.path.join(repo, "recipes", "merge_qahira_4bit.py"),
                str(adapter_dir),
                "--eval-size",
                str(eval_size),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        merge = json.load(open(f"{adapter_dir}-merged/merge.json"))
        assert merge["max_abs_logit_diff"] < 1e-4 and merge["reload_max_abs_logit_diff"] == 0
        return merge

    return check
