"""One rank of the fault-injection runs (``python -m hf_dtrain.testing.ft_worker``, launched by
:func:`hf_dtrain.testing.fault.launch_ft_workers`): DDP over gloo (``FT_ENGINE=fsdp2``: FSDP2 shards instead),
(``FT_ENGINE=zero1|zero2|zero3``: DeepSpeed ZeRO on its CPU accelerator), AdamW + a LambdaLR, batches drawn from every
RNG (Python, NumPy, torch), a snapshot after every step, and an optional fault. Configured by environment variables (see
the test); appends ``step loss.hex()`` per step to ``$FT_OUT/rank{r}.log`` and the restore source to
``$FT_OUT/rank{r}.restore``. ``FT_DUMP``: a directory where the whole (gathered) model and optimizer state is written as
``w{world}-step{s}.safetensors`` after a restore and after the last step (the resharding test compares them). A run
that reaches its end writes each rank's own state (its parameters or shards, its optimizer's parameters and state) to
``$FT_OUT/rank{r}.final.safetensors``: the tests compare it bit for bit with the uninterrupted run's.

``FT_KILLS``: a kill schedule for relaunch trials, ``gen:rank:step:phase`` entries separated by commas; the
generation is ``TORCHELASTIC_RESTART_COUNT`` under torchrun / accelerate launch, else ``FT_GEN``. Phases:
``startup`` (after the snapshot engine starts, before the restore), ``before_step`` (after backward and the wait for the
previous step's snapshot, before the optimizer step), ``mid_snapshot`` (slot written, commit not sent),
``after_snapshot`` and ``after_last`` (after the last step, before the run closes); ``node_lost`` (the snapshot
committed, then the rank and its node's snapshot process killed at once, wherever its parity exchange is)."""

import faulthandler
import json
import os
import random
import signal
import sys
import time
from datetime import timedelta
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import DTensor

from hf_dtrain.distributed.groups import init_distributed, release_process_group
from hf_dtrain.testing.batches import random_batch


def dump_full_state(model, optimizer, path: str) -> None:
    """The whole model and optimizer state, gathered from every rank's shards (``get_state_dict`` with full state
    dicts), written by rank 0 as one safetensors file keyed by FQN."""
    msd, osd = get_state_dict(
        model,
        optimizer,
        options=StateDictOptions(full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True),
    )
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tensors = {f"model.{k}": v for k, v in msd.items()}
        tensors.update({f"optim.{k}": v for k, v in osd.items() if torch.is_tensor(v)})
        save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    dist.barrier()


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard, a ZeRO-3 parameter's partition without its padding (the
    last rank's partition is padded to the others' size, and what the padding holds is not state), else ``t``."""
    part = getattr(t, "ds_tensor", None)
    if part is not None:
        size = part.numel()
        return part[: max(0, min(size, t.ds_numel - dist.get_rank() * size))]
    return t.to_local() if isinstance(t, DTensor) else t


def dump_rank_state(model, optimizer, path: str) -> None:
    """This rank's own state as one safetensors file: every parameter (its local shard or ZeRO-3 partition), every
    parameter the optimizer steps that is not one of the model's (DeepSpeed's fp32 master partitions) and every tensor
    of the optimizer's state, keyed by name or by group and index."""
    mine = {id(p) for p in model.parameters()}
    tensors = {f"param.{n}": _local(p) for n, p in model.named_parameters()}
    for g, group in enumerate(optimizer.param_groups):
        for i, q in enumerate(group["params"]):
            if id(q) not in mine:
                tensors[f"master.{g}.{i}"] = _local(q)
            for key, value in optimizer.state.get(q, {}).items():
                if torch.is_tensor(value):
                    tensors[f"optim.{g}.{i}.{key}"] = _local(value)
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, path)


class Fault:
    """This rank's fault, from ``FT_FAULT`` (``rank:step:where``) or its ``FT_KILLS`` entry for this generation."""

    def __init__(self, rank: int, out: str):
        self.out = out
        fault = os.environ.get("FT_FAULT", "")
        fault_rank, step, self.where = (fault.split(":") + ["", "", ""])[:3] if fault else ("-1", "-1", "")
        self.here = int(fault_rank) == rank
        self.gen = os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get("FT_GEN", "0"))
        for entry in filter(None, os.environ.get("FT_KILLS", "").split(",")):
            g, r, st, ph = entry.split(":")
            if g == self.gen and int(r) == rank:
                step, self.where, self.here = st, ph, True
        self.rank, self.step = rank, int(step)

    def at(self, where: str, step: int | None = None) -> bool:
        return self.here and self.where == where and (step is None or step == self.step)

    def die(self):  # recorded first: the trials count the kills that happened
        with open(os.path.join(self.out, "kills"), "a") as f:
            f.write(f"{self.gen}:{self.rank}:{self.where}\n")
        os.kill(os.getpid(), signal.SIGKILL)


