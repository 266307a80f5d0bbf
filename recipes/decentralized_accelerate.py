"""Full fine-tuning with Accelerate and a decentralized optimizer (D-PSGD, DecentLaM, LSGD, AL-DSGD), optionally with
Non-blocking SGD and an injected straggler.

    ACCELERATE_USE_CPU=true accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml \\
        recipes/decentralized_accelerate.py --method decentlam --steps 200
    ... --method dpsgd --nonblocking --straggler 1:3        # rank 1 three times slower; non-blocking micro-batches

DDP is told to send nothing (``noop``: the optimizer gossips the parameters with its neighbours). Prints the loss,
the bytes each rank sends per step and the consensus distance between the replicas; ``--out`` writes them as JSON.
"""

import argparse
import json
import os

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="base model path or hub id (default: the embedded default)")
    ap.add_argument("--method", default="decentlam", choices=["dpsgd", "decentlam", "lsgd", "aldsgd"])
    ap.add_argument("--topology", default="ring", help="ring, torus, exponential, fully_connected or matcha")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--nonblocking", action="store_true", help="Non-blocking SGD: 4 micro-batches per step")
    ap.add_argument("--straggler", default=None, metavar="RANK:FACTOR", help="make one rank FACTOR times slower")
    ap.add_argument("--out", default=None, help="directory for decentralized_<rank>.json")
    args = ap.parse_args(argv)

    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    from hf_dtrain import tasks
    from hf_dtrain.comm import register
    from hf_dtrain.decentralized import ALDSGD, DPSGD, LSGD, DecentLaM, NonBlockingSGD, Straggler
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
    model, loader = accelerator.prepare(model, loader)  # DDP, and each rank its own share of the data
    register(model, "noop")  # gradients stay local: the optimizer gossips
    if args.method == "dpsgd":
        optimizer = DPSGD(model.parameters(), topology=args.topology, lr=args.lr, momentum=0.9)
    elif args.method == "decentlam":
        optimizer = DecentLaM(model.parameters(), topology=args.topology, lr=args.lr, momentum=0.9)
    elif args.method == "lsgd":
        optimizer = LSGD(model.parameters(), model=model, lr=args.lr, momentum=0.9, local_period=4, global_period=16)
    else:
        optimizer = ALDSGD(
            model.parameters(),
            model=model,
            lr=args.lr,
            momentum=0.9,
            topology="matcha" if args.topology == "ring" else args.topology,
        )
    straggler = None
    if args.straggler:
        rank, factor = args.straggler.split(":")
        straggler = Straggler({int(rank): float(factor)}, rank=accelerator.process_index)
    nb = NonBlockingSGD(model, optimizer, average="local", straggler=straggler) if args.nonblocking else None

    losses = []
    for batch in tqdm(loader, total=args.steps, disable=not accelerator.is_main_process, desc=args.method):
        if nb is not None:
            losses.append(nb.step([{k: v[i::4] for k, v in batch.items()} for i in range(4)])["loss"])
        else:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        if len(losses) == args.steps:
            break
    consensus = optimizer.consensus_distance()  # a collective: every rank
    report = {
        "method": args.method,
        "world_size": accelerator.num_processes,
        "steps": len(losses),
        "loss_first10": sum(losses[:10]) / 10,
        "loss_last10": sum(losses[-10:]) / 10,
        "bytes_per_step": optimizer.stats.steps,
        "consensus_distance": consensus,
    }
    if accelerator.is_main_process:
        print(
            f"{args.method}: loss {report['loss_first10']:.4f} -> {report['loss_last10']:.4f}, "
            f"{optimizer.stats.steps[-1]} bytes per step sent by rank 0, consensus distance {consensus:.3e}"
        )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"decentralized_{accelerator.process_index}.json"), "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    from hf_dtrain.distributed.groups import release_process_group

    main()
    release_process_group()  # DDP freed while its gloo group still exists, then the group (pytorch#56297)
