"""The heterogeneity-aware partitioner's section of the jobs (``--hetero-speeds``): a plain loop's batches dealt in
proportion to each rank's speed, the loss scaled so every rank's gradient weighs by its share."""

from __future__ import annotations

from dataclasses import field

from hf_dtrain.run.section import Clash, Loader, Section, register_section
from hf_dtrain.settings import SettingsError


def _with_trainer(view) -> str | None:
    if view.cfg.hetero_speeds is not None and view.trainer:
        return (
            "hetero_speeds: the Trainer shards its loader again through Accelerate, so the heterogeneity-aware "
            "sampler cannot be used with it; use hf-dtrain pretrain (an Accelerate loop) or drop --hetero-speeds"
        )
    return None


def _count(view) -> str | None:
    speeds = view.cfg.hetero_speeds
    if speeds is not None and not view.trainer and len(speeds) != view.world_size:
        return f"hetero_speeds has {len(speeds)} values for {view.world_size} processes; give one speed per process"
    return None


@register_section
class PartitionerSection(Section):
    """``--hetero-speeds``: each rank's share of the global batch follows its relative speed."""

    name = "hetero_speeds"
    order = 20
    clashes = (
        Clash(
            "`--hetero-speeds` with the Trainer (finetune)",
            "the Trainer shards its loader again through Accelerate",
            _with_trainer,
        ),
        Clash("`--hetero-speeds` with a count other than the processes", "one speed per process", _count),
    )

    @classmethod
    def settings(cls):
        help = "Heterogeneity-aware sampler: relative speed of each rank (one per process); None: even shards."
        return [("hetero_speeds", list[float] | None, field(default=None, metadata={"help": help}))]

    @classmethod
    def validate(cls, cfg) -> None:
        if isinstance(cfg.hetero_speeds, str):
            cfg.hetero_speeds = [float(s) for s in cfg.hetero_speeds.split(",") if s.strip()]
        if cfg.hetero_speeds is not None and (not cfg.hetero_speeds or min(cfg.hetero_speeds) <= 0):
            raise SettingsError(
                "hetero_speeds must be positive relative speeds, one per process, got "
                f"{cfg.hetero_speeds!r}; set --hetero-speeds."
            )

    def loader(self, train, batch_size: int):
        from torch.utils.data import DataLoader

        from .partition import HeterogeneityAwareSampler

        world, rank, seed = self.run.world_size, self.run.rank, self.cfg.seed
        global_batch = batch_size * world
        sampler = HeterogeneityAwareSampler(
            None, self.cfg.hetero_speeds, rank=rank, num_samples=len(train), seed=seed, global_batch_size=global_batch
        )
        batch = sampler.batch_size_for(global_batch)
        loader = DataLoader(train, batch_size=batch, sampler=sampler, drop_last=True)
        return Loader(loader, batch, sampler.loss_scale(global_batch))
