"""DeAR: decoupled all-reduce, pipelined per layer. Reduce-scatter in backward, all-gather in the next forward.

Zhang, Shi, Li (ICDCS 2023, arXiv 2302.12445; code lzhangbv/dear_pytorch on Horovod/MPI). A ring all-reduce is a
reduce-scatter followed by an all-gather. DeAR splits the two halves across iterations and pipelines both per layer:

1. **groups**: the modules that own trainable parameters, in forward (registration) order, merged with their
   neighbours until a group holds ``fusion_mb`` of gradients (the paper's fusion threshold; ``0`` = one group per
   module). A group's gradients live in one flat buffer padded to a multiple of the world size.
2. **backward**: a post-accumulate-grad hook on every parameter counts the group's gradients in; the moment a group is
   complete its **reduce-scatter starts, asynchronously, while backward goes on** with the earlier layers (on gloo,
   whose reduce-scatter is one all-reduce per rank, it is an all-to-all of the shards and a local sum: the same bytes).
   DDP itself sends nothing (torch's ``noop_hook``): DDP keeps its forward, buffers and ``no_sync``.
3. **optimizer step**: records the hyperparameters, finishes the first group's reduce-scatter and starts its
   all-gather. Nothing is updated yet.
4. **next forward**: the forward pre-hook of a group's modules waits for that group's all-gather, writes the averaged
   gradients into ``.grad``, runs the optimizer on that group's parameters only, and **starts the next group's
   all-gather**, which travels while this layer computes.

The bytes are exactly those of a dense all-reduce (one reduce-scatter plus one all-gather of every gradient); only the
schedule changes, and so does nothing in the result: every parameter gets the update the wrapped optimizer makes with
the dense average (the same arithmetic, per group, with the hyperparameters recorded at ``step()``, so an LR
scheduler's next value does not leak into the deferred update).

Use: ``state = hf_dtrain.comm.register(ddp_model, "dear", optimizer=optimizer)``. ``optimizer.step()`` then defers;
call ``state.flush()`` before reading or saving the weights outside a forward (the Trainer callback does this before
every save, evaluation and at the end). Gradient clipping on ``.grad`` between backward and ``step()`` would clip
local, not averaged, gradients and is refused by the Trainer callback.
"""

import math
import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hf_dtrain.errors import SettingsError

from ..distributed.collectives import all_gather_single, reduce_scatter_single, world_size_of
from ..distributed.counters import WireStats
from ..distributed.engines import keep_gradients_local


def _native_reduce_scatter(group) -> bool:
    """gloo's reduce-scatter is one all-reduce per rank (world times a ring all-reduce's bytes); there DeAR sends the
    shards with an all-to-all (each rank sends (N - 1) / N of the buffer, the reduce-scatter's volume) and sums
    locally. NCCL (and the rest) use the native reduce-scatter."""
    return dist.get_backend(group) != "gloo"


@dataclass
class _Group:
    """One fusion group: consecutive modules whose gradients travel together."""

    index: int
    params: list[torch.nn.Parameter]
    numel: int
    padded: int
    ready: int = 0  # gradients accumulated in this backward
    flat: torch.Tensor | None = None  # reduce-scatter input, then all-gather output
    shard: torch.Tensor | None = None
    received: torch.Tensor | None = None  # gloo: every rank's copy of this rank's shard, from the all-to-all
    receive_buffer: torch.Tensor | None = None  # what ``received`` points into, allocated once
    rs_work: object = None
    ag_work: object = None
    probe: tuple | None = None  # (param, flat index, value sent): what step() reads a GradScaler's unscale from
    scale: float = 1.0  # what the gradients were multiplied by between backward and step() (a GradScaler's 1/scale)


def make_groups(
    modules: list[torch.nn.Module], fusion_bytes: float, element_size: int = 4, world: int = 1
) -> list[_Group]:
    """Fusion groups over ``modules`` (forward order): each module's own trainable parameters (a parameter shared by
    two modules belongs to the first), merged with the next modules until the group reaches ``fusion_bytes``."""
    seen: set[int] = set()
    groups: list[_Group] = []
    params: list[torch.nn.Parameter] = []
    for module in modules:
        own = [p for p in module.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in own)
        params.extend(own)
        if params and sum(p.numel() for p in params) * element_size >= fusion_bytes:
            groups.append(params)
            params = []
    if params:
        groups.append(params)
    out = []
    for i, ps in enumerate(groups):
        n = sum(p.numel() for p in ps)
        out.append(_Group(index=i, params=ps, numel=n, padded=math.ceil(n / world) * world))
    return out


