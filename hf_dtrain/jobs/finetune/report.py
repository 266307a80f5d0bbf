"""What the fine-tuning job reports: ``results.json`` (the measured figures, the sections' entries, the config), the
model card saved with the adapter, and the one-table summary printed at the end."""

from __future__ import annotations

import dataclasses

import torch

from hf_dtrain.checkpoints import describe
from hf_dtrain.jobs.sft.model_card import write_model_card


def results(cfg, run, trainer, data, args, measured) -> dict:
    model = trainer.model
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    before, after = measured.before, measured.after
    from hf_dtrain.parallel import local_param_bytes

    sections = run.results()
    step = sections.pop("step_settings", None) or {}  # what sections add to the step's settings (the lean paths)
    return dict(
        method=cfg.method,
        base_model=describe(cfg.model, cfg.gguf_file, cfg.base_preset),
        base_path=data.base_path,
        quantize=cfg.quantize,
        data_format=data.data_format,
        **sections,
        replicas_identical=None if run.sharded else replicas_identical(model, run.world_size),
        dataset=cfg.dataset or "default addition task (hf_dtrain.tasks)",
        trainable_params=trainable,
        total_params=total,
        trainable_pct=100.0 * trainable / max(1, total),
        param_bytes_local=local_param_bytes(model),
        train_seconds=measured.train_seconds,
        train_loss=float(measured.train_output.training_loss),
        eval_loss_before=None if before is None else float(before["eval_loss"]),
        eval_loss_after=float(after["eval_loss"]),
        accuracy_before=None if before is None else before.get("eval_accuracy"),
        accuracy_after=after.get("eval_accuracy"),
        losses={int(h["step"]): float(h["loss"]) for h in trainer.state.log_history if "loss" in h},
        max_steps=trainer.state.max_steps,
        learning_rate=args.learning_rate,
        per_device_train_batch_size=args.per_device_train_batch_size,
        mixed_precision=str(trainer.accelerator.mixed_precision),
        gradient_checkpointing=bool(getattr(getattr(model, "base_model", model), "is_gradient_checkpointing", False)),
        speed_settings={**speed_settings(trainer), **step},
        world_size=run.world_size,
        output_dir=args.output_dir,
        config=dataclasses.asdict(cfg),
    )


def _loss_head(model) -> str:
    """``"TRL fused LM head"`` where TRL's SFTTrainer patched the model's forward to compute the loss in tiles without
    the full logits (``trl.trainer.utils.add_fused_lm_head``: the forward then takes ``fused_lm_head=``), else
    ``"full logits"``."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    forward = inner.__dict__.get("forward")  # the patch is an instance attribute wrapping the class's forward
    code = getattr(getattr(forward, "__func__", forward), "__code__", None)
    return "TRL fused LM head" if code is not None and "fused_lm_head" in code.co_varnames else "full logits"


def speed_settings(trainer) -> dict:
    """The settings the step's speed depends on, as they ran: precision, the loss head, the attention kernel,
    activation checkpointing, compile (the sections add theirs: the lean layers); what the results table prints."""
    model = trainer.model
    config = getattr(model, "config", None)
    return {
        "precision": str(trainer.accelerator.mixed_precision),
        "loss_head": _loss_head(model),
        "attention": getattr(config, "_attn_implementation", None),
        "activation_checkpointing": bool(
            getattr(getattr(model, "base_model", model), "is_gradient_checkpointing", False)
        ),
        "torch_compile": bool(trainer.args.torch_compile),
    }


def write(cfg, results: dict) -> None:
    """The model card next to the adapter, and the summary table (rank 0)."""
    write_model_card(results["output_dir"], results, describe(cfg.model, cfg.gguf_file, cfg.base_preset))
    if cfg.report:
        print(format_table(results), flush=True)


def replicas_identical(model, world_size: int) -> bool:
    """Whether every rank holds the same trainable parameters (one all-gather of a float64 checksum)."""
    values = [p.detach().double().sum() for p in model.parameters() if p.requires_grad]
    checksum = torch.stack(values).sum().reshape(1) if values else torch.zeros(1, dtype=torch.float64)
    if world_size < 2 or not torch.distributed.is_initialized():
        return True
    gathered = [torch.empty_like(checksum) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, checksum)
    return all(torch.equal(gathered[0], g) for g in gathered)


def format_table(r: dict) -> str:
    method = r["method"] + (f" on {r['quantize']}" if r.get("quantize") else "")

    def change(before, after):
        return f"{after:.3f}" if before is None else f"{before:.3f} -> {after:.3f}"

    acc = "n/a" if r.get("accuracy_after") is None else change(r.get("accuracy_before"), r["accuracy_after"])
    cols = [
        ("method", method),
        ("trainable", f"{r['trainable_params']:,} ({r['trainable_pct']:.2f}%)"),
        ("train s", f"{r['train_seconds']:.1f}"),
        ("eval loss", change(r["eval_loss_before"], r["eval_loss_after"])),
        ("accuracy", acc),
    ]
    speed = r.get("speed_settings")
    if speed:  # what the step ran with: the fast settings, on by default where they are exact
        cols.append(
            (
                "step settings",
                f"{speed['precision']}, lean {speed.get('lean_layers', 'n/a')}, {speed['loss_head']}, "
                f"{speed['attention']}"
                + (", checkpointing" if speed["activation_checkpointing"] else "")
                + (", compiled" if speed["torch_compile"] else ""),
            )
        )
    widths = [max(len(h), len(v)) for h, v in cols]
    line = "| " + " | ".join(h.ljust(w) for (h, _), w in zip(cols, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    val = "| " + " | ".join(v.ljust(w) for (_, v), w in zip(cols, widths)) + " |"
    return "\n".join([line, sep, val])
