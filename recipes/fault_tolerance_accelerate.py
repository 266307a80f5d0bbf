"""Pretraining-style full training with in-memory snapshots every step, with Accelerate; restart it after a crash and
it resumes exactly from the snapshot processes (or the peers' parity, or the disk copy).

    ACCELERATE_USE_CPU=true accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml \\
        recipes/fault_tolerance_accelerate.py --steps 60 --kill-at 25 --emulate-nodes   # dies after step 25
    ACCELERATE_USE_CPU=true accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml \\
        recipes/fault_tolerance_accelerate.py --steps 60 --emulate-nodes                # resumes from step 25

``--emulate-nodes`` treats every rank as its own node (its own snapshot process, parity across ranks), as on a
multi-node cluster; without it the ranks of one machine share one snapshot process. ``--persist-every N`` also writes
every N-th snapshot to ``--out``/snapshots (safetensors) in the background. ``--out`` gets per-rank JSON with the
losses and the restore source.
"""

import argparse
import json
import os
import signal

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="base model path or hub id (default: the embedded default)")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--every", type=int, default=1, help="snapshot every N optimizer steps")
    ap.add_argument("--parity", type=int, default=1, help="lost nodes to survive (erasure coding across nodes)")
    ap.add_argument("--persist-every", type=int, default=0, help="also write every N-th snapshot to disk")
    ap.add_argument("--snapshot-dir", default=None, help="directory of the snapshot processes (default: per job)")
    ap.add_argument("--emulate-nodes", action="store_true", help="every rank its own node (one machine)")
    ap.add_argument("--kill-at", type=int, default=0, help="SIGKILL rank 0 after this step (to try a restart)")
    ap.add_argument("--out", default="ft_out")
    args = ap.parse_args(argv)
    if args.emulate_nodes:
        os.environ["HF_DTRAIN_NODE_RANK"] = os.environ.get("RANK", "0")
        os.environ["LOCAL_WORLD_SIZE"] = "1"

    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    from hf_dtrain import tasks
    from hf_dtrain.fault import SnapshotEngine
    from hf_dtrain.models import load_model_and_tokenizer

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
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / 10))
    model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
    os.makedirs(args.out, exist_ok=True)
    engine = SnapshotEngine(
        model,
        optimizer,
        schedule,
        directory=args.snapshot_dir,
        parity=args.parity,
        persist_dir=os.path.join(args.out, "snapshots") if args.persist_every else None,
        persist_every=args.persist_every,
    )
    restored = engine.restore()  # memory, else parity, else disk; None on a fresh start
    start = restored.extra["next_step"] if restored else 1
    if restored and accelerator.is_main_process:
        print(f"resumed after step {restored.step} from {restored.source} ({restored.detail})")
    losses = []
    batches = accelerator.skip_first_batches(loader, start - 1) if start > 1 else loader
    bar = tqdm(total=args.steps, initial=start - 1, disable=not accelerator.is_main_process, desc="train")
    for step, batch in enumerate(batches, start=start):
        loss = model(**batch).loss
        accelerator.backward(loss)
        engine.wait()  # the snapshot in flight reads what this step changes
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append([step, loss.item()])
        if step % args.every == 0:
            engine.snapshot(step, extra={"next_step": step + 1})
        bar.update(1)
        if step == args.kill_at and accelerator.is_main_process:
            engine.wait()
            os.kill(os.getpid(), signal.SIGKILL)  # a crash; the launcher takes the other ranks down
        if step == args.steps:
            break
    bar.close()
    stall = engine.stats["stall_seconds"][1:] or [0.0]
    with open(os.path.join(args.out, f"ft_{accelerator.process_index}.json"), "w") as f:
        json.dump(
            {
                "losses": losses,
                "restored": restored and {"step": restored.step, "source": restored.source},
                "snapshot_bytes": engine.stats["bytes"],
                "mean_stall_seconds": sum(stall) / len(stall),
            },
            f,
        )
    if accelerator.is_main_process:
        print(
            f"loss {losses[0][1]:.4f} -> {losses[-1][1]:.4f}; snapshot {engine.stats['bytes']:,} bytes per rank, "
            f"mean stall {1000 * sum(stall) / len(stall):.2f} ms"
        )
    engine.close(shutdown=True)  # the run is over: stop the snapshot processes


if __name__ == "__main__":
    from hf_dtrain.distributed.groups import release_process_group

    main()
    release_process_group()
