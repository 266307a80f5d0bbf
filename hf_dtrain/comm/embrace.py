"""EmbRace: sparse (index, row) exchange for embedding gradients, dense all-reduce for the rest.

Li et al., arXiv 2110.09132 (no public code). An input embedding's gradient is nonzero only in the rows of the tokens
in the batch, yet DDP all-reduces the whole ``vocab x hidden`` table every step. EmbRace takes the embedding
parameters out of DDP and sends only the touched rows:

* ``exclude_embeddings(model)`` marks every trainable ``nn.Embedding`` weight as ignored by DDP; call it **before**
  ``DDP(model)`` / ``accelerator.prepare(model)`` / ``trainer.train()``;
* the dense parameters go through DDP with a counted all-reduce hook, as usual;
* when an embedding's gradient is accumulated (a post-accumulate-grad hook, only on steps where DDP synchronises, so
  gradient accumulation stays local), its nonzero rows leave as (index, row) pairs:

  - ``exchange="allgather"``: every rank gathers every rank's pairs (padded to the largest count) and sums them with
    ``index_add_``;
  - ``exchange="alltoall"``: row ``i`` belongs to rank ``i mod world``; pairs go to their owner by ``all_to_all``,
    the owner sums its rows and the summed rows are all-gathered: each distinct row crosses the wire once per owner
    instead of once per rank that touched it;

  the result, divided by the world size, is the dense average exactly (the same sums of the same values). The
  exchange runs asynchronously and is awaited at the end of backward (``queue_callback``, as DDP itself does).
* Where the rows are not sparse enough to win (a tied output projection makes the embedding gradient dense), that
  step falls back to a dense all-reduce of the table.

``exchange="sharded"`` is the paper's own layout (:mod:`hf_dtrain.comm.embrace_sharded`): column-sharded tables,
lookups and gradients by all-to-all, no table-sized exchange at all; call ``shard_embeddings(model)`` instead of
``exclude_embeddings`` before wrapping. The two replicated exchanges keep every model and optimizer unchanged.
"""

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from hf_dtrain.errors import SettingsError

from ..distributed.collectives import all_gather_single, world_size_of
from ..distributed.counters import WireStats
from .config import EXCHANGES


