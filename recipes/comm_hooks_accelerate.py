"""Full fine-tuning with Accelerate and an hf_dtrain communication method: one call after ``accelerator.prepare``.

    ACCELERATE_USE_CPU=true accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml \\
        recipes/comm_hooks_accelerate.py --method acp_sgd --rank 4 --steps 200
    ... recipes/comm_hooks_accelerate.py --hook-config recipes/comm_acp_sgd.yaml   # the method's settings as YAML

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes only its own enum and silently ignores a
callable, so the hook is registered on the prepared (DDP) model with ``hf_dtrain.comm.register``. EmbRace needs the
embeddings out of DDP before ``prepare`` (``hf_dtrain.comm.exclude_embeddings``); DeAR needs the optimizer and applies
its last update at ``state.flush()``. Prints the loss and the bytes per step; ``--out`` writes them, with a checksum of
each rank's parameters, as JSON.
"""

import argparse
import json
import os

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="base model path or hub id (default: the embedded default)")
    ap.add_argument("--method", default="acp_sgd", help="allreduce, acp_sgd, s2_reducer, dear or embrace")
    ap.add_argument(
        "--hook-config",
        default=None,
        help="YAML file with the method's settings (CommHookConfig keys; overrides --method/--rank/--start-iter)",
    )
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--start-iter", type=int, default=10)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--out", default=None, help="directory for comm_<rank>.json")
    args = ap.parse_args(argv)

    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    import hf_dtrain.comm
    from hf_dtrain import tasks
    from hf_dtrain.models import load_model_and_tokenizer

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    with accelerator.main_process_first():
        model, tok = load_model_and_tokenizer(args.model, progress=accelerator.is_main_process)
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
    if args.hook_config:
        import yaml

        with open(args.hook_config) as f:
            hook_config = hf_dtrain.comm.CommHookConfig.from_any(yaml.safe_load(f)["comm_hook"])
    else:
        hook_config = hf_dtrain.comm.CommHookConfig(method=args.method, rank=args.rank, start_iter=args.start_iter)
    args.method = hook_config.method
    if hook_config.method == "embrace":
        hf_dtrain.comm.exclude_embeddings(model)  # before prepare wraps the model in DDP
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = hf_dtrain.comm.register(model, hook_config, optimizer=optimizer)

    model.train()
    losses = []
    for batch in tqdm(loader, total=args.steps, disable=not accelerator.is_main_process, desc=args.method):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if len(losses) == args.steps:
            break
    if hasattr(state, "flush"):
        state.flush()  # DeAR: the last update waits for a next forward that does not come
    steps = state.stats.steps
    report = {
        "method": args.method,
        "world_size": accelerator.num_processes,
        "steps": len(losses),
        "hook_steps": len(steps),
        "bytes_per_step": steps,
        "final_loss_mean_last10": sum(losses[-10:]) / 10,
        "param_checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
    }
    if accelerator.is_main_process:
        print(
            f"{args.method}: loss {report['final_loss_mean_last10']:.4f} (mean of the last 10 steps), "
            f"{sum(steps) / max(1, len(steps)) / 2**20:.3f} MiB per step on the wire from each rank"
        )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"comm_{accelerator.process_index}.json"), "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    from hf_dtrain.distributed.groups import release_process_group

    main()
    release_process_group()  # DDP freed while its gloo group still exists, then the group (pytorch#56297)
