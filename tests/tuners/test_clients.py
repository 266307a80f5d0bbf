"""The clients users train and load adapters with: TRL's ``SFTTrainer(peft_config=...)`` at TRL's defaults (bf16
included) with each of our configs, the adapter saved and reloaded in a fresh process with
``AutoPeftModelForCausalLM`` and with transformers' ``model.load_adapter(dir)``, giving the trained outputs."""

import json
import os
import sys
import warnings

import pytest
import torch

from hf_dtrain import processes

pytest.importorskip("trl", reason="trl is a test extra: pip install -e '.[test]'")

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGETS = ["q_proj", "v_proj"]


def _configs():
    from hf_dtrain.tuners import LoraFAConfig, QAHiRAConfig, QBaRAConfig, SMTConfig

    return {
        "lorafa": LoraFAConfig(r=4, target_modules=TARGETS),
        "smt": SMTConfig(block_size=16, num_blocks=4, target_modules=TARGETS, warmup_steps=2),
        "qbara": QBaRAConfig(r=4, target_modules=TARGETS, require_quantized_base=False),
        "qahira": QAHiRAConfig(group_size=16, target_modules=TARGETS, require_quantized_base=False),
    }


_RELOAD = """
import json, sys, warnings, torch
warnings.filterwarnings("ignore")
import hf_dtrain  # registers the methods with peft
from peft import AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM
out = {}
ids = torch.tensor([json.loads(sys.argv[2])])
for name, path in json.loads(sys.argv[1]).items():
    a = AutoPeftModelForCausalLM.from_pretrained(path).eval()
    base = AutoModelForCausalLM.from_pretrained(json.load(open(path + "/adapter_config.json"))["base_model_name_or_path"])
    base.eval()
    with torch.no_grad():
        plain = base(input_ids=ids).logits[0, -1, :5].tolist()
        base.load_adapter(path)
        trained = {n: p.double().sum().item() for n, p in a.named_parameters() if p.numel() and "base_layer" not in n and n.count(".") and any(k in n for k in ("lorafa_", "smt_", "qbara_", "qahr_"))}
        out[name] = {"auto": a(input_ids=ids).logits[0, -1, :5].tolist(), "load_adapter": base(input_ids=ids).logits[0, -1, :5].tolist(), "base": plain, "sums": trained}
print(json.dumps(out))
"""


@pytest.mark.smoke
def test_trl_sft_trainer_then_reload_in_a_fresh_process(tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_dtrain.models import load_model_and_tokenizer
    from hf_dtrain.tuners.smt import SMTSelectionCallback

    data = Dataset.from_list([{"text": f"{a} + {b} = {a + b}"} for a in range(16) for b in range(4)])
    ids = [5, 17, 9, 3, 11]
    saved, trained = {}, {}
    for name, config in _configs().items():
        model, tokenizer = load_model_and_tokenizer(None, progress=False)
        args = SFTConfig(
            output_dir=str(tmp_path / name),
            max_steps=4,
            per_device_train_batch_size=4,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            max_length=32,
            disable_tqdm=True,
            learning_rate=1e-2,
        )
        assert args.bf16  # TRL's default: the run below is a bf16 autocast run
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = SFTTrainer(
                model=model,
                args=args,
                train_dataset=data,
                processing_class=tokenizer,
                peft_config=config,
                callbacks=[SMTSelectionCallback()] if name == "smt" else None,
            )
            result = trainer.train()
        assert torch.isfinite(torch.tensor(result.training_loss)), name
        adapter = [p for n, p in trainer.model.named_parameters() if p.requires_grad]
        assert adapter and any(p.abs().sum() > 0 for p in adapter), f"{name}: nothing was trained"
        trainer.save_model(str(tmp_path / name / "adapter"))
        saved[name] = str(tmp_path / name / "adapter")
        trained[name] = {
            n: p.detach().double().sum().item() for n, p in trainer.model.named_parameters() if p.requires_grad
        }
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = processes.run(
        [sys.executable, "-c", _RELOAD, json.dumps(saved), json.dumps(ids)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, result in got.items():
        # the trained adapter tensors came back exactly (TRL trains them in fp32 under bf16 autocast); SMT targets
        # that got no block hold empty, frozen tensors
        want = {n.replace(".default", ""): v for n, v in trained[name].items()}
        have = {n.replace(".default", ""): v for n, v in result["sums"].items()}
        assert have == want, name
        # both loaders give the same model, and it is not the base model
        assert result["auto"] == result["load_adapter"], name
        assert result["auto"] != result["base"], name