@dataclass
class DeARState:
    """State of per-layer DeAR: the fusion groups, their in-flight collectives and the deferred updates.

    * ``optimizer``: the torch optimizer over the DDP model's parameters (the inner one of an Accelerate /
      Trainer optimizer); its ``step`` is replaced by the deferring step;
    * ``stats``: bytes per step (reduce-scatter inputs, which with the all-gathers move what one all-reduce moves);
    * ``applied``: groups applied in forward pre-hooks so far (the overlap really happening);
    * ``trace``: give a list to record the schedule as ``(event, group)`` tuples: ``"rs"`` (a reduce-scatter
      started in backward), ``"ag"`` (an all-gather started), ``"apply"`` (a group's update, in a pre-hook).
    """

    process_group: dist.ProcessGroup | None = None
    fusion_mb: float = 1.0
    optimizer: torch.optim.Optimizer | None = None
    iter: int = 0
    stats: WireStats = field(default_factory=WireStats)
    applied: int = 0
    flushed: int = 0
    groups: list[_Group] = field(default_factory=list)
    by_param: dict[int, int] = field(default_factory=dict)  # id(param) -> group index
    _due: set = field(default_factory=set)  # groups whose update waits for a forward
    launched: list[int] = field(default_factory=list)  # this backward's reduce-scatters, in launch order
    hyper: list[dict] = field(default_factory=list)  # param-group hyperparameters recorded at step()
    trace: list | None = None
    _ddp: object = None
    _sync: bool = True
    _inner_step: object = None
    _handles: list = field(default_factory=list)
    _module_group: dict = field(default_factory=dict)  # id(module) -> the group its update waits for

    @property
    def pending(self) -> int:
        """Groups whose update is still deferred."""
        return len(self._due)

    # ---- backward: a group's reduce-scatter starts as soon as its last gradient is accumulated
    def _grad_ready(self, param: torch.Tensor) -> None:
        if not self._sync:  # inside no_sync(): the gradients accumulate locally
            return
        g = self.groups[self.by_param[id(param)]]
        g.ready += 1
        if g.ready == len(g.params):
            self._reduce_scatter(g)

    def _reduce_scatter(self, g: _Group) -> None:
        group = self.process_group
        world = world_size_of(group)
        like = g.params[0]
        if g.flat is None:  # allocated once per group, reused every step
            g.flat = torch.empty(g.padded, dtype=like.dtype, device=like.device)
            g.shard = torch.empty(g.padded // world, dtype=like.dtype, device=like.device)
        flat = g.flat
        flat[g.numel :].zero_()  # the padding (the all-gather wrote into it last step)
        offset = 0
        g.probe = None
        for p in g.params:  # every slot is written: a copy of the gradient, or zeros where there is none
            if p.grad is not None:
                grad = p.grad.reshape(-1)
                flat[offset : offset + p.numel()].copy_(grad)
                if g.probe is None:  # the largest entry, read at step() (no host sync here)
                    i = grad.abs().argmax()
                    g.probe = (p, i, grad[i].clone())
            else:
                flat[offset : offset + p.numel()].zero_()
            offset += p.numel()
        self.stats.add(flat)
        if _native_reduce_scatter(group):
            g.rs_work = reduce_scatter_single(g.shard, flat, group=group, async_op=True)
        else:
            if g.receive_buffer is None:
                g.receive_buffer = torch.empty_like(flat)
            g.received = g.receive_buffer
            g.rs_work = dist.all_to_all_single(g.received, flat, group=group, async_op=True)
        self.launched.append(g.index)
        if self.trace is not None:
            self.trace.append(("rs", g.index))

    def _all_gather(self, g: _Group) -> None:
        group = self.process_group
        g.rs_work.wait()
        g.rs_work = None
        if g.received is not None:  # the all-to-all reduce-scatter: sum the shards in rank order
            torch.sum(g.received.view(world_size_of(group), -1), dim=0, out=g.shard)
            g.received = None
        g.ag_work = all_gather_single(g.flat, g.shard, group=group, async_op=True)
        if self.trace is not None:
            self.trace.append(("ag", g.index))

    # ---- optimizer step: start the first group's all-gather, defer every update
    def step(self, closure=None):
        """The optimizer's ``step``: records the hyperparameters and starts the first group's all-gather; each group's
        update runs just before its first use in the next forward (or at :meth:`flush`)."""
        if closure is not None:
            raise SettingsError("DeAR defers the optimizer update to the next forward; step(closure) is not supported.")
        if self._due:  # a step() without a forward in between: apply what is still pending first
            self.flush()
        if not self.launched:  # no synchronised backward (one process, or gradients accumulated locally)
            return self._inner_step()
        for g in self.groups:  # a group with an unused parameter never completed: send it now (zeros)
            if g.rs_work is None:
                self._reduce_scatter(g)
        self.hyper = [{k: v for k, v in pg.items() if k != "params"} for pg in self.optimizer.param_groups]
        self._due = {g.index for g in self.groups}
        # a GradScaler unscales the local .grad in place before step() (on the sent copy it could not): the averaged
        # gradient gets the same factor (a power of two, so the ratio is exact); one host sync for all groups
        probed = [g for g in self.groups if g.probe is not None and g.probe[0].grad is not None]
        ratios = (
            torch.stack([g.probe[0].grad.reshape(-1)[g.probe[1]] / g.probe[2] for g in probed]).tolist()
            if probed
            else []
        )
        scales = {g.index: r for g, r in zip(probed, ratios)}
        for g in self.groups:
            g.ready = 0
            r = scales.get(g.index, 1.0)
            g.scale = r if math.isfinite(r) else 1.0  # an all-zero gradient: nothing to scale
            g.probe = None
        self.launched = []
        self.iter += 1
        self.stats.end_step()
        self._all_gather(self.groups[0])
        return None

    def apply(self, idx: int) -> None:
        """Finish group ``idx``: wait for its all-gather, start the next group's, set the averaged gradients and step
        the optimizer on this group's parameters only, with the hyperparameters recorded at ``step()``."""
        self._due.discard(idx)
        g = self.groups[idx]
        if g.ag_work is None:  # applied out of forward order (flush, or a module reused): gather it now
            self._all_gather(g)
        nxt = idx + 1
        if nxt < len(self.groups) and nxt in self._due and self.groups[nxt].ag_work is None:
            self._all_gather(self.groups[nxt])  # travels while this group's layer computes
        g.ag_work.wait()
        g.ag_work = None
        averaged = g.flat[: g.numel].mul_(g.scale / world_size_of(self.process_group))
        grads, offset = {}, 0
        for p in g.params:
            grads[id(p)] = averaged[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        if self.trace is not None:
            self.trace.append(("apply", idx))
        saved_grads, saved_hyper = [], []
        with torch.no_grad():
            for pg, hyper in zip(self.optimizer.param_groups, self.hyper):
                saved_hyper.append({k: pg[k] for k in hyper})
                pg.update(hyper)
                for p in pg["params"]:
                    saved_grads.append((p, p.grad))
                    p.grad = grads[id(p)].to(p.dtype) if id(p) in grads else None
            try:
                self._inner_step()
            finally:
                for pg, hyper in zip(self.optimizer.param_groups, saved_hyper):
                    pg.update(hyper)
                for p, grad in saved_grads:
                    p.grad = grad

    def flush(self) -> None:
        """Apply every deferred group now (before saving, evaluating outside a forward, or at the end)."""
        for idx in sorted(self._due):
            self.apply(idx)
            self.flushed += 1

    def _pre_forward(self, module, args):
        idx = self._module_group.get(id(module))
        if idx is not None and idx in self._due:
            self.apply(idx)
            self.applied += 1

    def _root_pre_forward(self, module, args):
        self._sync = bool(getattr(self._ddp, "require_backward_grad_sync", True))
        if self.launched and torch.is_grad_enabled():  # a backward whose step() never came (a GradScaler skipped it)
            self.discard()

    def discard(self) -> None:
        """Drop the reduce-scatters of a backward whose ``step()`` was skipped (a GradScaler found inf or nan)."""
        for g in self.groups:
            if g.rs_work is not None:
                g.rs_work.wait()
            g.rs_work = g.received = g.probe = None
            g.ready = 0
        self.launched = []
        self.stats.current = 0

    def attach(self, ddp_model, optimizer: torch.optim.Optimizer) -> None:
        """Build the groups over ``ddp_model``'s modules, hook them, silence DDP's own all-reduce and take over
        ``optimizer.step``."""
        self._ddp = ddp_model
        self.optimizer = optimizer
        self._inner_step = optimizer.step
        world = world_size_of(self.process_group)
        modules = [m for m in ddp_model.module.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
        self.groups = make_groups(modules, self.fusion_mb * 2**20, world=world)
        self.by_param = {id(p): g.index for g in self.groups for p in g.params}
        self._module_group = {}
        for m in modules:
            for p in m.parameters(recurse=False):
                if id(p) in self.by_param:
                    # a module's update is due when its first-grouped parameter's group is
                    self._module_group.setdefault(id(m), self.by_param[id(p)])
            if id(m) in self._module_group:
                self._handles.append(m.register_forward_pre_hook(self._pre_forward))
        self._handles.append(ddp_model.module.register_forward_pre_hook(self._root_pre_forward))
        for g in self.groups:
            for p in g.params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_ready))
        keep_gradients_local(ddp_model)

        def deferred_step(opt, closure=None):
            opt._opt_called = True  # what an LR scheduler's step() checks was called first
            return self.step(closure)

        # marked as an LR scheduler's wrapper would be, so schedulers made before or after this do not warn or re-wrap
        deferred_step._wrapped_by_lr_sched = True
        # a bound method of the optimizer (instance attribute): the Trainer and Accelerate call optimizer.step()
        optimizer.step = types.MethodType(deferred_step, optimizer)

    def detach(self) -> None:
        """Apply what is pending and restore the optimizer's own ``step`` (DDP's no-op hook stays registered: DDP
        cannot unregister one)."""
        self.flush()
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.optimizer is not None:
            self.optimizer.step = self._inner_step


def dear_step_bytes(group_numels: list[int], world: int, element_size: int = 4) -> int:
    """Bytes per step: every group padded to a multiple of the world size (the formula the tests check)."""
    return sum(math.ceil(n / world) * world * element_size for n in group_numels)
