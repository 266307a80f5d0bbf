"""EmbRace's sharded embeddings: column-sharded tables, lookups and gradients by all-to-all.

Li et al., arXiv 2110.09132 (no public code). Instead of replicating a ``vocab x hidden`` table on every rank and
exchanging its gradient, each rank **holds a slice of the columns of every row** (``hidden / world`` columns; uneven
splits allowed). Why columns and not rows: every token's lookup then costs every rank the same (``tokens x hidden /
world`` values), whatever the token distribution; a row split puts the frequent tokens of a Zipf-like vocabulary on
one rank, which then serves most of every batch.

* **forward**: the ranks' token ids are all-gathered (padded to the largest batch); each rank looks up every rank's
  tokens in its columns and sends rank ``r`` the rows of ``r``'s tokens (``all_to_all``); each rank concatenates the
  column slices it receives into its ``tokens x hidden`` embeddings.
* **backward**: the gradient of the embeddings goes back the same way (each rank sends owner ``q`` the gradient of
  its tokens in ``q``'s columns, ``all_to_all``); each owner adds every rank's rows into its slice with
  ``index_add_`` and divides by the world size, as DDP's average would. No table-sized all-reduce at all.
* The exchange runs on its own process group, so in backward it travels while DDP's all-reduce of the dense buckets
  is still in flight on the default group (the paper's overlap of the sparse and the dense exchange).

Bytes per step and rank: ``4 (N - 1) / N x tokens x hidden`` each way (plus the ids), against the ``4 x vocab x
hidden`` of the table's all-reduce. Memory: ``1 / N`` of the table and of its optimizer state.

``shard_embeddings(model)`` before wrapping in DDP (it replaces every trainable, untied ``nn.Embedding``);
``unshard_embeddings(model)`` (every rank) puts the full tables back, for saving. Clip gradients with
:func:`clip_sharded_grad_norm_` (the tables' norms summed over the ranks), not ``torch.nn.utils.clip_grad_norm_``,
whose norm would be each rank's own and would make the replicas drift apart; the Trainer callback installs it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hf_dtrain.errors import SettingsError

from ..distributed.collectives import all_gather_single, world_size_of
from ..distributed.counters import WireStats


def _column_splits(dim: int, world: int) -> list[int]:
    return [len(c) for c in torch.arange(dim).tensor_split(world)]


class _ShardedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, module, training):
        group, world, rank = module.group, module.world, module.rank
        flat = ids.reshape(-1)
        n = torch.tensor([flat.numel()], dtype=torch.int64)
        counts = torch.empty(world, dtype=torch.int64)
        all_gather_single(counts, n, group=group)
        counts = counts.tolist()
        padded = torch.zeros(max(counts), dtype=torch.int64, device=flat.device)
        padded[: flat.numel()] = flat
        all_ids = torch.empty(world * max(counts), dtype=torch.int64, device=flat.device)
        all_gather_single(all_ids, padded, group=group)
        all_ids = torch.cat([all_ids[r * max(counts) : r * max(counts) + counts[r]] for r in range(world)])
        mine = module.widths[rank]
        local = weight[all_ids]  # every rank's tokens, in this rank's columns
        out = torch.empty(sum(counts[rank] * w for w in module.widths), dtype=weight.dtype, device=weight.device)
        send = [counts[r] * mine for r in range(world)]
        recv = [counts[rank] * w for w in module.widths]
        dist.all_to_all_single(out, local.reshape(-1), recv, send, group=group)
        if module.stats is not None and training:  # a training step's bytes (not an evaluation's)
            module.stats.add(padded)
            module.stats.add(local)
        parts = out.split(recv)
        emb = torch.cat([p.view(counts[rank], w) for p, w in zip(parts, module.widths)], dim=1)
        ctx.module, ctx.all_ids, ctx.counts = module, all_ids, counts
        ctx.weight_shape = weight.shape
        return emb.view(*ids.shape, -1)

    @staticmethod
    def backward(ctx, grad_out):
        module, counts = ctx.module, ctx.counts
        group, world, rank = module.group, module.world, module.rank
        g = grad_out.reshape(counts[rank], -1).contiguous()
        # my tokens' gradient, cut by column owner
        send_parts = [p.contiguous().reshape(-1) for p in g.split(module.widths, dim=1)]
        send = [p.numel() for p in send_parts]
        mine = module.widths[rank]
        recv = [counts[r] * mine for r in range(world)]
        received = torch.empty(sum(recv), dtype=g.dtype, device=g.device)
        dist.all_to_all_single(received, torch.cat(send_parts), recv, send, group=group)
        if module.stats is not None:
            module.stats.add_bytes(sum(send) * g.element_size())
        grad_weight = torch.zeros(ctx.weight_shape, dtype=g.dtype, device=g.device)
        grad_weight.index_add_(0, ctx.all_ids, received.view(-1, mine))
        return None, grad_weight.div_(world), None, None


class ColumnShardedEmbedding(nn.Module):
    """An ``nn.Embedding`` whose rank holds columns ``[start, start + width)`` of every row (``weight``: ``vocab x
    width``); the lookup returns the full ``hidden``-wide embeddings of this rank's tokens."""

    def __init__(self, embedding: nn.Embedding, group=None):
        super().__init__()
        if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
            raise SettingsError(
                "ColumnShardedEmbedding shards plain embeddings only (no max_norm, scale_grad_by_freq "
                "or sparse gradients)."
            )
        self.group, self.world, self.rank = group, world_size_of(group), dist.get_rank(group)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.widths = _column_splits(self.embedding_dim, self.world)
        self.start = sum(self.widths[: self.rank])
        full = embedding.weight.detach()
        self.weight = nn.Parameter(
            full[:, self.start : self.start + self.widths[self.rank]].clone(),
            requires_grad=embedding.weight.requires_grad,
        )
        self.stats: WireStats | None = None

    def forward(self, ids):
        return _ShardedLookup.apply(ids, self.weight, self, torch.is_grad_enabled())

    @torch.no_grad()
    def full_weight(self) -> torch.Tensor:
        """The whole ``vocab x hidden`` table (a collective: every rank calls it)."""
        widest = max(self.widths)  # gloo gathers equal sizes: pad to the widest slice
        mine = torch.zeros(self.num_embeddings, widest, dtype=self.weight.dtype, device=self.weight.device)
        mine[:, : self.weight.shape[1]] = self.weight.detach()
        parts = [torch.empty_like(mine) for _ in self.widths]
        dist.all_gather(parts, mine, group=self.group)
        return torch.cat([p[:, :w] for p, w in zip(parts, self.widths)], dim=1)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, columns {self.start}:"
            f"{self.start + self.widths[self.rank]} of rank {self.rank}/{self.world}"
        )


