"""TRL's ``SFTTrainer`` with an hf_dtrain peft method, at TRL's defaults (bf16 autocast), then the adapter reloaded
the two ways users load adapters.

    python recipes/trl_sft.py                          # SMT on the embedded default LLaMA, CPU, about a minute
    python recipes/trl_sft.py --method lorafa --model meta-llama/Llama-3.2-1B --dataset trl-lib/Capybara

The only hf_dtrain-specific lines are ``import hf_dtrain`` (it registers the methods with peft, also when loading)
and, for SMT, ``SMTSelectionCallback`` (it runs the warm-up that picks the blocks inside ``trainer.train()``).
"""

from __future__ import annotations

import argparse

import torch

import hf_dtrain  # noqa: F401  (registers SMT, LoRA-FA, Q-BaRA and QA-HiRA with peft)
from hf_dtrain.tuners import LoraFAConfig, QAHiRAConfig, QBaRAConfig, SMTConfig
from hf_dtrain.tuners.smt import SMTSelectionCallback

TARGETS = ["q_proj", "k_proj", "v_proj"]


def peft_config(method: str):
    if method == "smt":  # 64x64 blocks, as many as LoRA r=8 holds on these targets (the job picks the count itself)
        return SMTConfig(target_modules=TARGETS, block_size=64, trainable_ratio=0.01, warmup_steps=10)
    if method == "lorafa":
        return LoraFAConfig(r=16, lora_alpha=32, target_modules=TARGETS)
    if method == "qbara":  # made for 4-bit bases; require_quantized_base=False lets it train a dense one
        return QBaRAConfig(r=8, target_modules=TARGETS, require_quantized_base=False)
    if method == "qahira":
        return QAHiRAConfig(group_size=64, target_modules=TARGETS, require_quantized_base=False)
    raise SystemExit(f"--method {method!r}: use smt, lorafa, qbara or qahira")


def main():
    from datasets import Dataset, load_dataset
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from hf_dtrain.models import load_model_and_tokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="smt")
    ap.add_argument("--model", default=None, help="a model id or path (default: the embedded LLaMA, built locally)")
    ap.add_argument("--dataset", default=None, help="a TRL-style dataset id (default: a local addition task)")
    ap.add_argument("--max-steps", type=int, default=40)
    ap.add_argument("--output-dir", default="runs/trl_sft")
    args = ap.parse_args()

    model, tokenizer = load_model_and_tokenizer(args.model)
    if args.dataset:
        data = load_dataset(args.dataset, split="train")
    else:
        data = Dataset.from_list([{"text": f"{a} + {b} = {a + b}"} for a in range(40) for b in range(10)])
    sft = SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=8,
        learning_rate=2e-3,
        max_length=64,
        report_to=[],
        save_strategy="no",
        logging_steps=10,
        use_cpu=not torch.cuda.is_available(),
    )
    print(f"TRL defaults: bf16={sft.bf16}")
    trainer = SFTTrainer(
        model=model,
        args=sft,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=peft_config(args.method),
        callbacks=[SMTSelectionCallback()] if args.method == "smt" else None,
    )
    trainer.train()
    adapter_dir = f"{args.output_dir}/adapter"
    trainer.save_model(adapter_dir)  # adapter_config.json, adapter_model.safetensors, README.md

    # reload, the two usual ways (a fresh process needs the same `import hf_dtrain`)
    reloaded = AutoPeftModelForCausalLM.from_pretrained(adapter_dir).eval()
    base = AutoModelForCausalLM.from_pretrained(reloaded.peft_config["default"].base_model_name_or_path).eval()
    base.load_adapter(adapter_dir)
    ids = tokenizer("12 + 7 =", return_tensors="pt").input_ids
    with torch.no_grad():
        a, b = reloaded(input_ids=ids).logits, base(input_ids=ids).logits
    print(f"saved to {adapter_dir}; AutoPeftModelForCausalLM and load_adapter agree: {torch.allclose(a, b, atol=1e-5)}")


if __name__ == "__main__":
    main()
