"""Merge a QA-HiRA (or QA-LoRA) adapter trained by `hf-dtrain finetune --method qahira --quantize hqq4|int4` into its
4-bit base, exactly, check it, and save the merged 4-bit model.

    python recipes/merge_qahira_4bit.py outputs/finetune-qahira [--out outputs/finetune-qahira-merged]

The merge moves the zero-points of each quantization group (no weight code changes), so the merged 4-bit model gives
the adapter model's outputs. This script measures that on held-out examples and prints the largest logit difference.
The merged model is saved in the base's format: HQQ's own (``AutoHQQHFModel.save_quantized``, loaded with
``AutoHQQHFModel.from_quantized``), or, for ``int4``, a safetensors state dict of the ``Int4Linear`` model.
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("adapter", help="output_dir of hf-dtrain finetune (adapter, results.json)")
    ap.add_argument("--out", default=None, help="where to save the merged 4-bit model (default <adapter>-merged)")
    ap.add_argument("--eval-size", type=int, default=200)
    args = ap.parse_args(argv)

    from torch.utils.data import DataLoader

    import hf_dtrain  # noqa: F401  (registers QA-HiRA with peft)
    from hf_dtrain import load_adapter, tasks
    from hf_dtrain.models import base_model_path, load_model_and_tokenizer
    from hf_dtrain.quantization import load_quantized_model

    results = json.load(open(os.path.join(args.adapter, "results.json")))
    cfg = results["config"]
    quantize = results.get("quantize")
    if results["method"] != "qahira" or quantize not in ("hqq4", "int4"):
        raise SystemExit(
            f"{args.adapter}: an exact 4-bit merge needs --method qahira with --quantize hqq4 or int4; "
            f"this run is {results['method']} on {quantize or 'a dense base'}."
        )
    base_path = base_model_path(
        cfg["model"], cfg.get("gguf_file"), cfg["base_preset"], cfg["base_steps"], progress=False
    )
    _, tokenizer = load_model_and_tokenizer(base_path, load_model=False)
    base = load_quantized_model(base_path, quantize, group_size=cfg["quant_group_size"])
    model = load_adapter(base, args.adapter).eval()  # PeftModel.from_pretrained after a check that it fits

    digits = cfg["task_digits"] or tasks.TASK_DIGITS
    seed = cfg.get("training", {}).get("seed", 0)  # the Trainer settings the job was given (FinetuneConfig.training)
    evalset = tasks.make_task_dataset(tokenizer, args.eval_size, seed=seed, split="eval", digits=digits)
    batches = list(DataLoader(evalset, batch_size=50, collate_fn=tasks.task_collator(tokenizer)))
    with torch.no_grad():
        before = [model(**b).logits for b in batches]
    merged = model.merge_and_unload()
    with torch.no_grad():
        after = [merged(**b).logits for b in batches]
    err = max((a - b).abs().max().item() for a, b in zip(before, after))
    print(
        f"merged into {quantize}: largest |logit difference| to the adapter model over {args.eval_size} examples: "
        f"{err:.2e}"
    )

    out = args.out or args.adapter.rstrip("/") + "-merged"
    os.makedirs(out, exist_ok=True)
    if quantize == "hqq4":
        from hqq.models.hf.base import AutoHQQHFModel

        AutoHQQHFModel.save_quantized(merged, out)
    else:
        from safetensors.torch import save_file

        merged.config.save_pretrained(out)
        save_file({k: v.contiguous() for k, v in merged.state_dict().items()}, os.path.join(out, "model.safetensors"))
    tokenizer.save_pretrained(out)

    # read it back and check that nothing was lost on the way to disk
    if quantize == "hqq4":
        reloaded = AutoHQQHFModel.from_quantized(
            out, compute_dtype=torch.float32, device="cuda" if torch.cuda.is_available() else "cpu"
        )
    else:
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModelForCausalLM

        from hf_dtrain.quantization.int4 import quantize_model_int4

        reloaded = quantize_model_int4(
            AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out)), group_size=cfg["quant_group_size"]
        )
        reloaded.load_state_dict(load_file(os.path.join(out, "model.safetensors")))
    reloaded.eval()
    with torch.no_grad():
        reload_err = max((reloaded(**b).logits - a).abs().max().item() for b, a in zip(batches, after))
    print(f"saved the merged {quantize} model to {out}; reloaded, its logits differ by at most {reload_err:.2e}")
    with open(os.path.join(out, "merge.json"), "w") as f:
        json.dump(
            {
                "adapter": args.adapter,
                "quantize": quantize,
                "max_abs_logit_diff": err,
                "reload_max_abs_logit_diff": reload_err,
                "eval_size": args.eval_size,
            },
            f,
            indent=2,
        )


if __name__ == "__main__":
    main()