class TorchLM(torch.nn.Module):
    """A causal language model in torch alone (``FT_MODEL=torch``): embeddings, two pre-norm
    ``nn.TransformerEncoderLayer`` blocks under a causal mask, a final norm and an untied head, called as a
    transformers model is (``model(**batch).loss``). For the launcher relaunch tests, whose ranks are fresh
    interpreters: without transformers a rank starts in about half the time (its import of transformers, hqq's
    ``torch.compile`` among it, is most of a rank's start)."""

    def __init__(self, vocab: int = 128, hidden: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(
                hidden, heads, 4 * hidden, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"
            )
            for _ in range(layers)
        )
        self.norm = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, labels=None, attention_mask=None):
        h = self.embed(input_ids)
        causal = torch.nn.Transformer.generate_square_subsequent_mask(input_ids.shape[1], dtype=h.dtype)
        for layer in self.layers:
            h = layer(h, src_mask=causal, is_causal=True)
        logits = self.head(self.norm(h))
        loss = None
        if labels is not None:  # next-token loss, as transformers' causal LMs compute it
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return SimpleNamespace(loss=loss, logits=logits)


def _model(engine: str):
    """``FT_MODEL``: ``llama`` (the default, the tiny LLaMA of :mod:`hf_dtrain.testing.models`) or ``torch``
    (:class:`TorchLM`, under DDP only)."""
    hidden = int(os.environ.get("FT_HIDDEN", "64"))
    kind = os.environ.get("FT_MODEL", "llama")
    if kind == "torch":
        if engine != "ddp":
            raise SystemExit(f"FT_MODEL=torch runs under DDP only (FT_ENGINE={engine!r})")
        torch.manual_seed(0)
        return TorchLM(hidden=hidden)
    if kind != "llama":
        raise SystemExit(f"FT_MODEL={kind!r}: choose llama or torch")
    from hf_dtrain.testing.models import tiny_llama

    return tiny_llama(seed=0, hidden_size=hidden)


def _build(kind: str):
    """The model under its engine (``FT_ENGINE``), its AdamW and LambdaLR: (model, engine-wrapped model, optimizer,
    scheduler)."""
    model = _model(kind)
    opt = None
    if kind == "fsdp2":  # sharded: each rank holds (and snapshots) its own shards
        from hf_dtrain.parallel import apply_fsdp

        ddp = apply_fsdp(model)
    elif kind in ("zero1", "zero2", "zero3"):  # DeepSpeed ZeRO on its CPU accelerator: partitions + fp32 masters
        import deepspeed

        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        # threshold 100: the norm weights (64 values) stay whole ("persistent"), every matrix is partitioned
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 10**6,
            "gradient_clipping": 0.0,
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": int(kind[-1]), "stage3_param_persistence_threshold": 100},
        }
        ddp, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    if opt is None:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return model, ddp, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + 0.1 * k))


def _start_snapshots(kind: str, model, ddp, opt, sched, fault: Fault):
    """The snapshot engine, restored: (engine, the first step to train, None) or, when the restore fails,
    (engine, None, the error)."""
    from hf_dtrain.fault import SnapshotEngine, SnapshotError

    persist = os.environ.get("FT_PERSIST") or None
    # the DeepSpeed engine (its partitions), DDP (its buckets are rebuilt after a restore), FSDP2's model
    engine = SnapshotEngine(
        ddp if kind != "fsdp2" else model,
        ddp.optimizer if kind.startswith("zero") else opt,
        sched,
        directory=os.environ["FT_DIR"],
        parity=int(os.environ.get("FT_PARITY", "1")),
        persist_dir=persist,
        persist_every=int(os.environ.get("FT_PERSIST_EVERY", "0")),
        preempt_deadline=0,  # SIGUSR1 stays faulthandler's: the launcher asks a hung rank for its stacks with it
        timeout=30,
    )
    if fault.at("mid_snapshot"):
        import hf_dtrain.fault.copier as copier

        real = copier.checksum

        def checksum_then_die(buf):  # the slot is written, the commit not yet sent
            if getattr(engine, "_pending_step", None) == fault.step:
                fault.die()
            return real(buf)

        copier.checksum = checksum_then_die
    if fault.at("startup"):
        fault.die()
    t0 = time.perf_counter()
    try:
        restored = engine.restore()
    except (SnapshotError, ValueError) as e:
        return engine, None, f"{type(e).__name__}: {e}"  # (the traceback would keep the engine, and so DDP, alive)
    if restored is None:
        return engine, 1, None
    with open(os.path.join(fault.out, f"rank{fault.rank}.restore"), "a") as f:
        f.write(f"{restored.step} {restored.source} {time.perf_counter() - t0:.3f}\n")
    return engine, restored.extra["next_step"], None


