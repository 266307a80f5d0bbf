"""The loss head on a large vocabulary: transformers' own loss (the full ``(tokens, vocab)`` logits, cross-entropy
in fp32) against TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``: per-token log-probabilities in tiles,
never the whole logits; what ``SFTTrainer`` and so ``hf-dtrain finetune`` train with) and, where it is installed and a
GPU is present, Liger's fused linear cross-entropy (``liger_kernel``, an optional extra; Triton, GPU only).

The model is the preset's shape with one decoder layer (the head dominates at a 128k vocabulary: the 1B shape's head
is 263M of its 1.2B parameters and its logits are 128256 values per token), its weights frozen but the decoder
layer's (so the head's input gradient is computed, as in fine-tuning). Per variant, in a fresh process: the step time
of forward + backward (median of ``--steps`` after ``--warmup``), the peak memory of the step (a GPU's
``max_memory_allocated``; on CPU the peak resident set with a fixed mmap threshold, as ``throughput.py``), and the loss
and the input embeddings' gradient against transformers' (relative difference).

    python benchmarks/loss_head.py                                  # CPU: the 1B shape's head, 1 x 512 tokens
    python benchmarks/loss_head.py --batch 4 --seq 1024             # a GPU: the throughput benchmark's batch
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit_result, markdown_table, run_worker, write
from throughput import _exact_rss, _peak_rss, _peak_rss_reset, _rss

VARIANTS = ["transformers", "trl_fused", "liger"]


def _liger_loss():
    """Liger's fused linear cross-entropy, or the reason it cannot run here."""
    import torch

    if not torch.cuda.is_available():
        return None, "needs a CUDA device (Triton kernels)"
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None, "liger_kernel is not installed (pip install liger-kernel)"
    return LigerFusedLinearCrossEntropyLoss(), None


def worker(variant: str, path: str, batch: int, seq: int, steps: int, warmup: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    base_rss = 0 if cuda else _rss()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if cuda else torch.float32).to(device)
    model.requires_grad_(False)
    model.model.layers[0].requires_grad_(True)  # the head's input gradient is needed, as in fine-tuning
    liger = None
    if variant == "trl_fused":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model)
    elif variant == "liger":
        liger, why = _liger_loss()
        if liger is None:
            return {"variant": variant, "not_measured": why}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen).to(device)

    def step():
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        with torch.autocast(device, dtype=torch.bfloat16):
            if variant == "transformers":
                loss = model(inputs_embeds=embeds, labels=ids).loss
            elif variant == "trl_fused":
                loss = model(inputs_embeds=embeds, labels=ids, fused_lm_head=True).loss
            else:
                hidden = model.model(inputs_embeds=embeds).last_hidden_state[:, :-1]
                loss = liger(model.lm_head.weight, hidden.reshape(-1, hidden.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.detach().float(), embeds.grad.float()

    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss, grad = step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:  # one more step with the resident set following the live tensors
        _exact_rss()
        _peak_rss_reset()
        step()
        peak = _peak_rss() - base_rss
    out = Path(path) / f"{variant}.pt"
    torch.save({"loss": loss.cpu(), "grad": grad.cpu()}, out)
    return {"variant": variant, "step_seconds": times, "peak_bytes": peak, "loss": float(loss), "tensors": str(out)}


def compare(rows: list[dict]) -> None:
    import torch

    base = next((r for r in rows if r["variant"] == "transformers" and "step_seconds" in r), None)
    ref = torch.load(base["tensors"], weights_only=True) if base else None
    for r in rows:
        if "step_seconds" not in r:
            continue
        r["step_s"] = statistics.median(r["step_seconds"])
        if base is None:
            continue
        got = torch.load(r["tensors"], weights_only=True)
        r["step_vs_transformers"] = r["step_s"] / base["step_s"]
        r["peak_vs_transformers"] = r["peak_bytes"] / base["peak_bytes"]
        r["loss_rel_diff"] = abs(r["loss"] - base["loss"]) / abs(base["loss"])
        r["grad_rel_diff"] = float((got["grad"] - ref["grad"]).norm() / ref["grad"].norm())
    for r in rows:
        r.pop("tensors", None)


def table(payload: dict) -> str:
    rows = [
        {**r, "status": "measured" if "step_s" in r else f"not measured: {r.get('not_measured') or r.get('error')}"}
        for r in payload["rows"]
    ]
    return markdown_table(
        rows,
        [
            ("variant", "loss head", ""),
            ("step_s", "step (s)", ".3f"),
            ("step_vs_transformers", "step / transformers'", ".2f"),
            ("peak_bytes", "peak bytes", ",d"),
            ("peak_vs_transformers", "peak / transformers'", ".2f"),
            ("loss_rel_diff", "loss rel. diff", ".1e"),
            ("grad_rel_diff", "input grad rel. diff", ".1e"),
            ("status", "status", ""),
        ],
    )


def render(payload: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in payload["rows"] if "step_s" in r]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["variant"] for r in rows]
    axes[0].bar(names, [r["step_s"] for r in rows])
    axes[0].set_ylabel("forward + backward (s)")
    axes[1].bar(names, [r["peak_bytes"] / 2**30 for r in rows])
    axes[1].set_ylabel("peak memory (GiB)")
    fig.suptitle(
        f"{payload['preset']} head (vocab {payload['vocab']:,}), one decoder layer, {payload['batch']} x "
        f"{payload['seq']} tokens"
    )
    fig.tight_layout()
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama3.2-1b", help="the LlamaConfig preset whose head is measured")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--name", default="loss_head", help="results/<name>.{json,md,png}")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        variant, path, batch, seq, steps, warmup = args.worker.split(":")
        try:
            emit_result(worker(variant, path, int(batch), int(seq), int(steps), int(warmup)))
        except Exception as e:  # reported in the table, not a crashed run
            emit_result({"variant": variant, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        return

    import torch

    from hf_dtrain.models import build_llama

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model")
        model = build_llama(args.preset, seed=0, num_hidden_layers=1)
        vocab, hidden = model.config.vocab_size, model.config.hidden_size
        model.save_pretrained(path)
        del model
        for variant in args.variants.split(","):
            spec = f"{variant}:{path}:{args.batch}:{args.seq}:{args.steps}:{args.warmup}"
            row = run_worker(os.path.abspath(__file__), ["--worker", spec], what=variant, timeout=3600)
            rows.append(row)
            print(variant, row.get("step_seconds") or row.get("not_measured") or row.get("error"), flush=True)
        compare(rows)
    cuda = torch.cuda.is_available()
    payload = {
        "preset": args.preset,
        "vocab": vocab,
        "hidden": hidden,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "rows": rows,
    }
    notes = (
        f"The {args.preset} shape's embedding and head (hidden {hidden}, vocab {vocab:,}, tied as the preset says) "
        f"with one decoder layer (random weights from LlamaConfig, only the decoder layer trains), "
        f"{args.batch} x {args.seq} tokens, {'bf16 weights' if cuda else 'fp32 weights'} under bf16 autocast; "
        f"forward + backward, median of {args.steps} steps after {args.warmup}, each variant in a fresh process. "
        "Peak: "
        + (
            "torch.cuda.max_memory_allocated over the timed steps."
            if cuda
            else "the peak resident set of one more step (fixed mmap threshold) above the process's before the model "
            "was loaded (the model's weights included, the same in every row)."
        )
        + " Differences: the loss and the input embeddings' gradient against transformers' own loss."
    )
    paths = write(args.name, payload, table(payload), render(payload), notes)
    print(table(payload))
    print("wrote", ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    main()
