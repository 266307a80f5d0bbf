"""Full fine-tuning with Accelerate and an hf_dtrain optimizer: Eva / FOOF around AdamW or SGD, or 1-bit LAMB.

    ACCELERATE_USE_CPU=true accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml \\
        recipes/optimizers_accelerate.py --optimizer onebit_lamb --steps 300
    python recipes/optimizers_accelerate.py --optimizer eva --steps 300          # one process is fine for Eva

1-bit LAMB exchanges the (compressed) momenta itself, so DDP is told to send nothing (``OneBitLamb.attach_ddp``, the
``noop`` communication method) and it needs >= 2 processes. Eva averages its two vectors per layer across ranks
itself and leaves DDP's gradient all-reduce in place. Prints the loss and, for 1-bit LAMB, the bytes per step;
``--out`` writes them as JSON with a checksum of each rank's parameters; ``--save-state DIR`` ends with
``accelerator.save_state(DIR)`` (1-bit LAMB first gathers every rank's error feedback onto rank 0 with
``consolidate_state_dict()``, since only rank 0's optimizer state is written).

Eva defaults to the benchmark's best configuration on the default model: AdamW at lr 3e-4 with damping 1e-6 (the
paper's 0.03 leaves the rank-one term negligible here; ``--damping 0.03`` for the paper's).
"""

import argparse
import json
import os

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="base model path or hub id (default: the embedded default)")
    ap.add_argument("--optimizer", default="eva", choices=["adamw", "eva", "foof", "eva_sgd", "onebit_lamb"])
    ap.add_argument(
        "--lr", type=float, default=None, help="default: 3e-4 (AdamW, Eva, FOOF), 1e-2 (Eva on SGD), 2e-3 (1-bit LAMB)"
    )
    ap.add_argument(
        "--damping",
        type=float,
        default=None,
        help="Eva / FOOF damping (default: 1e-6 on AdamW, the paper's 0.03 on SGD)",
    )
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--freeze-fraction", type=float, default=0.15, help="1-bit LAMB: LAMB warm-up share of the steps")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--out", default=None, help="directory for optim_<rank>.json")
    ap.add_argument("--save-state", default=None, help="directory for accelerator.save_state at the end")
    args = ap.parse_args(argv)

    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    from hf_dtrain import tasks
    from hf_dtrain.models import load_model_and_tokenizer
    from hf_dtrain.optim import Eva, OneBitLamb

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    with accelerator.main_process_first():
        model, tok = load_model_and_tokenizer(args.model, progress=accelerator.is_main_process)
    model.train()
    train = tasks.make_task_dataset(
        tok, args.steps * args.batch_size * accelerator.num_processes, seed=0, split="train"
    )
    loader = DataLoader(
        train,
        batch_size=args.batch_size,
        shuffle=True,
        collate_fn=tasks.task_collator(tok),
        generator=torch.Generator().manual_seed(0),
    )
    lr = args.lr or {"eva_sgd": 1e-2, "onebit_lamb": 2e-3}.get(args.optimizer, 3e-4)
    if args.optimizer == "onebit_lamb":
        model, loader = accelerator.prepare(model, loader)
        OneBitLamb.attach_ddp(model)  # DDP sends nothing: the optimizer exchanges 1-bit momenta
        optimizer = OneBitLamb(model.parameters(), lr=lr, freeze_step=max(1, int(args.freeze_fraction * args.steps)))
        optimizer = accelerator.prepare(optimizer)
    else:
        if args.optimizer == "adamw":
            optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        else:
            base = "sgd" if args.optimizer == "eva_sgd" else "adamw"
            kwargs = {"momentum": 0.9} if base == "sgd" else {}
            kwargs["damping"] = args.damping or (0.03 if base == "sgd" else 1e-6)
            optimizer = Eva(
                model, base_optimizer=base, lr=lr, method="foof" if args.optimizer == "foof" else "eva", **kwargs
            )
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    losses = []
    for batch in tqdm(loader, total=args.steps, disable=not accelerator.is_main_process, desc=args.optimizer):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if len(losses) == args.steps:
            break
    inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    sent = inner.stats.steps if isinstance(inner, OneBitLamb) else []
    report = {
        "optimizer": args.optimizer,
        "world_size": accelerator.num_processes,
        "steps": len(losses),
        "loss_first10": sum(losses[:10]) / 10,
        "loss_last10": sum(losses[-10:]) / 10,
        "bytes_per_step": sent,
        "param_checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
    }
    if accelerator.is_main_process:
        extra = f", {sent[-1]} bytes per step on the wire from each rank" if sent else ""
        print(f"{args.optimizer}: loss {report['loss_first10']:.4f} -> {report['loss_last10']:.4f}{extra}")
    if args.save_state:
        if isinstance(inner, OneBitLamb):
            inner.consolidate_state_dict(to=0)  # a collective: every rank, before rank 0 writes the optimizer
        accelerator.save_state(args.save_state)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"optim_{accelerator.process_index}.json"), "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    from hf_dtrain.distributed.groups import release_process_group

    main()
    release_process_group()  # DDP freed while its gloo group still exists, then the group (pytorch#56297)
