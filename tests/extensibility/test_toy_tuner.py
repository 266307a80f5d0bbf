"""A tuner defined here, outside hf_dtrain, registers itself and is a method of every job: ``hf-dtrain finetune
--method toylr`` trains it, saves it and peft loads it back with its effect on the logits; ``hf-dtrain sweep --method
toylr`` trains it fused through the form it registered, or refuses with the reason it declares."""

import json
import os
import re

import pytest
import torch

from hf_dtrain.tuners._registry import saved_peft_type
from hf_dtrain.tuners.finetune_method import unregister_finetune_method

from . import toy_tuner

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base_path(tiny_base):

    return tiny_base(50)


@pytest.fixture
def toy():
    yield toy_tuner.register()
    unregister_finetune_method(toy_tuner.NAME)


TASK = ["--task-digits", "1", "--train-size", "256", "--eval-size", "16", "--progress", "false"]


def test_finetune_trains_saves_and_peft_reloads_the_toy_tuner(base_path, tmp_path, toy):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_dtrain.cli import build_parser, main

    assert "toylr" in build_parser("finetune").format_help()  # --method's choices and its --toylr.scale section
    assert "--toylr.scale" in build_parser("finetune").format_help()
    out = tmp_path / "toy"
    flags = ["--model", base_path, "--output-dir", str(out), "--max-steps", "40", "--learning-rate", "1e-2"]
    assert main(["finetune", "--method", "toylr", "--toylr.scale", "2", *flags, *TASK]) == 0

    results = json.loads((out / "results.json").read_text())
    assert results["method"] == "toylr" and results["eval_loss_after"] < results["eval_loss_before"]
    saved = json.loads((out / "adapter_config.json").read_text())
    assert saved["peft_type"] == saved_peft_type("TOYLR") and saved["scale"] == 2.0  # its own setting reached it

    base = AutoModelForCausalLM.from_pretrained(base_path)
    ids = torch.randint(0, base.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        model = PeftModel.from_pretrained(base, str(out))
        layer = model.base_model.model.model.layers[0].self_attn.q_proj
        assert isinstance(layer, toy_tuner.ToyLinear) and layer.toylr_B["default"].abs().sum() > 0  # trained
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            assert torch.equal(model(input_ids=ids).logits, plain)
        merged = model.merge_and_unload()(input_ids=ids).logits
    assert (adapted - plain).abs().max() > 1e-3  # the reloaded adapter changes the output
    torch.testing.assert_close(merged, adapted, rtol=1e-4, atol=1e-4)  # and merges into the weights exactly


def test_sweep_trains_the_toy_tuner_fused(base_path, tmp_path, toy):
    from hf_dtrain.cli import main

    out = tmp_path / "sweep"
    flags = ["--model", base_path, "--output-dir", str(out), "--max-steps", "20", "--lr", "1e-2,3e-3"]
    assert main(["sweep", "--method", "toylr", "--toylr.scale", "2", "--report", "false", *flags, *TASK]) == 0
    table = json.loads((out / "sweep.json").read_text())
    assert [row["status"] for row in table["jobs"]] == ["ok", "ok"]
    for row in table["jobs"]:  # each job saved as a peft adapter of its own
        config = json.loads(open(os.path.join(row["output_dir"], "adapter_config.json")).read())
        assert config["peft_type"] == saved_peft_type("TOYLR") and config["scale"] == 2.0
    first, second = (row["losses"] for row in table["jobs"])
    assert first != second  # two learning rates, trained side by side


def test_sweep_refuses_a_toy_tuner_that_declares_it_cannot_fuse(base_path, toy):
    from hf_dtrain.cli import main

    toy_tuner.register(fused=False)
    with pytest.raises(SystemExit, match="cannot be fused: " + re.escape(toy_tuner.NOT_FUSABLE)):
        main(["sweep", "--method", "toylr", "--model", base_path, "--lr", "1e-3,2e-3", *TASK])
