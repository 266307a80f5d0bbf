"""DDP replicas in a snapshot: the wrapped module (:func:`unwrap`), and after a restore the buckets DDP reduces the
gradients in (:func:`rebuild_ddp_buckets`).

DDP starts with buckets in the reverse order of the parameters and rebuilds them once, after its first backward, in
the order the gradients became ready. The reduction of a bucket (gloo's ring, NCCL's) adds each element in an order
that depends on where it sits in the bucket, so the same gradients reduced in the initial and in the rebuilt buckets
can differ in the last bit. An uninterrupted run reduces every step after its first in rebuilt buckets; a process
restored at step k would reduce step k+1 in initial ones. :func:`rebuild_ddp_buckets` makes the restored process
rebuild them first: one forward and backward of the model's own dummy input, which records the order the gradients
become ready in (the order of the training graph) and is reduced like any step, its gradients then dropped and the
RNG streams it may draw from put back. The next forward rebuilds the buckets, as in the uninterrupted run.
"""

from __future__ import annotations

import logging

import torch
from torch.nn.parallel import DistributedDataParallel

from .state import rng_state, set_rng_state

logger = logging.getLogger(__name__)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP's (or DeepSpeed's engine's) ``.module`` wrappers."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def rebuild_ddp_buckets(ddp) -> bool:
    """Have ``ddp`` (a ``DistributedDataParallel``) rebuild its buckets before its next real step, when it has not
    yet (a process that has just restored a snapshot). Every rank of ``ddp``'s group must call it (the backward is a
    collective). Returns whether it ran: only for a model with ``dummy_inputs`` (transformers' models), whose
    buckets were not rebuilt yet, with no communication hook and no module hooks (the extra forward and backward
    would change the state they keep: error feedback, DELTA's schedule). It runs in training mode and puts each
    module's mode back."""
    if not isinstance(ddp, DistributedDataParallel) or getattr(ddp, "_has_rebuilt_buckets", True):
        return False
    if getattr(ddp, "static_graph", False) or getattr(ddp, "find_unused_parameters", False):
        return False  # the buckets are rebuilt at the static graph's second step, or never
    hooked = [
        type(m).__name__
        for m in ddp.module.modules()
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
    ]
    if getattr(ddp, "_comm_hooks", None) or hooked:
        # a communication hook or module hooks (DELTA's, for one) keep state the extra step would change
        logger.info(
            "DDP's buckets are not rebuilt before the first step after the restore (%s): that step's "
            "reduction can differ from an uninterrupted run's in the last bit",
            "a communication hook" if getattr(ddp, "_comm_hooks", None) else f"hooks on {hooked[0]}",
        )
        return False
    inputs = getattr(ddp.module, "dummy_inputs", None)
    if not isinstance(inputs, dict):
        logger.warning(
            "DDP's buckets are not rebuilt before the first step after the restore (the model has no "
            "dummy_inputs): that step's reduction can differ from an uninterrupted run's in the last bit"
        )
        return False
    if any(p.grad is not None for p in ddp.module.parameters()):
        return False  # not at a step boundary with the gradients cleared
    device = next(ddp.module.parameters()).device
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
    rng = rng_state()
    modes = {m: m.training for m in ddp.module.modules()}
    ddp.train()  # the training graph (the Trainer evaluates before it trains: the model may be in eval mode)
    try:
        out = ddp(**inputs)
        logits = out.logits if hasattr(out, "logits") else out[0]
        (logits.float().sum() * 0).backward()
    finally:
        for m, mode in modes.items():
            m.training = mode
        for p in ddp.module.parameters():
            p.grad = None
        set_rng_state(rng)
    return True
