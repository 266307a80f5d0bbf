"""Run from outside the checkout, with the built wheel installed: the package imports from site-packages with its
data, the console script answers, and one LoRA adapter is trained (on a base pretrained for 20 steps: the
mechanics, not accuracy), saved, and reloaded with peft, where it changes the logits.

    python .ci/wheel_check.py   (CI copies it to a temporary directory first; it refuses to run beside a checkout)
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import hf_dtrain

here = Path(hf_dtrain.__file__).resolve().parent
if "site-packages" not in here.parts:
    sys.exit(f"hf_dtrain was imported from {here}, not from an installed wheel: run this outside the checkout")
if not (here / "py.typed").is_file():
    sys.exit(f"py.typed is missing from the installed package at {here}")
print(f"hf_dtrain {hf_dtrain.__version__} from {here}")
# the console script the wheel installed beside this interpreter (not whichever hf-dtrain is first on PATH)
cli = os.path.join(os.path.dirname(sys.executable), "hf-dtrain")
if not os.access(cli, os.X_OK):
    sys.exit(f"the wheel installed no hf-dtrain console script beside {sys.executable}")

help_text = subprocess.run([cli, "--help"], capture_output=True, text=True, check=True).stdout
for job in ("finetune", "pretrain", "sweep", "fed", "elastic", "plan"):
    if job not in help_text:
        sys.exit(f"hf-dtrain --help does not list {job!r}:\n{help_text}")

with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "lora")
    env = dict(os.environ, HF_DTRAIN_CACHE=os.path.join(tmp, "cache"))
    subprocess.run(
        [cli, "finetune", "--method", "lora", "--max-steps", "4", "--base-preset", "tiny", "--base-steps", "20"]
        + ["--output-dir", out],
        check=True,
        env=env,
        cwd=tmp,
    )
    results = json.load(open(os.path.join(out, "results.json")))
    check = f"""
import json, sys, torch
from peft import PeftModel
from hf_dtrain.models import load_model_and_tokenizer
base, tok = load_model_and_tokenizer(None, base_steps=20, progress=False)
model = PeftModel.from_pretrained(base, {out!r}).eval()
ids = tok("1 + 2 =", return_tensors="pt").input_ids
with torch.no_grad():
    with_adapter = model(input_ids=ids).logits
    with model.disable_adapter():
        without = model(input_ids=ids).logits
trained = {{n: p for n, p in model.named_parameters() if "lora_B" in n}}
assert trained and any(p.abs().sum() > 0 for p in trained.values()), "the reloaded adapter is all zeros"
assert not torch.equal(with_adapter, without), "the reloaded adapter changes nothing"
print("reloaded", len(trained), "trained tensors")
"""
    subprocess.run([sys.executable, "-c", check], check=True, env=env, cwd=tmp)
print(f"wheel check passed: trained {results['method']} for {results.get('max_steps', 4)} steps, saved, reloaded")
