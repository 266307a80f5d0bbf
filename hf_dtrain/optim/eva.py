"""Eva: second-order preconditioning from two vectors per layer (Zhang, Shi, Li; ICLR 2023, arXiv 2308.02123).

K-FAC approximates a Linear layer's Fisher block by ``A ⊗ G`` with ``A = E[a aᵀ]`` (layer input) and
``G = E[g gᵀ]`` (gradient of the layer output) and inverts both matrices. Eva keeps only the running means ``ā`` and
``ḡ``, so the curvature is the rank-one Kronecker ``(ā āᵀ) ⊗ (ḡ ḡᵀ)``, and the damped inverse applies in closed form
(Sherman-Morrison), with no matrix stored or inverted. For a weight gradient ``∇`` (``out x in``, a bias as an extra
input column):

    Eva:   V = (∇ - (ḡᵀ ∇ ā) / (γ + ‖ā‖² ‖ḡ‖²) · ḡ āᵀ) / γ     = ((ā āᵀ ⊗ ḡ ḡᵀ) + γ I)⁻¹ ∇
    FOOF:  V = (∇ - (∇ ā) āᵀ / (γ + ‖ā‖²)) / γ               = ∇ (ā āᵀ + γ I)⁻¹     (input side only)

then the KL clip of the paper: all preconditioned gradients are scaled by ``ν = min(1, sqrt(κ / (lr² Σ V ⊙ ∇)))``
(``kl_clip=κ``; with ``kl_clip=0`` they are instead rescaled to the global norm of the raw gradients), and the
wrapped optimizer steps on them. Defaults are the paper's code (lzhangbv/eva): ``damping=0.03``, ``kl_clip=0.001``,
``factor_decay=0.95``, vectors every step. The running mean is updated as the reference code does,
``m ← (1 - decay) m + decay · new`` (weighted toward the newest vectors).

Data parallel: the vectors are averaged across ranks with one all-reduce of ``Σ (in + out)`` values per update (the
gradients are DDP's average already), so every rank preconditions identically. Gradient accumulation: the vectors of
all micro-batches of a step are averaged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from hf_dtrain.errors import SettingsError
from hf_dtrain.settings import config_from

from ..distributed.collectives import world_size_of
from ..optimizer_wrapper import WrappedOptimizer, build_base_optimizer, closure_loss
from .config import EVA_METHODS, EvaConfig, config_kwargs

METHODS = EVA_METHODS


class _Layer:
    """One preconditioned matrix: ``weight`` (out x in) and ``bias`` (or None), the map from the module's mean input
    to the matrix's mean input (``project``), and the factor from the module's output gradient to the matrix's
    output gradient (``g_scale``)."""

    __slots__ = (
        "_weight",
        "a",
        "a_sum",
        "bias",
        "count_a",
        "count_g",
        "g",
        "g_scale",
        "g_sum",
        "module",
        "name",
        "project",
        "smt_adapter",
    )

    def __init__(self, name, module, weight, bias=None, project=None, g_scale: float = 1.0, smt_adapter=None):
        self.name, self.module, self._weight, self.bias = name, module, weight, bias
        self.project, self.g_scale = project, g_scale
        self.smt_adapter = smt_adapter  # SMT: the adapter whose (k, b, b) delta blocks are the matrix's parameter
        self.a_sum = self.g_sum = None
        self.count_a = self.count_g = 0
        self.a = self.g = None  # running means

    @property
    def weight(self):
        # SMT replaces its block parameter when the blocks are selected after the warm-up: always the live one (None
        # while the target has no block)
        if self.smt_adapter is None:
            return self._weight
        blocks = self.module.smt_weight
        return blocks.get(self.smt_adapter, None)


def _smt_targets(name: str, module) -> list:
    """hf_dtrain SMT layers: ``y = W x + D x`` with W frozen and D block-sparse; the trainable blocks of D see the
    layer's input and output gradient, so Eva's curvature is that of the dense matrix restricted to the blocks. Every
    target of a trained adapter is kept, also one with no block yet (a later selection may give it some)."""
    return [
        _Layer(f"{name}.smt_weight.{adapter}", module, None, smt_adapter=adapter)
        for adapter in getattr(module, "active_adapters", [])
        if adapter in module.block_size
    ]


def _block_precondition(
    method: str,
    gamma: float,
    grad: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    a: torch.Tensor,
    g: torch.Tensor,
) -> torch.Tensor:
    """Eva / FOOF for block-sparse parameters: ``grad`` (k, b, b) holds the gradients of the blocks at block
    positions ``(rows[k], cols[k])`` of a matrix with mean input ``a`` and mean output gradient ``g``.

    The curvature restricted to the selected entries is still rank one for Eva: ``u uᵀ`` with ``u`` the entries of
    ``ḡ āᵀ`` at the blocks, so ``(u uᵀ + γ I)⁻¹ ∇ = (∇ - (uᵀ∇ / (γ + ‖u‖²)) u) / γ``. For FOOF each output row
    couples only the selected input columns of that row: per block row ``r``, ``(ā_r ā_rᵀ + γ I)⁻¹`` with ``ā_r``
    the input mean over the row's selected column blocks."""
    bs = grad.shape[-1]
    a_k = a.view(-1, bs).index_select(0, cols)  # (k, b) input mean of each block's columns
    if method == "foof":
        s = torch.einsum("kob,kb->ko", grad, a_k)  # ∇_k ā_k per block, summed over the row's blocks below
        n_rows = int(rows.max()) + 1
        s_r = s.new_zeros(n_rows, bs).index_add_(0, rows, s)
        n_r = s.new_zeros(n_rows).index_add_(0, rows, a_k.pow(2).sum(1))
        coeff = s_r.index_select(0, rows) / (gamma + n_r.index_select(0, rows)).unsqueeze(1)
        return (grad - coeff.unsqueeze(2) * a_k.unsqueeze(1)) / gamma
    g_k = g.view(-1, bs).index_select(0, rows)  # (k, b) output-gradient mean of each block's rows
    u_grad = torch.einsum("ko,kob,kb->", g_k, grad, a_k)
    u_norm = (g_k.pow(2).sum(1) * a_k.pow(2).sum(1)).sum()
    return (grad - (u_grad / (gamma + u_norm)) * torch.einsum("ko,kb->kob", g_k, a_k)) / gamma


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local part of an FSDP2 (DTensor) gradient, a view that writes through; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _row_shard(grad: torch.Tensor, name: str):
    """``(rows, group)`` of an FSDP2 gradient: the slice of the matrix's rows this rank holds and the process group
    of the mesh dimension that shards them; ``(None, None)`` for a whole gradient. HSDP's replicate dimension holds
    copies, so only the shard dimension's group sums."""
    if not isinstance(grad, DTensor):
        return None, None
    dims = [i for i, p in enumerate(grad.placements) if not isinstance(p, Replicate)]
    if len(dims) != 1 or grad.placements[dims[0]] != Shard(0):
        raise SettingsError(
            f"Eva: the gradient of {name} is sharded as {grad.placements}; Eva preconditions whole "
            "matrices or FSDP2's row shards (Shard(0) on one mesh dimension)."
        )
    shape, offset = compute_local_shape_and_global_offset(grad.shape, grad.device_mesh, grad.placements)
    return slice(offset[0], offset[0] + shape[0]), grad.device_mesh.get_group(dims[0])