def main():
    faulthandler.enable()  # a rank that dies on a signal (SIGSEGV, SIGABRT) leaves its Python stack in rank{r}.out
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks a hung rank where it is
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = os.environ["FT_OUT"]
    steps = int(os.environ.get("FT_STEPS", "8"))
    fault = Fault(rank, out)
    if not init_distributed():  # torchrun / accelerate launch restarts: the generation's own store keys
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)

    kind = os.environ.get("FT_ENGINE", "ddp")
    model, ddp, opt, sched = _build(kind)
    zero = kind.startswith("zero")
    engine = None
    start = 1
    if os.environ.get("FT_BREAK_CHUNKS") == str(rank):  # this rank cannot write the survivors' DCP files
        from hf_dtrain.fault import reshard

        def broken(*args, **kwargs):
            raise OSError(28, "No space left on device (injected)")

        reshard.write_chunks = broken
    if not os.environ.get("FT_NOFT"):
        engine, start, error = _start_snapshots(kind, model, ddp, opt, sched, fault)
        if error is not None:
            with open(os.path.join(out, f"rank{rank}.error"), "w") as f:
                f.write(error)
            engine.close()
            # DDP (held by the engine too) freed while its gloo group exists, then the group: freed at interpreter
            # exit after the group, a rank can hang (pytorch/pytorch#56297) until the launcher kills it
            ddp = model = opt = sched = engine = None
            release_process_group()
            sys.exit(3)
    if os.environ.get("FT_DUMP") and start > 1:  # (an empty optimizer would be initialised by the gathering)
        dump_full_state(model, opt, os.path.join(os.environ["FT_DUMP"], f"w{world}-step{start - 1}.safetensors"))
    if fault.here and os.environ.get("FT_RELATIVE") and fault.where != "after_last":
        fault.step = start - 1 + fault.step  # FT_KILLS steps count from this generation's first step
    log = open(os.path.join(out, f"rank{rank}.log"), "a")
    for step in range(start, steps + 1):
        seed = int(torch.randint(0, 1 << 20, (1,))) + random.randrange(1 << 20) + int(np.random.randint(1 << 20))
        batch = random_batch(batch=2, seq=16, seed=seed + 1000 * rank)
        loss = ddp(**batch).loss
        ddp.backward(loss) if zero else loss.backward()
        if engine is not None:
            engine.wait()
        if fault.at("before_step", step):
            fault.die()  # after the wait: the previous step is committed, whatever the host's load
        if zero:
            ddp.step()  # DeepSpeed's: the base optimizer on the fp32 partitions, then the 16-bit copies
        else:
            opt.step()
            opt.zero_grad()
        sched.step()
        log.write(f"{step} {loss.item().hex()}\n")
        log.flush()
        if engine is not None:
            engine._pending_step = step
            engine.snapshot(step, extra={"next_step": step + 1})
            if fault.at("after_snapshot", step):
                engine.wait()
                time.sleep(1.5)  # the parity exchange of this step completes
                fault.die()
            if fault.at("node_lost", step):
                engine.wait()  # committed; the whole node goes at once, its exchange of this step wherever it is
                os.kill(json.load(open(os.path.join(engine.dir, "smp.json")))["pid"], signal.SIGKILL)
                fault.die()
    if fault.at("after_last"):
        if engine is not None:
            engine.wait()
        fault.die()
    dump_rank_state(model, opt, os.path.join(out, f"rank{rank}.final.safetensors"))
    if os.environ.get("FT_DUMP"):
        dump_full_state(model, opt, os.path.join(os.environ["FT_DUMP"], f"w{world}-step{steps}.safetensors"))
    if engine is not None:
        engine.close(shutdown=os.environ.get("FT_SHUTDOWN", "1") == "1")
    dist.barrier()
    # freed while their process groups exist, then the groups: a DeepSpeed engine freed at interpreter exit aborted
    # about one run in two ("terminate called without an active exception", after the last step was logged)
    ddp = model = opt = sched = engine = None
    release_process_group()


if __name__ == "__main__":
    main()
