"""Optimus-style 2D tensor parallelism for LLaMA-family models on a q x q ``DeviceMesh`` (``row``, ``col``), on
DTensor.

Optimus (Xu et al., 2021) partitions every weight in q x q blocks and every activation in q x q blocks, so no rank
holds a redundant activation, and multiplies with SUMMA. Here, with torch's engine:

* every activation between (and inside) the blocks is ``[batch / q, seq, hidden / q]``: the batch over ``row``,
  the hidden (attention heads, MLP rows) over ``col``; attention itself is local (whole sequences, local heads);
* every projection weight ``[out, in]`` is stored in q x q blocks (out over ``row``, in over ``col``); a forward
  all-gathers it over ``row`` (``[out, in / q]``), multiplies locally and reduce-scatters the partial sums over
  ``col`` onto the output's hidden shards. Its backward is the transpose: an all-gather of the output gradient over
  ``col``, and the weight gradient reduce-scattered over ``row``. All of it is DTensor ``redistribute``;
* the norms' statistics are reduced over ``col`` (a ``[batch / q, seq, 1]`` all-reduce); the embedding is sharded
  over the hidden dim (its lookup needs no communication); the logits are gathered over ``col`` for the loss (the
  head's ``[batch / q, seq, vocab]`` is the one activation held q times).

Where it differs from Optimus's SUMMA: SUMMA broadcasts one block of the weight and one block of the activation at
a time (q steps, each a row broadcast and a column broadcast, so a rank holds 3 blocks at once). DTensor has no
broadcast-pipelined matmul; it moves the weight over ``row`` in one all-gather (a rank holds ``out x in / q`` for
the duration of the product, q times a SUMMA block) and the output's partial sums over ``col`` in one
reduce-scatter, instead of broadcasting activation blocks. Bytes on the wire per rank and product are
``(q - 1) / q x (out x in / q + tokens / q x out)``; SUMMA's are ``(q - 1) x (tokens x in + in x out) / q^2``. The
benchmark (benchmarks/parallel.py) measures both the activation bytes and the wire bytes against 1D TP and TP+SP.

Gradients are exact: a 4-rank test compares every loss and gradient with one process (tests/parallel).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from hf_dtrain.errors import SettingsError

LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def check_2d(model_config, q: int, batch_size: int) -> None:
    """Refuse a q the model or the batch cannot be split by, naming the dim."""
    dims = {
        "num_attention_heads": model_config.num_attention_heads,
        "num_key_value_heads": getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads,
        "hidden_size": model_config.hidden_size,
        "intermediate_size": model_config.intermediate_size,
        "vocab_size": model_config.vocab_size,
        "batch size": batch_size,
    }
    for name, value in dims.items():
        if value % q:
            raise SettingsError(
                f"2D tensor parallelism on a {q} x {q} mesh splits the {name} ({value}) {q} ways; choose q dividing it."
            )


def _linear_forward(self, x):
    """x: local [b / q, s, in / q] -> local [b / q, s, out / q]."""
    mesh = self.weight.device_mesh
    w = self.weight.redistribute(mesh, [Replicate(), Shard(1)])  # all-gather over row: [out, in / q]
    xd = DTensor.from_local(x, mesh, [Shard(0), Shard(x.dim() - 1)], run_check=False)
    y = F.linear(xd, w)  # [b / q, s, out] partial sums over col
    return y.redistribute(mesh, [Shard(0), Shard(x.dim() - 1)]).to_local()


def _norm_forward(self, x):
    """RMSNorm of local [b / q, s, h / q]: the sum of squares all-reduced over col."""
    mesh = self.weight.device_mesh
    xd = DTensor.from_local(x, mesh, [Shard(0), Shard(x.dim() - 1)], run_check=False)
    dtype = x.dtype
    h = xd.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + self.variance_epsilon)
    return (self.weight * h.to(dtype)).to_local()


def _embed_forward(self, ids):
    """ids: this row's batch shard -> local [b / q, s, h / q] (the weight's hidden shard; no communication)."""
    from torch.distributed.tensor import Partial

    w = self.weight.to_local(grad_placements=[Partial(), Shard(1)])  # row ranks see other batches: sum their grads
    return F.embedding(ids, w, self.padding_idx)


def _head_forward(self, x):
    """The head on local [b / q, s, h / q] -> the logits of this row's batch shard, gathered over col."""
    y = _linear_forward(self, x)
    mesh = self.weight.device_mesh
    return (
        DTensor.from_local(y, mesh, [Shard(0), Shard(y.dim() - 1)], run_check=False)
        .redistribute(mesh, [Shard(0), Replicate()])
        .to_local()
    )


def apply_2d_tensor_parallel(model: nn.Module, mesh) -> nn.Module:
    """Lay a LLaMA-family causal LM out on the 2D ``mesh`` (``row`` x ``col``, q x q) in place, Optimus-style (see
    the module docstring). Each rank then takes its row's batch shard: ``model(input_ids=ids[row_shard], ...)``;
    the loss it returns is its shard's; :func:`optimus_loss_scale` makes their gradients sum to the batch mean's."""
    from torch.distributed.tensor import distribute_tensor

    if mesh.ndim != 2 or mesh.size(0) != mesh.size(1):
        raise SettingsError(f"2D tensor parallelism takes a q x q mesh (row, col), got {tuple(mesh.shape)}.")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(model, "peft_config"):
        raise SettingsError(
            "2D tensor parallelism is built for full models; peft adapters are not laid out on the "
            "q x q mesh (use apply_tensor_parallel, which shards LoRA and LoRA-FA)."
        )
    decoder = base.model
    if getattr(base.config, "tie_word_embeddings", False):
        raise SettingsError("2D tensor parallelism: untie lm_head from the embedding (tie_word_embeddings=False).")

    def place(module, placements, forward):
        w = module.weight
        module.weight = nn.Parameter(distribute_tensor(w.data, mesh, placements), requires_grad=w.requires_grad)
        module.forward = types.MethodType(forward, module)

    for layer in decoder.layers:
        for name in LINEARS:
            module = layer.get_submodule(name)
            if module.bias is not None:
                raise SettingsError(f"2D tensor parallelism: {name} has a bias, which this layout does not place.")
            place(module, [Shard(0), Shard(1)], _linear_forward)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            place(norm, [Replicate(), Shard(0)], _norm_forward)
    place(decoder.norm, [Replicate(), Shard(0)], _norm_forward)
    place(decoder.embed_tokens, [Replicate(), Shard(1)], _embed_forward)
    place(base.lm_head, [Shard(0), Shard(1)], _head_forward)
    model._hf_dtrain_2d = mesh
    return model


def optimus_loss_scale(model: nn.Module) -> float:
    """The factor each rank's loss (its row's batch shard) is multiplied by before backward: 1 / q, so the row
    ranks' summed gradients are the whole batch's mean loss gradient."""
    mesh = getattr(model, "_hf_dtrain_2d", None)
    return 1.0 if mesh is None else 1.0 / mesh.size(0)
