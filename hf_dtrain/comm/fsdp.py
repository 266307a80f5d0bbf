"""Compressing the replica exchange of HSDP: FSDP2 on a ``dp_replicate`` x ``dp_shard`` mesh.

Under HSDP each gradient is reduce-scattered inside a replica group (fast links: one node) and all-reduced across
the groups (the slow, cross-node links). FSDP2 (torch 2.13) gives that second exchange one extension point,
``FSDPModule.set_all_reduce_hook(hook)``: ``hook(reduce_output)`` runs on each unit's reduce-scatter output, before
FSDP2 views it out into the sharded ``.grad``. With a native 2D mesh it runs *after* FSDP2's own all-reduce, too late
to compress it; so :func:`register_fsdp` is used with the model sharded on the ``dp_shard`` sub-mesh only (FSDP2
then averages over the shard group and runs no all-reduce), and the hook does the replica exchange itself:

* ``allreduce``: the dense average over replicas (what native HSDP does), counted;
* ``bf16`` / ``fp16``: the same in half precision (torch's ``bf16_compress_hook`` for DDP), half the bytes;
* ``acp_sgd``: ACP-SGD (:mod:`hf_dtrain.comm.acp_sgd`) on each parameter's *row shard*: ranks of different replica
  groups with the same shard index hold the same rows, so the shard, seen as a matrix ``(rows / shards, cols)``, is
  compressed like a whole gradient under DDP. Its factors are P ``(rows / shards) x r`` and Q ``cols x r``.

The reduce output is one flat buffer per FSDP unit: for each parameter that has a gradient, in the unit's order, its
row shard (``sharded_size``, contiguous) followed by padding up to ``padded_sharded_param_size``. The layout is read
from FSDP2's parameter group (``fsdp_params``); if the buffer does not match it (a trainable parameter got no
gradient this step), that unit's step goes dense, with a warning.

The averaged result is identical on every rank of a replica set, so replicas stay in sync without a broadcast.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from hf_dtrain.errors import SettingsError

from ..distributed.collectives import check_same_across_ranks, world_size_of
from ..distributed.counters import WireStats
from .acp_sgd import ACPSGDState, decode, encode, tensor_state
from .config import FSDP_METHODS, FSDP_REFUSALS, CommHookConfig

_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class FSDPExchangeState:
    """State of the replica exchange :func:`register_fsdp` installs on every FSDP unit of one model.

    ``stats`` counts the payload bytes each rank hands to the replica all-reduces per optimizer step (the same
    accounting as the DDP hooks); ``acp`` is the ACP-SGD state (per row shard, keyed by parameter name) when the
    method is ``acp_sgd``; ``dense_fallbacks`` counts unit-steps that went dense because the layout did not match."""

    method: str
    process_group: dist.ProcessGroup | None
    replicas: int
    stats: WireStats = field(default_factory=WireStats)
    acp: ACPSGDState | None = None
    iter: int = 0  # optimizer steps finished (backward passes that reduced)
    dense_fallbacks: int = 0
    _in_step: bool = False

    def state_dict(self) -> dict:
        return {"iter": self.iter, "acp": self.acp.state_dict() if self.acp is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.iter = int(state["iter"])
        if self.acp is not None and state.get("acp") is not None:
            self.acp.load_state_dict(state["acp"])

    def _begin(self) -> None:
        """Called by the first unit of a backward: queue the end of the step after autograd's last callback."""
        if self._in_step:
            return
        self._in_step = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        self._in_step = False
        self.iter += 1
        if self.acp is not None:
            self.acp.iter = self.iter
        self.stats.end_step()

    def _all_reduce_mean(self, flat: torch.Tensor) -> torch.Tensor:
        self.stats.add(flat)
        dist.all_reduce(flat, group=self.process_group)
        return flat.div_(self.replicas)

    def exchange(self, reduce_output: torch.Tensor, group, name: str) -> None:
        """Average ``reduce_output`` (one unit's reduce-scatter output, already averaged over its shard group) over
        the replica groups, in place."""
        self._begin()
        if self.method in _HALF:
            half = self._all_reduce_mean(reduce_output.to(_HALF[self.method]))
            reduce_output.copy_(half)
            return
        if self.method == "allreduce" or self.acp.iter < self.acp.start_iter:
            self._all_reduce_mean(reduce_output)
            return
        views = _shard_views(group, reduce_output)
        if views is None:
            self.dense_fallbacks += 1
            warnings.warn(
                f"hf_dtrain FSDP replica exchange: the reduce output of unit {name!r} does not match its "
                "trainable parameters (one got no gradient this step); this unit's step goes dense.",
                RuntimeWarning,
                stacklevel=2,
            )
            self._all_reduce_mean(reduce_output)
            return
        acp = self.acp
        grads, states = [], []
        for key, view in views:
            grads.append(view)
            if view.dim() < 2 or not acp.compresses(view.shape):
                states.append(None)
            else:
                states.append(
                    tensor_state(acp, key, view.shape[0], view.numel() // view.shape[0], view.device, view.dtype)
                )
        even = acp.even
        flat, orth, errors = encode(acp, grads, states, even)
        reduced = self._all_reduce_mean(flat)
        decode(acp, reduced, grads, states, orth, errors, even)


def _param_groups(module) -> list:
    groups = module._get_fsdp_state()._fsdp_param_groups
    return list(groups)


def _shard_views(group, reduce_output: torch.Tensor) -> list | None:
    """``(parameter name, view of its row shard in reduce_output)`` for each parameter in the buffer, or None when
    the buffer's size does not match the unit's trainable parameters."""
    params = [fp for fp in group.fsdp_params if fp.sharded_param.requires_grad]
    if sum(fp.padded_sharded_param_size.numel() for fp in params) != reduce_output.numel():
        return None
    out, offset = [], 0
    for fp in params:
        size = fp.sharded_size
        out.append((fp._param_fqn, reduce_output[offset : offset + size.numel()].view(size)))
        offset += fp.padded_sharded_param_size.numel()
    return out


def _all_shard_shapes(fp) -> list:
    """The row-shard shapes of ``fp``'s parameter on every shard index (torch.chunk's split: equal chunks of
    ceil(rows / shards) rows, the last ones shorter or empty)."""
    full = tuple(fp.sharded_param.shape)
    shards = fp.sharded_param.device_mesh.size()
    chunk = -(-full[0] // shards)
    rows = {max(0, min(chunk, full[0] - i * chunk)) for i in range(shards)}
    return [torch.Size((r, *full[1:])) for r in sorted(rows) if r]


def _check_layout(units) -> None:
    for name, _, group in units:
        for fp in group.fsdp_params:
            if fp.fsdp_placement.dim != 0:
                raise SettingsError(
                    f"the FSDP replica exchange needs row shards (Shard(0)); {fp._param_fqn!r} in unit "
                    f"{name!r} is sharded on dim {fp.fsdp_placement.dim}: drop shard_placement_fn."
                )


def register_fsdp(model, config: CommHookConfig | dict | str | None, replica_group) -> FSDPExchangeState:
    """Average gradients over HSDP replica groups with ``config.method`` (``allreduce``, ``bf16``, ``fp16`` or
       ``acp_sgd``), through ``set_all_reduce_hook`` on every FSDP unit of ``model``.

       ``model`` must be sharded with ``fully_shard`` on the ``dp_shard`` mesh dimension only, ``replica_group`` the
       process group of the ``dp_replicate`` dimension::

           mesh = fsdp_mesh(FSDPConfig(replicate=R))
           apply_fsdp(model, config, mesh=mesh["dp_shard"])
           state = register_fsdp(model, "acp_sgd", mesh["dp_replicate"].get_group())
    Call before the first backward. Returns the state (``state.stats``: bytes per step)."""
    config = CommHookConfig.from_any(config)
    if config.method not in FSDP_METHODS:
        why = FSDP_REFUSALS.get(config.method, "not built")
        raise SettingsError(
            f"comm_hook.method={config.method!r} cannot compress FSDP2's replica exchange: {why}. Use "
            f"one of {', '.join(FSDP_METHODS)}."
        )
    replicas = world_size_of(replica_group)
    if replicas < 2:
        raise SettingsError(
            "the FSDP replica exchange needs >= 2 replica groups (HSDP: fsdp.replicate >= 2); with one "
            "group there is nothing to exchange across groups: drop the comm hook."
        )
    units = []
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            for group in _param_groups(module):
                if getattr(group, "_is_hsdp", False):
                    raise SettingsError(
                        "the model is sharded on a 2D (HSDP) mesh, so FSDP2 already all-reduces across "
                        "replicas before any hook: shard it on the dp_shard mesh dimension only "
                        "(apply_fsdp(model, config, mesh=fsdp_mesh(config)['dp_shard']))."
                    )
                units.append((name or "<root>", module, group))
    if not units:
        raise TypeError(
            f"register_fsdp needs a model sharded with fully_shard; {type(model).__name__} has no FSDP "
            "unit (apply_fsdp first)."
        )
    _check_layout(units)
    check_same_across_ranks(dataclasses.asdict(config), "comm hook config")
    state = FSDPExchangeState(method=config.method, process_group=replica_group, replicas=replicas)
    if config.method == "acp_sgd":
        state.acp = ACPSGDState.from_config(config, process_group=replica_group, stats=state.stats)
        # every shard shape any rank holds, so that all ranks agree on the verdict
        state.acp.check_rank(
            (fp._param_fqn, shape)
            for _, _, group in units
            for fp in group.fsdp_params
            if fp.sharded_param.requires_grad
            for shape in _all_shard_shapes(fp)
        )
    for name, module, group in units:
        if len(_param_groups(module)) != 1:
            raise SettingsError(
                f"FSDP unit {name!r} has several parameter groups (per-parameter meshes); the replica "
                "exchange needs one per unit."
            )
        module.set_all_reduce_hook(lambda out, _g=group, _n=name: state.exchange(out, _g, _n))
    return state


def fsdp_exchange_step_bytes(state: FSDPExchangeState, model, element_size: int = 4, even: bool = True) -> int:
    """Payload bytes one rank sends in one compressed step of ``state``'s method (the formula the tests check)."""
    shapes = []
    for _, module in model.named_modules():
        if isinstance(module, FSDPModule):
            for group in _param_groups(module):
                shapes += [
                    (fp._param_fqn, fp.sharded_size, fp.padded_sharded_param_size)
                    for fp in group.fsdp_params
                    if fp.sharded_param.requires_grad
                ]
    if state.method == "acp_sgd":
        total = 0
        for _, size, _padded in shapes:
            if len(size) >= 2 and state.acp.compresses(size):
                n, m = size[0], size.numel() // size[0]
                total += (n if even else m) * state.acp.rank
            else:
                total += size.numel()
        return total * element_size
    per = 2 if state.method in _HALF else element_size
    return sum(padded.numel() for _, _, padded in shapes) * per
