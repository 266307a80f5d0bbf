"""DeepSpeed ZeRO's partitioned training state, as :class:`~hf_dtrain.fault.SnapshotEngine` snapshots it: each rank's
fp32 master partitions (kept by DeepSpeed apart from the model), the base optimizer's state on them, the model's
16-bit copies (ZeRO-1/2: the whole flat groups every rank holds; ZeRO-3: this rank's partitions, rebuilt from the
fp32 masters as DeepSpeed's own step does), the loss scaler and the engine's step counters.

Snapshots hold references; the engine's background copy reads them while the next forward and backward run,
which write only gradients, and ``wait()`` runs before DeepSpeed's step (a step pre-hook on the base optimizer
makes sure of it when Accelerate's ``backward`` steps the engine itself).
"""

from __future__ import annotations

from typing import Any

import torch

# the DeepSpeedEngine's counters that a resumed run continues from (the lr schedule, accumulation boundaries)
ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def find_zero_optimizer(model, optimizer) -> Any | None:
    """The ZeRO-1/2/3 optimizer behind ``optimizer`` (or the DeepSpeed engine ``model``): through Accelerate's and
    DeepSpeed's wrappers (each keeps the one it wraps as ``.optimizer``); None when there is none."""
    for o in (optimizer, getattr(model, "optimizer", None)):
        seen = 0
        while o is not None and seen < 8:
            if hasattr(o, "fp32_partitioned_groups_flat") or hasattr(o, "single_partition_of_fp32_groups"):
                return o
            o, seen = getattr(o, "optimizer", None), seen + 1
    return None


def _scalars(obj) -> dict:
    return {k: v for k, v in vars(obj).items() if isinstance(v, (bool, int, float)) and not k.startswith("__")}


