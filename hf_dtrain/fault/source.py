"""What a snapshot holds of one rank's training state, and how it goes back in place: one :class:`SnapshotSource` per
way the state is laid over the ranks. :class:`~hf_dtrain.fault.SnapshotEngine` orchestrates (slots, copy thread,
parity, disk) and never looks at the layout itself; the restore policy (``restore.py``) asks the source to check and
load what it chose.

Two sources cover every layout hf_dtrain trains in:

* :class:`ModuleSource`: the model's own tensors and a torch optimizer's state. That is DDP's replicas (every rank
  holds the whole model), FSDP2's shards and every DTensor layout (tensor parallel, 2D, HSDP: each rank holds the
  local shard of each DTensor, a view that writes through) and pipeline stages (a pipeline rank's model holds only
  its stages' modules, under the whole model's names). Its shards are resharded onto another world size or layout
  through a DCP checkpoint (``reshard.py``); after a restore, DDP rebuilds its buckets (``ddp.py``).
* :class:`~hf_dtrain.fault.zero.ZeroSource`: DeepSpeed ZeRO-1/2/3, whose trainable state (partitions, fp32 masters,
  optimizer state) lives in DeepSpeed's optimizer, not in the model (``zero.py``). Not reshardable.

A source is read at the step boundary (``capture``, in the training thread: what the next forward changes), the rest
on the copy thread (``collect``: the optimizer's state dict, which changes only at the next optimizer step); both
return references, which the engine copies into its slot.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from hf_dtrain.errors import SettingsError

from ..distributed.engines import sharded_engine_of, unwrap_optimizer
from . import reshard
from .ddp import rebuild_ddp_buckets, unwrap
from .fsdp import as_shards, local_shard
from .reshard import ShardMap
from .zero import ZeroSource, find_zero_optimizer


class SnapshotSource(Protocol):
    """One layout's training state in a snapshot. ``state`` is the snapshot's dict: ``"model"`` (name -> tensor) and
    whatever else the source puts there (``"optimizer"``, ``"zero"``); the engine adds the RNGs, scheduler, scaler,
    ``extra`` and ``stateful`` objects."""

    #: what the state is (``"modules"``, ``"zero-3"``): in messages
    kind: str
    #: only trainable parameters are stored (a frozen base: PEFT)
    trainable_only: bool

    def describe(self) -> list[str]:
        """One entry per stored tensor (name, global shape, dtype, placement): the same on every rank; the run's
        fingerprint."""

    def capture(self) -> dict:
        """References read at the step boundary, in the training thread."""

    def collect(self, state: dict, optimizer) -> None:
        """Add to ``state`` what may be read on the copy thread while the next forward and backward run."""

    def shard_map(self, optimizer) -> Any | None:
        """How ``state`` splits into sharded tensors (by fully qualified name, at global offsets) and replicated
        rest, for a DCP copy that reshards (:class:`~hf_dtrain.fault.reshard.ShardMap`); None when this layout
        does not reshard. Raises ``ValueError`` naming why it cannot (an optimizer parameter with no name)."""

    def check(self, state: dict) -> str | None:
        """Why ``state`` cannot be loaded in place on this rank, or None."""

    def load(self, state: dict) -> None:
        """Put the model's part of ``state`` back in place (collective where the layout needs it: every rank
        calls it)."""

    def load_optimizer(self, state: dict, optimizer) -> None:
        """Put the optimizer's part back (the Trainer builds its optimizer after the model is loaded)."""

    def reshard_plan(self, directory: str, optimizer) -> tuple[Any, list[str]]:
        """For the DCP checkpoint in ``directory`` (another world size or layout): what to load it into, and what
        keeps it from mapping onto this run (empty when it does)."""

    def load_resharded(self, plan: Any, directory: str, replicated: dict, optimizer) -> None:
        """Load the DCP checkpoint into this run's sharding (``plan`` from :meth:`reshard_plan`)."""

    def after_restore(self) -> None:
        """Once everything is loaded, before the first step (every rank calls it)."""

    def guard_step(self, wait) -> Any | None:
        """Make the layout's own optimizer step call ``wait()`` first, where the step can run outside the loop's
        control (DeepSpeed's, inside ``accelerator.backward``); the hook's handle (``remove()``), or None."""


