"""The fused operators: one module computes the same layer of K jobs at once (HFTA's operator fusion).

Every fused module takes the K jobs' activations stacked job-major along the batch: a tensor whose leading dims
flatten to ``K * n`` rows, rows ``[k*n, (k+1)*n)`` belonging to job ``k``. Views to ``(K, n, features)`` then make each
job's product one slice of a batched matmul (``torch.bmm``), so a step launches one kernel per layer, not K.

* :class:`FusedLowRank`: K low-rank adapters on one shared frozen base layer (LoRA, LoRA-FA, Q-BaRA). The base runs
  once on all K*n rows; each job's adapter ``s_k * B_k A_k`` acts on its own rows. Jobs of different ranks are padded
  to the largest rank with zero rows of A and zero columns of B: those entries get exactly zero gradient and stay
  zero under AdamW, so each job computes what it would alone.
* :class:`FusedBlockSparse`: K SMT adapters (each job its own block selection). The K jobs' delta matrices are one
  block-diagonal block-sparse matrix over the jobs' concatenated features, run by the method's own block product
  (SMT's ``BlockSparseDelta``, handed over by its registered fused form).
* :class:`FusedLinear`, :class:`FusedEmbedding`, :class:`FusedRMSNorm`: K full copies of a model's layers (stacked
  weights ``[K, ...]``), for fused full fine-tuning and pretraining sweeps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _per_job(x: torch.Tensor, num_jobs: int) -> torch.Tensor:
    """``(K*n, ..., f)`` -> ``(K, n*..., f)`` (a view when contiguous)."""
    return x.reshape(num_jobs, -1, x.shape[-1])


class FusedLowRank(nn.Module):
    """``y = base(x) + s_k * repeat_p(B_k A_k pool_p(dropout_k(x)))`` for the rows of job ``k``.

    ``A``: ``(K, R, in/p)``, ``B``: ``(K, out/p, R)``; ``pool`` p > 1 is Q-BaRA's average pooling of the input and
    repetition of the output (LoRA and LoRA-FA: p = 1). ``a_trainable=False`` keeps A a buffer (LoRA-FA).
    """

    def __init__(
        self,
        base_layer: nn.Module,
        a: torch.Tensor,
        b: torch.Tensor,
        scaling,
        dropout=None,
        pool: int = 1,
        a_trainable: bool = True,
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.num_jobs = a.shape[0]
        if a_trainable:
            self.lora_A = nn.Parameter(a)
        else:
            self.register_buffer("lora_A", a)
        self.lora_B = nn.Parameter(b)
        self.register_buffer("scaling", torch.as_tensor(scaling, dtype=b.dtype, device=b.device).view(-1, 1, 1))
        p = torch.as_tensor(dropout if dropout is not None else [0.0] * self.num_jobs, dtype=torch.float32)
        self.register_buffer("keep", (1.0 - p).view(-1, 1, 1), persistent=False)
        self.has_dropout = bool((p > 0).any())
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        a, b = self.lora_A, self.lora_B
        h = _per_job(x, self.num_jobs).to(a.dtype)
        if self.has_dropout and self.training:
            keep = self.keep.to(h.dtype)
            h = h * (torch.rand_like(h) < keep) / keep
        if self.pool > 1:  # Q-BaRA's pooling and repeat folded into the factors, as its own layer does
            a = a.repeat_interleave(self.pool, dim=2) / self.pool
            b = b.repeat_interleave(self.pool, dim=1)
        d = torch.bmm(torch.bmm(h, a.transpose(1, 2)).to(b.dtype), b.transpose(1, 2)) * self.scaling
        return (out + d.reshape(out.shape)).to(out.dtype)  # summed in the wider dtype, as peft's layers do


class FusedBlockSparse(nn.Module):
    """K jobs' SMT deltas on one shared frozen base layer: ``y = base(x) + D_k x`` for the rows of job ``k``.

    ``blocks``: ``(K, m, bs, bs)`` with ``m`` the largest block count of a job; ``indices[k]`` is job ``k``'s
    ``(count_k, 2)`` block positions (rows sorted as SMT sorts them). Padding blocks are never read (a gather picks
    the real ones), so their gradient is zero.
    """

    def __init__(
        self,
        base_layer: nn.Module,
        blocks: torch.Tensor,
        indices: list[torch.Tensor],
        in_features: int,
        out_features: int,
        delta,
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.delta = delta  # the block-sparse product (the method's own: SMT's BlockSparseDelta.apply)
        self.num_jobs, m, bs = blocks.shape[0], blocks.shape[1], blocks.shape[-1]
        self.smt_weight = nn.Parameter(blocks)
        self.in_features, self.out_features, self.block_size = in_features, out_features, bs
        rows, cols, pick = [], [], []
        for k, idx in enumerate(indices):
            idx = idx.to(torch.long).reshape(-1, 2)
            rows.append(idx[:, 0] + k * (out_features // bs))
            cols.append(idx[:, 1] + k * (in_features // bs))
            pick.append(torch.arange(len(idx)) + k * m)
        self.counts = [len(i) for i in indices]
        dev = blocks.device
        self.register_buffer("rows", torch.cat(rows).to(dev), persistent=False)
        self.register_buffer("cols", torch.cat(cols).to(dev), persistent=False)
        self.register_buffer("pick", torch.cat(pick).to(dev), persistent=False)
        ucols, pos = torch.unique(self.cols, return_inverse=True)
        self.register_buffer("ucols", ucols, persistent=False)
        self.register_buffer("pos", pos, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        if self.pick.numel() == 0:
            return out
        k, bs = self.num_jobs, self.block_size
        xs = _per_job(x, k)  # (K, n, in)
        n = xs.shape[1]
        x_cat = xs.transpose(0, 1).reshape(n, k * self.in_features)  # each row: the K jobs' features side by side
        blocks = self.smt_weight.reshape(-1, bs, bs).index_select(0, self.pick)
        d = self.delta(x_cat, blocks, self.rows, self.cols, k * self.out_features, (self.ucols, self.pos))
        d = d.view(n, k, self.out_features).transpose(0, 1)
        return (out + d.reshape(out.shape)).to(out.dtype)


class FusedLinear(nn.Module):
    """K ``nn.Linear`` layers: ``weight (K, out, in)``, ``bias (K, out)`` or None."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.num_jobs = weight.shape[0]
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = _per_job(x, self.num_jobs)
        w = self.weight.transpose(1, 2)
        y = torch.bmm(xs, w) if self.bias is None else torch.baddbmm(self.bias.unsqueeze(1), xs, w)
        return y.reshape(*x.shape[:-1], self.weight.shape[1])


