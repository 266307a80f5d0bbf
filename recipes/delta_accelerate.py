"""Full fine-tuning under a memory budget with DELTA (keep / offload / recompute per decoder layer), with Accelerate.

    python recipes/delta_accelerate.py --budget 0.5 --steps 100            # half the no-saving activation bytes
    ACCELERATE_USE_CPU=true accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml \\
        recipes/delta_accelerate.py --budget 200000000                       # 200 MB of saved activations per rank

The first step at each input shape is a measured profiling step; the plan (a table: layer, bytes, action, predicted
cost) is printed by rank 0. Prints the loss and the measured saved-activation bytes per step; ``--out`` writes them.
"""

import argparse
import json
import os

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="base model path or hub id (default: the embedded default)")
    ap.add_argument("--budget", default="0.5", help="bytes (an integer) or a fraction of the no-saving bytes")
    ap.add_argument("--method", default="exact", choices=["exact", "delta"], help="the planner")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--out", default=None, help="directory for delta_<rank>.json")
    args = ap.parse_args(argv)
    budget = float(args.budget) if "." in args.budget else int(args.budget)

    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    from hf_dtrain import tasks
    from hf_dtrain.memory import DeltaConfig, apply_delta
    from hf_dtrain.models import load_model_and_tokenizer

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    with accelerator.main_process_first():
        model, tok = load_model_and_tokenizer(args.model, progress=accelerator.is_main_process)
    model.train()
    scheduler = apply_delta(model, DeltaConfig(budget=budget, method=args.method))  # unwrapped, before prepare
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
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for batch in tqdm(loader, total=args.steps, disable=not accelerator.is_main_process, desc="delta"):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if len(losses) == args.steps:
            break
    history = scheduler.executor.stats.history
    if accelerator.is_main_process:
        for shape, plan in scheduler.plans.items():
            print(f"plan for input shape {shape}:\n{plan.table()}\n")
        print(
            f"loss {sum(losses[:10]) / 10:.4f} -> {sum(losses[-10:]) / 10:.4f}; saved activations per step: "
            f"max {max(h['saved_bytes'] for h in history):,} bytes, offloaded {history[-1]['offloaded_bytes']:,}"
        )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"delta_{accelerator.process_index}.json"), "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "history": history,
                    "budgets": {str(k): p.budget for k, p in scheduler.plans.items()},
                },
                f,
            )
    scheduler.remove()


if __name__ == "__main__":
    from hf_dtrain.distributed.groups import release_process_group

    main()
    release_process_group()  # DDP freed while its gloo group still exists, then the group (pytorch#56297)