class ModuleSource:
    """DDP replicas, FSDP2 shards, DTensor layouts and pipeline stages: the model's tensors (each DTensor as this
    rank's local shard) and a torch optimizer's state dict (an FSDP2 parameter's state as its local shards, made
    DTensors again on load)."""

    kind = "modules"

    def __init__(self, model: nn.Module, trainable_only: bool | None = None):
        self.model = model  # as passed (DDP-wrapped: after_restore rebuilds its buckets)
        if trainable_only is None:
            trainable_only = any(not p.requires_grad for p in unwrap(model).parameters())
        self.trainable_only = bool(trainable_only)

    def tensors(self, local: bool = True) -> dict[str, torch.Tensor]:
        """The model's tensors to snapshot; DTensors as this rank's local shards unless ``local`` is false."""
        m = unwrap(self.model)
        if self.trainable_only:
            state = {n: p.detach() for n, p in m.named_parameters() if p.requires_grad}
        else:
            state = {k: v.detach() for k, v in m.state_dict(keep_vars=True).items()}
        return {k: local_shard(v) for k, v in state.items()} if local else state

    def describe(self) -> list[str]:
        return [
            f"{name}:{tuple(t.shape)}:{t.dtype}:{getattr(t, 'placements', None)}"
            for name, t in self.tensors(local=False).items()
        ]  # global shapes: the same on every rank

    def capture(self) -> dict:
        return {"model": self.tensors()}

    def collect(self, state: dict, optimizer) -> None:
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()

    def shard_map(self, optimizer):
        return ShardMap(
            self.tensors(local=False), unwrap(self.model), None if optimizer is None else unwrap_optimizer(optimizer)
        )

    def check(self, state: dict) -> str | None:
        missing = sorted(set(state.get("model", {})) - set(self.tensors(local=False)))
        if missing:
            return (
                f"it holds tensors this model does not have ({', '.join(missing[:4])}"
                f"{' ...' if len(missing) > 4 else ''})"
            )
        return None

    def load(self, state: dict) -> None:
        live = self.tensors()
        with torch.no_grad():
            for name, t in state["model"].items():
                live[name].copy_(t)

    def load_optimizer(self, state: dict, optimizer) -> None:
        if optimizer is not None and "optimizer" in state:
            optimizer.load_state_dict(as_shards(optimizer, state["optimizer"]))

    def reshard_plan(self, directory: str, optimizer) -> tuple[Any, list[str]]:
        model_keys = reshard.stored_model_keys(directory)  # every rank's (a pipeline's stages each wrote theirs)
        opt = None if optimizer is None else unwrap_optimizer(optimizer)
        target, osd = reshard.template(unwrap(self.model), opt, model_keys)
        return (target, osd), reshard.differences(target, directory, model_keys)

    def load_resharded(self, plan: Any, directory: str, replicated: dict, optimizer) -> None:
        target, osd = plan
        reshard.load(
            unwrap(self.model),
            None if optimizer is None else unwrap_optimizer(optimizer),
            directory,
            target,
            osd,
            replicated,
        )

    def after_restore(self) -> None:
        rebuild_ddp_buckets(self.model)

    def guard_step(self, wait) -> None:
        return None  # the loop calls wait() before its optimizer step


def source_for(model: nn.Module, optimizer=None, trainable_only: bool | None = None) -> SnapshotSource:
    """The snapshot source of this model and optimizer: DeepSpeed ZeRO's partitions when ``optimizer`` (or the
    engine ``model``) wraps a ZeRO optimizer, else the model's own tensors. Refuses a model whose parameters another
    engine holds with no way to read them."""
    zero = find_zero_optimizer(model, optimizer)
    if zero is not None:
        if trainable_only is False:
            raise SettingsError(
                "SnapshotConfig.trainable_only=False with DeepSpeed ZeRO: the snapshot holds the ZeRO "
                "optimizer's partitions, which are the trainable parameters; leave trainable_only unset."
            )
        return ZeroSource(zero, model)
    sharded = next(filter(None, map(sharded_engine_of, unwrap(model).parameters())), None)
    if sharded is not None and not sharded.startswith("FSDP2"):
        raise SettingsError(
            f"This model's parameters are held by {sharded}, and no ZeRO optimizer was given: its "
            "partitions live in the DeepSpeed optimizer, with the fp32 master weights. Pass the "
            "DeepSpeed engine as the model (SnapshotEngine(engine, engine.optimizer, ...))."
        )
    return ModuleSource(model, trainable_only)
