"""The optional LoRA-FA optimizer: peft's ``LoraFAOptimizer`` (AdamW with the gradient correction of LoRA-FA v2,
``g_B <- (1/s^2) g_B (A A^T)^-1``) set up for hf_dtrain's ``LoraFAModel``.

peft's own ``peft.optimizers.create_lorafa_optimizer`` targets peft ``LoraConfig`` models (``lora_A``/``lora_B``
parameters, A frozen by the optimizer while the forward still keeps ``x``). Here A is already frozen by the tuner, so
this function only builds the parameter groups the optimizer expects: for each adapted layer the pair (A, B) in that
order, named so that peft's pairing by ``"lora" in name`` finds them, with the layer's scaling factor.

Under FSDP2, B and its gradient are row shards (DTensor ``Shard(0)``) while A, a buffer, stays whole. The correction
acts on each row of ``g_B`` alone, so each rank applies it to its own rows: the step runs with DTensor's implicit
replication, which treats the whole ``(A A^T)^-1`` as replicated.
"""

from __future__ import annotations

import torch
from peft.optimizers.lorafa import LoraFAOptimizer
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from hf_dtrain.errors import SettingsError

from .._registry import register_folder
from .layer import LoraFALayer


class ShardAwareLoraFAOptimizer(LoraFAOptimizer):
    """peft's ``LoraFAOptimizer``, also for parameters sharded by FSDP2 (see the module docstring)."""

    @torch.no_grad()
    def step(self, closure=None):
        sharded = any(isinstance(p, DTensor) for group in self.param_groups for p in group["params"])
        if not sharded:
            return super().step(closure)
        with implicit_replication():
            return super().step(closure)


def create_lorafa_optimizer(
    model: torch.nn.Module, lr: float = 1e-3, weight_decay: float = 0.0, **kwargs
) -> ShardAwareLoraFAOptimizer:
    """Return peft's ``LoraFAOptimizer`` for the active LoRA-FA adapters of ``model`` (plus any other trainable
    parameter, e.g. ``modules_to_save``, which it updates with plain AdamW).

    Usable as ``Trainer(optimizers=(create_lorafa_optimizer(model, lr=2e-4), None))``.
    """
    params, names, scalings = [], [], []
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        if not isinstance(module, LoraFALayer):
            continue
        for adapter in module.active_adapters:
            if adapter not in module.lorafa_B or not module.lorafa_B[adapter].requires_grad:
                continue
            a, b = module.lorafa_A[adapter], module.lorafa_B[adapter]
            params += [a, b]
            names += [f"{module_name}.lorafa_A.{adapter}", f"{module_name}.lorafa_B.{adapter}"]
            scalings += [module.scaling[adapter]] * 2
            seen.add(id(b))
    if not params:
        raise SettingsError(
            "create_lorafa_optimizer found no trainable LoRA-FA adapter; build the model with "
            "get_peft_model(model, LoraFAConfig(...)) after `import hf_dtrain`."
        )
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            if "lora" in name:
                raise SettingsError(
                    f"Trainable parameter {name!r} has 'lora' in its name but is not a LoRA-FA adapter; peft's "
                    "LoraFAOptimizer pairs parameters by that substring, so it cannot be mixed in."
                )
            params.append(p)
            names.append(name)
            scalings.append(1.0)
    group = {"params": params, "names": names, "scaling_factors": scalings, "lr": lr, "weight_decay": weight_decay}
    return ShardAwareLoraFAOptimizer([group], lr=lr, weight_decay=weight_decay, **kwargs)


register_folder(__name__)