def _tied(model: nn.Module, weight: nn.Parameter) -> bool:
    return sum(1 for m in model.modules() for p in m.parameters(recurse=False) if p is weight) > 1


def shard_embeddings(model: nn.Module, group=None) -> list[str]:
    """Replace every trainable ``nn.Embedding`` of ``model`` by a :class:`ColumnShardedEmbedding` and keep the shards
    out of DDP (call before ``DDP(model)`` / ``accelerator.prepare``; every rank, same model). Returns the names of
    the replaced modules. A table tied to the output projection is refused (its gradient is dense: keep it
    replicated with ``exchange="allgather"``, or untie it)."""
    if isinstance(model, DistributedDataParallel):
        raise SettingsError(
            "shard_embeddings() must run before the model is wrapped in DDP (before accelerator.prepare "
            "/ trainer.train); it got the wrapped model."
        )
    if world_size_of(group) < 2:
        raise SettingsError("sharded embeddings need a world of >= 2 processes (torchrun / accelerate launch).")
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding) and m.weight.requires_grad]
    if not targets:
        raise SettingsError(
            "EmbRace found no trainable nn.Embedding in the model; use a dense method (allreduce, "
            "acp_sgd) for models without trainable embeddings."
        )
    for name, m in targets:
        if _tied(model, m.weight):
            raise SettingsError(
                f"EmbRace exchange='sharded': the embedding {name!r} is tied to another module (the "
                "output projection, tie_word_embeddings=True), whose gradient is dense. Untie it, or use "
                "exchange='allgather' / 'alltoall' (replicated tables)."
            )
    # the lookups travel on their own group: in backward they overlap DDP's all-reduce on the default group
    own = dist.new_group(
        list(range(dist.get_world_size()))
        if group is None
        else [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
    )
    names = []
    for name, m in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, ColumnShardedEmbedding(m, own))
        names.append(name)
    ignore = [f"{n}.weight" for n in names]
    existing = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(set(existing) | set(ignore)))
    return names


def sharded_embeddings(model: nn.Module) -> dict[str, ColumnShardedEmbedding]:
    return {n: m for n, m in model.named_modules() if isinstance(m, ColumnShardedEmbedding)}


@torch.no_grad()
def clip_sharded_grad_norm_(parameters, max_norm: float, model: nn.Module, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model with sharded tables. A rank holds only its columns' gradient
    of each table, so a local norm differs from rank to rank, and clipping by it would scale the replicated dense
    gradients by a different factor on each rank: the replicas would drift apart. Here the tables' squared norms
    are summed over the ranks (one all-reduce), the dense gradients (equal on every rank after DDP's average)
    counted once, and every gradient is scaled by the same factor. Returns the total norm (the same on every rank).
    Every rank calls it."""
    if float(norm_type) != 2.0:
        raise SettingsError(
            f"clip_sharded_grad_norm_ with sharded embeddings supports norm_type=2 only, got "
            f"{norm_type}; use the Euclidean norm (the default)."
        )
    params = [
        p for p in (parameters if not isinstance(parameters, torch.Tensor) else [parameters]) if p.grad is not None
    ]
    shards = sharded_embeddings(model)
    shard_ids = {id(m.weight) for m in shards.values()}
    dense = [p.grad for p in params if id(p) not in shard_ids]
    local = [p.grad for p in params if id(p) in shard_ids]
    device = params[0].grad.device if params else torch.device("cpu")
    dense_sq = (
        torch.nn.utils.get_total_norm(dense).to(device, torch.float32) ** 2 if dense else torch.zeros((), device=device)
    )
    shard_sq = (
        torch.nn.utils.get_total_norm(local).to(device, torch.float32) ** 2 if local else torch.zeros((), device=device)
    )
    if shards:
        dist.all_reduce(shard_sq, group=next(iter(shards.values())).group)
    total = (dense_sq + shard_sq).sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


@torch.no_grad()
def unshard_embeddings(model: nn.Module) -> list[str]:
    """Put full ``nn.Embedding`` tables back (every rank: a collective), e.g. before ``save_pretrained``."""
    names = []
    for name, m in sharded_embeddings(model).items():
        full = m.full_weight()
        emb = nn.Embedding(
            m.num_embeddings, m.embedding_dim, padding_idx=m.padding_idx, device=full.device, dtype=full.dtype
        )
        emb.weight.copy_(full)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, emb)
        names.append(name)
    return names
