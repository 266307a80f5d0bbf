"""DeAR: decoupled all-reduce. Reduce-scatter in backward, all-gather overlapped with the next forward.

Zhang, Shi, Li (ICDCS 2023, arXiv 2302.12445; code lzhangbv/dear_pytorch on Horovod/MPI). A ring all-reduce is a
reduce-scatter followed by an all-gather. DeAR splits the two halves across iterations:

1. **backward**: when DDP hands over a bucket (DDP's buckets are DeAR's fusion groups: ``bucket_cap_mb`` is the fusion
   threshold), start an asynchronous reduce-scatter of it; each rank ends with one shard of the summed bucket (on
   gloo, whose reduce-scatter is one all-reduce per rank, an all-to-all of the shards and a local sum);
2. **optimizer step**: wait for the reduce-scatters, start the all-gathers of the shards (in forward order), and do
   not update yet;
3. **next forward**: a forward pre-hook on the first module that uses a bucket's parameters waits for that bucket's
   all-gather, writes the averaged gradients into ``.grad`` and runs the optimizer on those parameters only, just
   before they are used. The all-gathers of later buckets proceed while earlier layers compute.

The bytes are exactly those of a dense all-reduce (one reduce-scatter plus one all-gather of the same buffer); only
the schedule changes, and so does nothing in the result: the update of every parameter is the one the wrapped
optimizer would make with the dense average (the same arithmetic, applied per bucket, with the hyperparameters
recorded at the ``step()`` call, so an LR scheduler's next value does not leak into the deferred update).

Use: ``state = hf_dtrain.comm.register(ddp_model, "dear", optimizer=optimizer)``. ``optimizer.step()`` then defers;
call ``state.flush()`` before reading or saving the weights outside a forward (the Trainer callback does this before
every save, evaluation and at the end). Gradient clipping on ``.grad`` between backward and ``step()`` would clip
local, not averaged, gradients and is refused by the Trainer callback.
"""


import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..distributed import WireStats, all_gather_single, reduce_scatter_single, world_size_of


def _reduce_scatter(output, input, group):
    return reduce_scatter_single(output, input, group=group, async_op=True)


def _all_gather(output, input, group):
    return all_gather_single(output, input, group=group, async_op=True)


def _native_reduce_scatter(group) -> bool:
    """gloo's reduce-scatter is one all-reduce per rank (world times a ring all-reduce's bytes); there DeAR sends the
    shards with an all-to-all (each rank sends (N - 1) / N of the buffer, the reduce-scatter's volume) and sums
    locally. NCCL (and the rest) use the native reduce-scatter."""
    return dist.get_backend(group) != "gloo"


@dataclass
class _Bucket:
    index: int
    params: list[torch.nn.Parameter]
    numel: int
    flat: torch.Tensor  # padded to a multiple of the world size; reduce-scatter input, then all-gather output
    shard: torch.Tensor
    work: object = None  # the reduce-scatter, then the all-gather
    received: Optional[torch.Tensor] = None  # gloo: every rank's copy of this rank's shard, from the all-to-all
    gathering: bool = False