class ZeroSource:
    """The :class:`~hf_dtrain.fault.source.SnapshotSource` of DeepSpeed ZeRO (``stage`` 1, 2 or 3): reads and
    restores one rank's partitions in place, for the same world size and ZeRO settings (not reshardable: a restart
    on another world size resumes from DeepSpeed's own checkpoint). The snapshot's ``"model"`` is empty: every
    trainable parameter lives in the partitions (``"zero"``)."""

    trainable_only = True  # the partitions are the trainable parameters

    def __init__(self, zero_optimizer, model=None):
        self.opt = zero_optimizer
        self.stage = (
            3
            if hasattr(zero_optimizer, "fp32_partitioned_groups_flat")
            else int(getattr(zero_optimizer, "partition_gradients", False)) + 1
        )
        self.kind = f"zero-{self.stage}"
        self.engine = model if all(hasattr(model, c) for c in ENGINE_COUNTERS) else None

    @property
    def base(self) -> torch.optim.Optimizer:
        return self.opt.optimizer

    def describe(self) -> list[str]:
        """The stage, then name, global shape and dtype of every parameter the partitions hold, in the optimizer's
        order (the run's fingerprint): ZeRO-3's real shapes, not its empty placeholders."""
        groups = self.opt.fp16_groups if self.stage == 3 else self.opt.bit16_groups
        out = [f"zero{self.stage}"]
        for i, group in enumerate(groups):
            for j, p in enumerate(group):
                out.append(f"group{i}.{j}:{tuple(getattr(p, 'ds_shape', p.shape))}:{p.dtype}")
        return out

    def capture(self) -> dict:
        return {"model": {}, "zero": self.state()}

    def collect(self, state: dict, optimizer) -> None:
        pass  # the base optimizer's state is read with the partitions, at the step boundary

    def shard_map(self, optimizer) -> None:
        return None

    def reshard_plan(self, directory: str, optimizer):
        return None, [
            "DeepSpeed ZeRO partitions are not resharded from a snapshot (resume on the world size and "
            "ZeRO settings that took it, or from DeepSpeed's own checkpoint)"
        ]

    def load_resharded(self, plan, directory: str, replicated: dict, optimizer) -> None:
        raise NotImplementedError("DeepSpeed ZeRO partitions are not resharded from a snapshot")

    def load_optimizer(self, state: dict, optimizer) -> None:
        pass  # loaded with the partitions (load)

    def after_restore(self) -> None:
        pass

    def guard_step(self, wait):
        # DeepSpeed's step may run inside accelerator.backward (before the loop's wait()): the base optimizer
        # waits for the copy in flight before it changes what the copy reads
        return self.base.register_step_pre_hook(lambda *_: wait())

    def state(self) -> dict:
        """References to this rank's partitions and optimizer state (copied by the engine in the background)."""
        out: dict[str, Any] = {"stage": self.stage}
        if self.stage == 3:
            sd = self.opt.state_dict()  # DeepSpeed's own: base optimizer state keyed as it reloads it, fp32 masters
            out.update(
                fp32=list(sd["fp32_flat_groups"]),
                optimizer=sd["optimizer_state_dict"],
                dynamic_loss_scale=bool(sd["dynamic_loss_scale"]),
                overflow=bool(sd["overflow"]),
                partition_count=sd["partition_count"],
            )
        else:
            out.update(
                fp32=list(self.opt.single_partition_of_fp32_groups),
                bit16=list(self.opt.bit16_groups_flat),
                optimizer=self.base.state_dict(),
                overflow=bool(getattr(self.opt, "overflow", False)),
            )
        scaler = getattr(self.opt, "loss_scaler", None)
        if scaler is not None:
            out["loss_scaler"] = _scalars(scaler)
        if self.engine is not None:
            out["engine"] = {c: int(getattr(self.engine, c)) for c in ENGINE_COUNTERS}
        return out

    def check(self, state: dict) -> str | None:
        """Why the snapshot ``state`` cannot be loaded here (another stage, other partition sizes), or None."""
        state = state.get("zero", {})
        if state.get("stage") != self.stage:
            return f"the snapshot holds ZeRO-{state.get('stage')} partitions and this run uses ZeRO-{self.stage}"
        live = self.opt.fp32_partitioned_groups_flat if self.stage == 3 else self.opt.single_partition_of_fp32_groups
        theirs = [tuple(t.shape) for t in state["fp32"]]
        if theirs != [tuple(t.shape) for t in live]:
            return (
                f"its fp32 partitions have shapes {theirs[:4]} and this rank's {[tuple(t.shape) for t in live][:4]} "
                "(another world size or ZeRO setting)"
            )
        return None

    def load(self, state: dict) -> None:
        """Put the snapshot ``state``'s partitions back in place; collective under ZeRO-3 (the persistent parameters
        are re-gathered), so every rank calls it."""
        state = state["zero"]
        scaler = getattr(self.opt, "loss_scaler", None)
        if scaler is not None:
            for k, v in state.get("loss_scaler", {}).items():
                setattr(scaler, k, v)
        if self.stage == 3:
            import torch.distributed as dist

            rank = dist.get_rank(group=self.opt.dp_process_group)
            sd = {
                "loss_scaler": scaler,
                "dynamic_loss_scale": state["dynamic_loss_scale"],
                "overflow": state["overflow"],
                "partition_count": state["partition_count"],
                "optimizer_state_dict": state["optimizer"],
                "fp32_flat_groups": state["fp32"],
            }
            # DeepSpeed's own restore: fp32 masters and optimizer state, the 16-bit partitions from the masters, the
            # persistent parameters re-gathered
            self.opt.checkpoint_event_prologue()
            self.opt.load_state_dict([sd] * (rank + 1), load_optimizer_states=True)
            self.opt.checkpoint_event_epilogue()
        else:
            with torch.no_grad():
                for live, saved in zip(self.opt.single_partition_of_fp32_groups, state["fp32"]):
                    live.copy_(saved)
                for live, saved in zip(self.opt.bit16_groups_flat, state["bit16"]):
                    live.copy_(saved)  # the model's parameters are views of these flat groups
            self.base.load_state_dict(state["optimizer"])
            self.opt.overflow = state["overflow"]
        if self.engine is not None:
            for c, v in state.get("engine", {}).items():
                setattr(self.engine, c, v)