def embedding_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Trainable ``nn.Embedding`` weights of ``model`` by their ``named_parameters`` name (a tied weight once)."""
    weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding) and m.weight.requires_grad}
    return {n: p for n, p in model.named_parameters() if id(p) in weights}


def exclude_embeddings(model: nn.Module) -> list[str]:
    """Keep the embedding weights out of DDP (call before wrapping); returns their names."""
    if isinstance(model, DistributedDataParallel):
        raise SettingsError(
            "exclude_embeddings() must run before the model is wrapped in DDP (before "
            "accelerator.prepare / trainer.train); it got the wrapped model."
        )
    names = sorted(embedding_parameters(model))
    if not names:
        raise SettingsError(
            "EmbRace found no trainable nn.Embedding in the model; use a dense method (allreduce, "
            "acp_sgd) for models without trainable embeddings."
        )
    existing = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(set(existing) | set(names)))
    return names


@dataclass
class EmbRaceState:
    """State of the EmbRace exchange (and of the dense hook it registers on DDP).

    * ``exchange``: ``"allgather"`` or ``"alltoall"``;
    * ``stats``: bytes per step, dense buckets and embedding pairs together;
    * ``sparse_steps`` / ``dense_steps``: embedding exchanges that took each path; ``rows_sent``: rows this rank sent.
    """

    process_group: dist.ProcessGroup | None = None
    exchange: str = "allgather"
    stats: WireStats = field(default_factory=WireStats)
    sparse_steps: int = 0
    dense_steps: int = 0
    rows_sent: int = 0
    iter: int = 0
    _ddp: object = None
    _params: dict = field(default_factory=dict)
    _pending: list = field(default_factory=list)
    _queued: bool = False

    def __post_init__(self):
        if self.exchange not in EXCHANGES:
            raise SettingsError(f"EmbRaceState.exchange={self.exchange!r}; use one of {', '.join(EXCHANGES)}.")

    # -- dense parameters: DDP's all-reduce, counted ----------------------------------------------------------------
    def _queue_end(self):
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self):
        self._queued = False
        for finish in self._pending:
            finish()
        self._pending = []
        self.iter += 1
        self.stats.end_step()

    # -- embedding parameters ---------------------------------------------------------------------------------------
    def _on_grad(self, param: nn.Parameter) -> None:
        ddp = self._ddp() if self._ddp is not None else None
        if ddp is not None and not ddp.require_backward_grad_sync:
            return  # inside no_sync(): accumulate locally, exchange on the synchronising micro-step
        self._queue_end()
        group, world = self.process_group, world_size_of(self.process_group)
        grad = param.grad
        rows = grad.ne(0).any(dim=1).nonzero().flatten()
        vocab, dim = grad.shape
        counts = torch.tensor([rows.numel()], dtype=torch.int64)
        all_counts = torch.empty(world, dtype=torch.int64)
        self.stats.add(counts)
        all_gather_single(all_counts, counts, group=group)  # 8 bytes, synchronous: sizes follow from it
        max_k = int(all_counts.max())
        row_bytes = dim * grad.element_size() + 8
        if max_k * row_bytes >= vocab * dim * grad.element_size():  # not sparse enough: dense all-reduce
            self.dense_steps += 1
            self.stats.add(grad)
            work = dist.all_reduce(grad, group=group, async_op=True)

            def finish_dense():
                work.wait()
                grad.div_(world)

            self._pending.append(finish_dense)
            return
        self.sparse_steps += 1
        self.rows_sent += rows.numel()
        if self.exchange == "allgather":
            self._allgather(grad, rows, max_k, world, group)
        else:
            self._alltoall(grad, rows, world, group)

    def _allgather(self, grad, rows, max_k, world, group):
        dim = grad.shape[1]
        index = torch.zeros(max_k, dtype=torch.int64, device=grad.device)  # padding: row 0 plus a zero row
        values = torch.zeros(max_k, dim, dtype=grad.dtype, device=grad.device)
        index[: rows.numel()] = rows
        values[: rows.numel()] = grad[rows]
        all_index = torch.empty(world * max_k, dtype=torch.int64, device=grad.device)
        all_values = torch.empty(world * max_k, dim, dtype=grad.dtype, device=grad.device)
        self.stats.add(index)
        self.stats.add(values)
        w1 = all_gather_single(all_index, index, group=group, async_op=True)
        w2 = all_gather_single(all_values, values, group=group, async_op=True)

        def finish():
            w1.wait()
            w2.wait()
            grad.zero_()
            grad.index_add_(0, all_index, all_values)
            grad.div_(world)

        self._pending.append(finish)

    def _alltoall(self, grad, rows, world, group):
        dim = grad.shape[1]
        owner = rows % world
        order = torch.argsort(owner, stable=True)
        send_index = rows[order]
        send_values = grad[send_index]
        send_counts = torch.bincount(owner, minlength=world)
        recv_counts = torch.empty_like(send_counts)
        self.stats.add(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        send_split, recv_split = send_counts.tolist(), recv_counts.tolist()
        recv_index = torch.empty(sum(recv_split), dtype=torch.int64, device=grad.device)
        recv_values = torch.empty(sum(recv_split), dim, dtype=grad.dtype, device=grad.device)
        self.stats.add(send_index)
        self.stats.add(send_values)
        w1 = dist.all_to_all_single(recv_index, send_index, recv_split, send_split, group=group, async_op=True)
        w2 = dist.all_to_all_single(recv_values, send_values, recv_split, send_split, group=group, async_op=True)

        def finish():
            w1.wait()
            w2.wait()
            # the owner sums its rows (in rank order, the order all_to_all delivers them) ...
            owned, inverse = torch.unique(recv_index, return_inverse=True)
            summed = torch.zeros(owned.numel(), dim, dtype=grad.dtype, device=grad.device)
            summed.index_add_(0, inverse, recv_values)
            # ... and every rank gathers every owner's summed rows (padded to the largest count)
            counts = torch.tensor([owned.numel()], dtype=torch.int64)
            all_counts = torch.empty(world, dtype=torch.int64)
            self.stats.add(counts)
            all_gather_single(all_counts, counts, group=group)
            max_k = int(all_counts.max())
            index = torch.zeros(max_k, dtype=torch.int64, device=grad.device)
            values = torch.zeros(max_k, dim, dtype=grad.dtype, device=grad.device)
            index[: owned.numel()] = owned
            values[: owned.numel()] = summed
            all_index = torch.empty(world * max_k, dtype=torch.int64, device=grad.device)
            all_values = torch.empty(world * max_k, dim, dtype=grad.dtype, device=grad.device)
            self.stats.add(index)
            self.stats.add(values)
            all_gather_single(all_index, index, group=group)
            all_gather_single(all_values, values, group=group)
            grad.zero_()
            grad.index_add_(0, all_index, all_values)  # each row comes from its one owner: no sum here
            grad.div_(world)

        self._pending.append(finish)

    def attach(self, ddp_model) -> None:
        if self.exchange == "sharded":
            from .embrace_sharded import sharded_embeddings

            shards = sharded_embeddings(ddp_model.module)
            if not shards:
                raise SettingsError(
                    "EmbRace exchange='sharded' found no sharded embedding. Call "
                    "hf_dtrain.comm.shard_embeddings(model) before DDP(model) / accelerator.prepare(model) "
                    "(CommHookCallback.attach does it for the Trainer)."
                )
            for m in shards.values():
                m.stats = self.stats  # the lookups' and their gradients' bytes count in this step
            self._ddp = weakref.ref(ddp_model)
            return
        ignored = set(getattr(ddp_model.module, "_ddp_params_and_buffers_to_ignore", []))
        params = embedding_parameters(ddp_model.module)
        missing = sorted(set(params) - ignored)
        if missing:
            raise SettingsError(
                f"EmbRace: the embedding parameter(s) {missing} are still inside DDP. Call "
                "hf_dtrain.comm.exclude_embeddings(model) before DDP(model) / accelerator.prepare(model) "
                "(CommHookCallback.attach does it for the Trainer)."
            )
        # a weak reference: the parameters' hooks hold this state, and a cycle through the DDP model would keep it
        # (and its gloo group) alive until a later garbage collection, possibly past destroy_process_group
        self._ddp = weakref.ref(ddp_model)
        self._params = params
        for p in params.values():
            p.register_post_accumulate_grad_hook(self._on_grad)


def embrace_dense_hook(state: EmbRaceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook for the dense parameters: torch's averaged all-reduce, counted in the EmbRace step."""
    state._queue_end()
    state.stats.add(bucket.buffer())
    return allreduce_hook(state.process_group, bucket)


def embrace_step_bytes(
    dense_bucket_numels: list[int], max_rows: int, dim: int, world: int, element_size: int = 4
) -> int:
    """Bytes per sparse ``allgather`` step: dense buckets, the count, and ``max_rows`` (index, row) pairs."""
    return sum(n * element_size for n in dense_bucket_numels) + 8 + max_rows * (8 + dim * element_size)