@dataclass
class DeARState:
    """State of :func:`dear_hook` and of the deferred, per-bucket optimizer step.

    * ``optimizer``: the torch optimizer over the DDP model's parameters (the inner one of an Accelerate /
      Trainer optimizer); its ``step`` is replaced by the deferring step;
    * ``stats``: bytes per step (reduce-scatter input, which with the all-gather moves what one all-reduce moves);
    * ``applied``: buckets applied in forward pre-hooks so far (the overlap really happening).
    """

    process_group: Optional[dist.ProcessGroup] = None
    optimizer: Optional[torch.optim.Optimizer] = None
    iter: int = 0
    stats: WireStats = field(default_factory=WireStats)
    applied: int = 0
    flushed: int = 0
    reduced: dict[int, _Bucket] = field(default_factory=dict)  # this backward's reduce-scatters
    ready: dict[int, _Bucket] = field(default_factory=dict)  # after step(): all-gathers to apply before use
    by_param: dict[int, int] = field(default_factory=dict)  # id(param) -> bucket index of `ready`
    hyper: list[dict] = field(default_factory=list)  # param-group hyperparameters recorded at step()
    _inner_step: object = None
    _handles: list = field(default_factory=list)

    @property
    def pending(self) -> int:
        """Buckets whose update is still deferred."""
        return len(self.ready)

    def step(self, closure=None):
        """The optimizer's ``step``: wait for the reduce-scatters and start the all-gathers; the update itself runs
        per bucket before the bucket's first use in the next forward (or at :meth:`flush`)."""
        if closure is not None:
            raise ValueError("DeAR defers the optimizer update to the next forward; step(closure) is not supported.")
        if self.ready:  # a step() without a forward in between: apply what is still pending first
            self.flush()
        if not self.reduced:  # no synchronised backward reached the hook (one process, or no grads): plain step
            return self._inner_step()
        group = self.process_group
        self.hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        # forward order is the reverse of DDP's bucket order (buckets fill from the last layer's gradients)
        for idx in sorted(self.reduced, reverse=True):
            b = self.reduced[idx]
            b.work.wait()
            if b.received is not None:  # the all-to-all reduce-scatter: sum the shards in rank order
                torch.sum(b.received.view(world_size_of(group), -1), dim=0, out=b.shard)
                b.received = None
            b.work = _all_gather(b.flat, b.shard, group)
            b.gathering = True
            self.ready[idx] = b
            for p in b.params:
                self.by_param[id(p)] = idx
        self.reduced = {}
        return None

    def apply(self, idx: int) -> None:
        """Finish bucket ``idx``: wait for its all-gather, set the averaged gradients, step the optimizer on its
        parameters only, with the hyperparameters recorded at ``step()``."""
        b = self.ready.pop(idx)
        for p in b.params:
            self.by_param.pop(id(p), None)
        b.work.wait()
        averaged = b.flat[:b.numel].div_(world_size_of(self.process_group))
        in_bucket = {id(p) for p in b.params}
        saved_grads, saved_hyper = {}, []
        offset = 0
        grads = {}
        for p in b.params:
            grads[id(p)] = averaged[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        with torch.no_grad():
            for group, hyper in zip(self.optimizer.param_groups, self.hyper):
                saved_hyper.append({k: group[k] for k in hyper})
                group.update(hyper)
                for p in group["params"]:
                    saved_grads[id(p)] = (p, p.grad)
                    p.grad = grads[id(p)].to(p.dtype) if id(p) in in_bucket else None
            try:
                self._inner_step()
            finally:
                for group, hyper in zip(self.optimizer.param_groups, saved_hyper):
                    group.update(hyper)
                for p, g in saved_grads.values():
                    p.grad = g

    def flush(self) -> None:
        """Apply every deferred bucket now (before saving, evaluating outside a forward, or at the end)."""
        for idx in sorted(self.ready, reverse=True):
            self.apply(idx)
            self.flushed += 1

    def _pre_forward(self, module, args):
        for p in module.parameters(recurse=False):
            idx = self.by_param.get(id(p))
            if idx is not None:
                self.apply(idx)
                self.applied += 1

    def attach(self, ddp_model, optimizer: torch.optim.Optimizer) -> None:
        import types

        self.optimizer = optimizer
        self._inner_step = optimizer.step

        def deferred_step(opt, closure=None):
            opt._opt_called = True  # what an LR scheduler's step() checks was called first
            return self.step(closure)

        # marked as an LR scheduler's wrapper would be, so schedulers made before or after this do not warn or re-wrap
        deferred_step._wrapped_by_lr_sched = True
        # a bound method of the optimizer (instance attribute): the Trainer and Accelerate call optimizer.step()
        optimizer.step = types.MethodType(deferred_step, optimizer)
        for module in ddp_model.module.modules():
            if any(p.requires_grad for p in module.parameters(recurse=False)):
                self._handles.append(module.register_forward_pre_hook(self._pre_forward))

    def detach(self) -> None:
        """Apply what is pending and restore the optimizer's own ``step`` (the DDP hook stays registered: DDP
        cannot unregister one)."""
        self.flush()
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.optimizer is not None:
            self.optimizer.step = self._inner_step


# (no `from __future__ import annotations` here: DDP checks these annotations against the real classes)
def dear_hook(state: DeARState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: start the bucket's reduce-scatter and hand DDP back its buffer unchanged (the
    averaged gradient reaches ``.grad`` only in the deferred update)."""
    group = state.process_group
    world = world_size_of(group)
    buffer = bucket.buffer()
    n = buffer.numel()
    padded = math.ceil(n / world) * world
    flat = torch.zeros(padded, dtype=buffer.dtype, device=buffer.device)
    flat[:n].copy_(buffer)
    shard = torch.empty(padded // world, dtype=buffer.dtype, device=buffer.device)
    state.stats.add(flat)
    b = _Bucket(index=bucket.index(), params=list(bucket.parameters()), numel=n, flat=flat, shard=shard)
    if _native_reduce_scatter(group):
        b.work = _reduce_scatter(shard, flat, group)
    else:
        b.received = torch.empty_like(flat)
        b.work = dist.all_to_all_single(b.received, flat, group=group, async_op=True)
    state.reduced[b.index] = b
    if bucket.is_last():
        state.iter += 1
        state.stats.end_step()
    fut = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def dear_step_bytes(bucket_numels: list[int], world: int, element_size: int = 4) -> int:
    """Bytes per step: every bucket padded to a multiple of the world size (the formula the tests check)."""
    return sum(math.ceil(n / world) * world * element_size for n in bucket_numels)