class FusedEmbedding(nn.Module):
    """K ``nn.Embedding`` tables ``(K, V, H)``: job ``k``'s ids look up in table ``k`` (one lookup with offsets).
    ``padding_idx`` rows get no gradient, as in ``nn.Embedding``."""

    def __init__(self, weight: torch.Tensor, padding_idx: int | None = None) -> None:
        super().__init__()
        self.num_jobs, self.num_embeddings = weight.shape[0], weight.shape[1]
        self.weight = nn.Parameter(weight)
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        k, v = self.num_jobs, self.num_embeddings
        ids_k = ids.reshape(k, -1)
        offsets = torch.arange(k, device=ids.device).unsqueeze(1) * v
        emb = F.embedding(ids_k + offsets, self.weight.reshape(k * v, -1))
        if self.padding_idx is not None:
            emb = torch.where((ids_k == self.padding_idx).unsqueeze(-1), emb.detach(), emb)
        return emb.reshape(*ids.shape, -1)


class FusedRMSNorm(nn.Module):
    """K LLaMA RMSNorms (weights ``(K, H)``), computed as ``LlamaRMSNorm`` computes one."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.num_jobs = weight.shape[0]
        self.weight = nn.Parameter(weight)
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = (h * torch.rsqrt(variance + self.variance_epsilon)).to(input_dtype)
        y = self.weight.unsqueeze(1) * _per_job(h, self.num_jobs)
        return y.reshape(hidden_states.shape)
