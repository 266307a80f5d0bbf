import os

import pytest
import torch

from hf_dtrain import processes

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_finish(session):
    """The embedded default base, built (and cached) once before the first test when a collected test is marked
    ``default_base``: on a fresh machine it takes minutes, which would otherwise land inside the first such test's
    time guard (60 s for the bad-input tests), and every later one would build it again."""
    if any(item.get_closest_marker("default_base") for item in session.items):
        from hf_dtrain.models import build_default_model

        build_default_model(progress=False)


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
