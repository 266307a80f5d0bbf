import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def tiny_base_dir(tmp_path):
    """A tiny LLaMA saved with save_pretrained, so adapters record a loadable base_model_name_or_path."""
    from transformers import AutoModelForCausalLM

    from hf_dtrain.testing import tiny_llama

    path = tmp_path / "base"
    tiny_llama().save_pretrained(path)
    return str(path), AutoModelForCausalLM.from_pretrained(path)