def _lorafa_targets(name: str, module) -> list:
    """hf_dtrain LoRA-FA layers: ``y = W x + s B (A x)`` with W and A frozen; B (out x r) sees ``A x`` and the
    output gradient times ``s`` (dropout on ``A x`` is left out of the mean input)."""
    targets = []
    for adapter in getattr(module, "active_adapters", []):
        if adapter not in module.lorafa_B or not module.lorafa_B[adapter].requires_grad:
            continue
        a_matrix = module.lorafa_A[adapter]
        targets.append(
            _Layer(
                f"{name}.lorafa_B.{adapter}",
                module,
                module.lorafa_B[adapter],
                project=lambda x, a=a_matrix: a.float() @ x,
                g_scale=float(module.scaling[adapter]),
            )
        )
    return targets


class Eva(WrappedOptimizer):
    """Eva (or vectorized FOOF) preconditioning around a torch optimizer.

    ``Eva(model.parameters(), model=model, base_optimizer="sgd", lr=0.1, momentum=0.9)`` or ``Eva(model, ...)``
    (its trainable parameters); as the Trainer's ``optimizer_cls_and_kwargs=(Eva, {"model": model,
    "base_optimizer": "adamw", "lr": 1e-3})`` (the Trainer then passes the model itself); with Accelerate and
    as a DeepSpeed client optimizer like any torch optimizer. Every trainable ``nn.Linear`` of ``model`` (peft adapter
    Linear layers included), every hf_dtrain LoRA-FA adapter (B, with input ``A x``) and every SMT adapter (its delta
    blocks, with the dense curvature restricted to them) is preconditioned, except names matching ``exclude`` (the
    vocabulary projection by default, as in the paper's code); other parameters get the wrapped optimizer's plain
    update.

    * ``base_optimizer``: a ``torch.optim.Optimizer`` class or ``"sgd"``/``"adamw"``/``"adam"``; ``**base_kwargs``
      go to it (``lr``, ``momentum``, ``weight_decay``, ...);
    * ``damping`` γ > 0; ``kl_clip`` κ >= 0 (0: rescale to the raw gradient norm); ``factor_decay`` in (0, 1];
    * ``update_interval``: collect the vectors every this many steps (they are reused in between);
    * ``method``: ``"eva"`` or ``"foof"``.
    """

    def __init__(
        self,
        params: Iterable | nn.Module,
        model: nn.Module | None = None,
        base_optimizer: str | Callable = "sgd",
        damping: float = 0.03,
        kl_clip: float = 0.001,
        factor_decay: float = 0.95,
        update_interval: int = 1,
        method: str = "eva",
        exclude: tuple[str, ...] = ("lm_head",),
        process_group=None,
        **base_kwargs,
    ):
        if isinstance(params, nn.Module):  # Eva(model, ...); also what the Trainer passes for kwargs with "model"
            model = params if model is None else model
            params = [p for p in params.parameters() if p.requires_grad]
        if not isinstance(model, nn.Module):
            raise TypeError(f"Eva needs the model (to hook its Linear layers): model=..., got {type(model).__name__}.")
        self.config = config_from(EvaConfig, locals(), exclude=list(exclude))
        self._init_wrapper()
        self.base = build_base_optimizer(base_optimizer, params, "Eva", **base_kwargs)
        self.damping, self.kl_clip, self.factor_decay = float(damping), float(kl_clip), float(factor_decay)  # validated
        self.update_interval, self.method, self.process_group = update_interval, method, process_group
        self.steps = 0
        optimized = {id(p) for g in self.base.param_groups for p in g["params"]}
        self.layers: list[_Layer] = []
        self._handles = []
        for name, module in model.named_modules():
            if any(e and e in name for e in exclude):
                continue
            if isinstance(module, nn.Linear):
                targets = [_Layer(name, module, module.weight, module.bias)]
            elif hasattr(module, "lorafa_B") and hasattr(module, "lorafa_A"):
                targets = _lorafa_targets(name, module)
            elif hasattr(module, "smt_weight") and hasattr(module, "smt_indices"):
                targets = _smt_targets(name, module)
            else:
                continue
            for layer in targets:
                if layer.smt_adapter is not None and hasattr(layer.weight, "device_mesh"):
                    raise SettingsError(
                        f"Eva: {layer.name} holds SMT blocks sharded by FSDP2; Eva's block curvature "
                        "couples the blocks of one block row, which sit on other ranks. Precondition "
                        "SMT under DDP, or use another optimizer with --fsdp."
                    )
                if layer.weight is None:  # SMT target with no block yet: kept while its adapter is trained
                    if not module._smt_wants_grad.get(layer.smt_adapter, True):
                        continue
                elif not layer.weight.requires_grad or id(layer.weight) not in optimized:
                    continue
                self.layers.append(layer)
                self._handles.append(module.register_forward_hook(self._make_forward_hook(layer)))
        if not self.layers:
            raise SettingsError(
                "Eva found no trainable nn.Linear (or LoRA-FA / SMT adapter) in the model among the optimized "
                "parameters; nothing to precondition (check model= and exclude=)."
            )

    @classmethod
    def from_config(
        cls,
        params,
        config: EvaConfig,
        model: nn.Module | None = None,
        base_optimizer: str | Callable = "sgd",
        process_group=None,
        **base_kwargs,
    ) -> Eva:
        """``Eva`` with every setting from ``config`` (what the jobs pass down); ``base_kwargs`` (lr, weight decay)
        go to the wrapped optimizer."""
        return cls(
            params,
            model=model,
            base_optimizer=base_optimizer,
            process_group=process_group,
            **config_kwargs(config),
            **base_kwargs,
        )

    def __repr__(self) -> str:
        return (
            f"Eva(method={self.method}, damping={self.damping}, kl_clip={self.kl_clip}, "
            f"factor_decay={self.factor_decay}, update_interval={self.update_interval}, layers={len(self.layers)}, "
            f"base={self.base!r})"
        )

    # -- collecting the vectors -------------------------------------------------------------------------------------
    def _collecting(self, module) -> bool:
        # not tied to module.training: a model loaded with from_pretrained is in eval mode until .train(), and a
        # forward with gradients enabled is a training forward either way
        return torch.is_grad_enabled() and self.steps % self.update_interval == 0

    def _make_forward_hook(self, layer: _Layer):
        def hook(module, inputs, output):
            if not self._collecting(module):
                return
            x = inputs[0].detach()
            a = x.reshape(-1, x.shape[-1]).float().mean(0)
            if layer.project is not None:
                a = layer.project(a)
            if layer.bias is not None:
                a = torch.cat([a, a.new_ones(1)])
            layer.a_sum = a if layer.a_sum is None else layer.a_sum + a
            layer.count_a += 1
            if output.requires_grad:

                def grad_hook(grad):
                    g = grad.detach().reshape(-1, grad.shape[-1]).float().mean(0) * layer.g_scale
                    layer.g_sum = g if layer.g_sum is None else layer.g_sum + g
                    layer.count_g += 1

                output.register_hook(grad_hook)

        return hook

    def _update_vectors(self) -> None:
        fresh = [l for l in self.layers if l.count_a and l.count_g]
        if not fresh:
            return
        a_new = [l.a_sum / l.count_a for l in fresh]
        g_new = [l.g_sum / l.count_g for l in fresh]
        world = world_size_of(self.process_group)
        if world > 1:  # one small all-reduce: every rank preconditions with the same vectors
            flat = torch.cat(a_new + g_new)
            dist.all_reduce(flat, group=self.process_group)
            flat /= world
            sizes = [v.numel() for v in a_new + g_new]
            parts = list(flat.split(sizes))
            a_new, g_new = parts[: len(fresh)], parts[len(fresh) :]
        d = self.factor_decay
        for layer, a, g in zip(fresh, a_new, g_new):
            layer.a = a.clone() if layer.a is None else (1 - d) * layer.a + d * a
            layer.g = g.clone() if layer.g is None else (1 - d) * layer.g + d * g
        for layer in self.layers:
            layer.a_sum = layer.g_sum = None
            layer.count_a = layer.count_g = 0

    # -- preconditioning ---------------------------------------------------------------------------------------------
    def precondition(
        self,
        grad: torch.Tensor,
        a: torch.Tensor,
        g: torch.Tensor,
        rows: slice | None = None,
        agg: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The preconditioned gradient of one layer (``grad``: out x in, a bias column appended).

        ``rows``: ``grad`` holds only these rows of the layer's gradient (an FSDP2 row shard). FOOF acts on each row
        alone; Eva's one scalar ``gᵀ ∇ a`` is a sum over all rows, passed as ``agg`` when the rows are sharded (each
        rank adds its rows' part, ``step`` sums the parts of every layer in one all-reduce)."""
        gamma = self.damping
        if self.method == "foof":
            ga = grad @ a
            return (grad - torch.outer(ga, a) / (gamma + a.dot(a))) / gamma
        g_rows = g if rows is None else g[rows]
        if agg is None:
            agg = g_rows @ grad @ a
        return (grad - (agg / (gamma + a.dot(a) * g.dot(g))) * torch.outer(g_rows, a)) / gamma

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        if self.steps % self.update_interval == 0:
            self._update_vectors()
        if (
            self.steps == 0
            and all(l.a is None for l in self.layers)
            and any(l.weight is not None and l.weight.grad is not None for l in self.layers)
        ):
            raise SettingsError(
                "Eva saw no forward pass of the model's Linear layers with gradients enabled before its "
                "first step(): pass model= the module that is trained (the same object, not a copy)."
            )
        if (
            self.steps == 0
            and any(l.a is not None for l in self.layers)
            and all(l.weight is None or l.weight.grad is None for l in self.layers)
            and any(p.grad is not None for group in self.base.param_groups for p in group["params"])
        ):
            # DeepSpeed ZeRO >= 1 hands the client optimizer flat partitions of all parameters, not the layers
            raise SettingsError(
                "Eva found gradients on the optimizer's parameters but none on the model's layers: an "
                "engine keeps them elsewhere (DeepSpeed ZeRO stage >= 1 hands its client optimizer flat "
                "fp32 partitions with no layer boundaries, so no matrix can be preconditioned). Use Eva "
                "with DDP, FSDP2 or ZeRO stage 0."
            )
        self.steps += 1
        updates = []  # (target parameters, their raw gradient, the preconditioned gradient)
        dense = []  # (target parameters, raw gradient, a, g, rows) of the matrices preconditioned below
        shard_group = None  # the FSDP2 shard group, when gradients are row shards
        for layer in self.layers:
            w, b = layer.weight, layer.bias
            if w is None or w.grad is None or layer.a is None or layer.g is None or w.numel() == 0:
                continue
            rows, group = _row_shard(w.grad, layer.name)
            shard_group = group if group is not None else shard_group
            if layer.smt_adapter is not None:
                idx = layer.module.smt_indices[layer.smt_adapter]
                grad = w.grad.float()
                v = _block_precondition(self.method, self.damping, grad, idx[:, 0], idx[:, 1], layer.a, layer.g)
                updates.append(((w,), grad, v))
                continue
            grad = _local(w.grad).float()
            has_bias = b is not None and b.grad is not None and layer.a.numel() == grad.shape[1] + 1
            if has_bias:
                grad = torch.cat([grad, _local(b.grad).float().unsqueeze(1)], 1)
            a = layer.a if layer.a.numel() == grad.shape[1] else None
            if a is None:  # a bias whose gradient is absent this step: drop its column of the vector
                a = layer.a[: grad.shape[1]]
            dense.append(((w, b) if has_bias else (w,), grad, a, layer.g, rows))
        # Eva on row shards: every layer's partial gᵀ∇a over this rank's rows, completed by one all-reduce
        aggs = [None] * len(dense)
        if shard_group is not None and self.method != "foof" and dense:
            parts = torch.stack(
                [g[rows] @ grad @ a if rows is not None else g @ grad @ a for _, grad, a, g, rows in dense]
            )
            sharded = torch.tensor([rows is not None for *_, rows in dense])
            summed = parts.where(sharded, torch.zeros_like(parts))
            dist.all_reduce(summed, group=shard_group)
            aggs = list(torch.where(sharded, summed, parts))
        for (params, grad, a, g, rows), agg in zip(dense, aggs):
            updates.append((params, grad, self.precondition(grad, a, g, rows=rows, agg=agg)))
        if updates:
            lr = self.base.param_groups[0]["lr"]
            # one host sync for all layers (a float() per layer would stall a GPU once per layer)
            # sums over whole matrices: with row shards, each rank adds its rows and one all-reduce completes them
            if self.kl_clip > 0:
                vg = torch.stack([(v * g).sum() for _, g, v in updates]).sum()
                if shard_group is not None:
                    dist.all_reduce(vg, group=shard_group)
                vg = float(vg) * lr**2
                nu = min(1.0, math.sqrt(self.kl_clip / vg)) if vg > 0 else 1.0
            else:
                sums = torch.stack([torch.stack([g.pow(2).sum(), v.pow(2).sum()]) for _, g, v in updates]).sum(0)
                if shard_group is not None:
                    dist.all_reduce(sums, group=shard_group)
                gg, vv = (float(x) for x in sums)
                nu = math.sqrt(gg / vv) if vv > 0 else 1.0
            for params, _, v in updates:
                v = v * nu
                if len(params) == 2:
                    w, b = params
                    _local(w.grad).copy_(v[:, :-1].to(w.grad.dtype))
                    _local(b.grad).copy_(v[:, -1].to(b.grad.dtype))
                else:
                    _local(params[0].grad).copy_(v.to(params[0].grad.dtype))
        self.base.step()
        return loss

    # -- checkpoints: Eva's step and vectors under the "eva" key of the wrapped optimizer's state dict ------------
    state_key = "eva"

    def _wrapper_state(self) -> dict:
        return {"steps": self.steps, "vectors": {l.name: {"a": l.a, "g": l.g} for l in self.layers if l.a is not None}}

    def _load_wrapper_state(self, eva: dict) -> None:
        self.steps = int(eva["steps"])
        by_name = {l.name: l for l in self.layers}
        for name, vec in eva["vectors"].items():
            if name in by_name:
                by_name[name].a = vec["a"].clone()
                by_name[name].g = vec["g"].clone()

    def extra_memory_bytes(self) -> int:
        """Bytes Eva keeps beyond the wrapped optimizer: two vectors per layer."""
        return sum((l.a.numel() + l.g.numel()) * 4 for l in self.layers if l.a is not None)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
