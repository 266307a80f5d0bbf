"""The run sequence the jobs share, in one object: distributed init, the clash check, sharding, the optimizer, the
rank guard, results and the save. ``hf-dtrain finetune``, ``pretrain``, ``sweep`` and ``fed`` read as what they add
to it (torchtitan's ``train.py`` has this shape)::

    run = JobRun(cfg, engine="trainer")           # process group, the launcher's FSDP config, clashes refused
    with run.main_first():                        # rank 0 builds or downloads first, the others read the cache
        ...
    exchange = run.shard(model)                   # FSDP2 (and its HSDP exchange) when cfg.fsdp is set
    optimizer = run.optimizer(model, lr, wd)      # cfg.optimizer's, or None for the Trainer's own
    with run.guard(step_of=lambda: step):         # a dead rank named, with the resume hint
        ...
    run.finish(model, tokenizer, output_dir, results)   # sharded or rank-0 save, results.json, a barrier
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable

import torch
from accelerate import PartialState

from hf_dtrain.compose import build_optimizer, fsdp_from_launcher, keep_sharded, shard_with_fsdp
from hf_dtrain.distributed.groups import RankMonitor, init_distributed
from hf_dtrain.fault.wire import private_dir


class JobRun:
    """One job's run sequence over a :class:`~hf_dtrain.compose.ComposeOptions` config (``cfg``)."""

    def __init__(self, cfg, engine: str, lorafa_optimizer: bool = False, check: bool = True):

        init_distributed()  # under torchrun's / accelerate's restarts: the generation's own store keys
        self.cfg, self.engine = cfg, engine
        self.state = PartialState(cpu=not torch.cuda.is_available())
        # the launcher's WORLD_SIZE: PartialState can report 1 under accelerate launch on CPU
        self.world_size = int(os.environ.get("WORLD_SIZE", self.state.num_processes))
        self.rank = int(os.environ.get("RANK", self.state.process_index))
        self.is_main = self.rank == 0
        cfg.fsdp = fsdp_from_launcher(cfg.fsdp)
        self.monitor = None
        if check:
            self.check(lorafa_optimizer)
        ft = getattr(cfg, "fault_tolerance", None)
        if ft is not None and ft.directory:  # a shared or foreign directory refused now, not after the model loads
            private_dir(ft.directory)

    def check(self, lorafa_optimizer: bool = False) -> None:
        """Refuse switches that clash on this world (before the base model is built or loaded)."""
        self.cfg.check(self.world_size, engine=self.engine, lorafa_optimizer=lorafa_optimizer)

    def main_first(self):
        """Rank 0 first (it builds the default base model or fills a cache), then the others."""
        return self.state.main_process_first()

    @property
    def sharded(self) -> bool:
        """FSDP2 or ZeRO-3 hold shards, not replicas."""
        return self.cfg.fsdp is not None or (self.cfg.deepspeed_stage() or 0) == 3

    def shard(self, model):
        """FSDP2 on ``model`` when ``cfg.fsdp`` is set (before any optimizer: they are built on the shards); a comm
        hook then compresses the HSDP replica exchange. Returns that exchange's state, or None."""
        if self.cfg.fsdp is None:
            return None
        exchange = shard_with_fsdp(model, self.cfg.fsdp, self.cfg.comm_hook)
        keep_sharded(model)
        return exchange

    def optimizer(self, model, lr: float, weight_decay: float, trainer_default: bool = True):
        """``cfg.optimizer``'s optimizer on ``model``'s trainable parameters; None for adamw when the Trainer builds
        its own (``trainer_default``)."""
        if trainer_default and self.cfg.optimizer == "adamw":
            return None
        return build_optimizer(self.cfg, model, lr, weight_decay)

    def guard(self, step_of: Callable[[], int] | None = None, snapshots: bool = False):
        """With 2+ ranks, a :class:`~hf_dtrain.distributed.RankMonitor`: a rank that dies makes the others exit
        naming it, with the hint to relaunch."""
        if self.world_size < 2:
            return contextlib.nullcontext()

        self.monitor = RankMonitor(
            resume_hint="relaunch the same command to resume"
            + (" from the snapshot processes, which keep the state" if snapshots else "")
        )
        self.monitor.step_of = step_of
        return self.monitor.guard()

    def close_guard(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None

    def finish(
        self,
        model,
        tokenizer,
        output_dir: str,
        results: dict,
        save_model: bool = True,
        write: Callable[[], None] | None = None,
        gather: bool | None = None,
    ) -> None:
        """Save ``model`` (every rank gathers FSDP2 / ZeRO / DTensor shards and rank 0 writes when ``gather``, by
        default for FSDP2 and DeepSpeed; rank 0 alone otherwise) with its tokenizer, write ``results.json`` and call
        ``write`` on rank 0, then wait for every rank."""
        gather = (self.sharded or bool(self.cfg.deepspeed)) if gather is None else gather
        if save_model and gather:
            from hf_dtrain.parallel import save_pretrained

            save_pretrained(model, output_dir)
        if self.is_main:
            os.makedirs(output_dir, exist_ok=True)
            if save_model:
                if not gather:
                    model.save_pretrained(output_dir)
                if tokenizer is not None:
                    tokenizer.save_pretrained(output_dir)
            with open(os.path.join(output_dir, "results.json"), "w") as f:
                json.dump(results, f, indent=2, default=str)
            if write is not None:
                write()
        self.state.wait_for_everyone()
