"""Split fine-tuning between an edge and a cloud: the model cut after decoder layer ``cut_layer``.

The edge process holds the embedding and layers ``[0, cut_layer)`` (with their adapters) and the private data; the
cloud process holds the rest of the layers, the final norm and the head. Each step the edge sends the cut's
activations (and the labels), the cloud computes the loss and sends back the activations' gradient, and each side
steps its own optimizer on its own adapters. The link carries ``torch.distributed`` point-to-point messages (gloo or
NCCL; across hosts, any network the process group reaches).

The activations ``h`` (``B x T x H``, as a ``BT x H`` matrix) and their gradient may be compressed by a rank-``r``
decomposition (truncated SVD: ``U_r S_r`` and ``V_r^T``, ``r (BT + H)`` values instead of ``BT H``); with
``error_feedback`` the gradient's truncation error is added to the next step's gradient (activations change every
step, so their error is not carried). At full rank (``rank=None``) nothing is lost and split training equals
unsplit training (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_dtrain.distributed.counters import WireStats
from hf_dtrain.errors import SettingsError
from hf_dtrain.models import LlamaPipelineStage
from hf_dtrain.settings import check_fields, setting


@dataclass
class SplitConfig:
    """Where the model is cut and how the link is compressed."""

    cut_layer: int = setting(1, "The edge runs decoder layers [0, cut_layer).", min=1)
    rank: int | None = setting(
        None, "Rank of the activations and gradients sent over the link; None: uncompressed.", min=1
    )
    error_feedback: bool = setting(True, "Carry the gradient's truncation error into the next step (compressed links).")

    def __post_init__(self):
        check_fields(self)

    def check(self, causal_lm) -> None:
        layers = causal_lm.config.num_hidden_layers
        if not 1 <= self.cut_layer < layers:
            raise SettingsError(
                f"SplitConfig.cut_layer={self.cut_layer} is outside the model: it has {layers} decoder "
                f"layers, so the cut must be in 1..{layers - 1} (the edge keeps at least one layer, the "
                "cloud at least one)."
            )


def _lowrank(m: torch.Tensor, rank: int | None) -> list[torch.Tensor]:
    """What goes on the wire for matrix ``m`` at ``rank`` (None or >= min(shape): ``m`` itself)."""
    if rank is None or rank >= min(m.shape):
        return [m.contiguous()]
    u, s, vh = torch.linalg.svd(m.float(), full_matrices=False)
    return [(u[:, :rank] * s[:rank]).contiguous(), vh[:rank].contiguous()]


def _send(tensors: list[torch.Tensor], peer: int, group=None, stats: WireStats | None = None) -> None:
    """``tensors`` to ``peer``: a shape header, then each tensor; ``stats`` counts the tensors' payload bytes."""
    head = torch.tensor([len(tensors)] + [d for t in tensors for d in (t.dim(), *t.shape)], dtype=torch.long)
    dist.send(torch.tensor([head.numel()], dtype=torch.long), peer, group=group)
    dist.send(head, peer, group=group)
    for t in tensors:
        dist.send(t.detach().contiguous(), peer, group=group)
        if stats is not None:
            stats.add(t)


def _recv(peer: int, dtype=torch.float32, group=None, stats: WireStats | None = None) -> list[torch.Tensor]:
    n = torch.empty(1, dtype=torch.long)
    dist.recv(n, peer, group=group)
    head = torch.empty(int(n), dtype=torch.long)
    dist.recv(head, peer, group=group)
    vals, out, pos = head.tolist(), [], 1
    for _ in range(vals[0]):
        ndim = vals[pos]
        shape = vals[pos + 1 : pos + 1 + ndim]
        pos += 1 + ndim
        t = torch.empty(shape, dtype=dtype)
        dist.recv(t, peer, group=group)
        if stats is not None:
            stats.add(t)
        out.append(t)
    return out


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else parts[0] @ parts[1]


class _Side:
    """What both sides share: their trainable parameters and the link's byte counts (``sent``, ``received``)."""

    stage: torch.nn.Module
    sent: WireStats
    received: WireStats

    def parameters(self):
        return [p for p in self.stage.parameters() if p.requires_grad]

    @property
    def bytes_sent(self) -> int:
        """Payload bytes sent over the link in training steps (evaluation not counted)."""
        return sum(self.sent.steps) + self.sent.current

    @property
    def bytes_received(self) -> int:
        return sum(self.received.steps) + self.received.current


class SplitEdge(_Side):
    """The edge side: embedding + layers ``[0, cut)`` of ``causal_lm`` (a transformers causal LM, possibly inside a
    peft model: pass ``peft_model.get_base_model()``). :meth:`step` runs one training step's edge half."""

    def __init__(self, causal_lm, config: SplitConfig, peer: int = 1, group=None) -> None:
        config.check(causal_lm)
        self.cfg, self.peer, self.group = config, peer, group
        self.stage = LlamaPipelineStage(causal_lm, 0, config.cut_layer, first=True, last=False)
        self.sent, self.received = WireStats(), WireStats()

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> None:
        """Forward to the cut, send the activations and labels, receive the activations' gradient, backward (the
        caller steps its optimizer on :meth:`parameters`)."""
        h = self.stage(input_ids)
        b, t, d = h.shape
        _send(_lowrank(h.detach().reshape(b * t, d), self.cfg.rank), self.peer, self.group, self.sent)
        _send([labels.to(torch.float32)], self.peer, self.group, self.sent)  # small ints, exact in fp32
        grad_parts = _recv(self.peer, group=self.group, stats=self.received)
        h.backward(_join(grad_parts).reshape(b, t, d).to(h.dtype))

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor) -> None:
        """Send one evaluation batch's activations (compressed as in training) and labels; nothing comes back."""
        h = self.stage(input_ids)
        b, t, d = h.shape
        _send(_lowrank(h.reshape(b * t, d), self.cfg.rank), self.peer, self.group)
        _send([labels.to(torch.float32)], self.peer, self.group)


class SplitCloud(_Side):
    """The cloud side: layers ``[cut, L)``, the final norm and the head; :meth:`step` runs one step's cloud half and
    returns the loss."""

    def __init__(self, causal_lm, config: SplitConfig, peer: int = 0, group=None) -> None:
        config.check(causal_lm)
        self.cfg, self.peer, self.group = config, peer, group
        self.causal_lm = causal_lm
        layers = causal_lm.config.num_hidden_layers
        self.stage = LlamaPipelineStage(causal_lm, config.cut_layer, layers, first=False, last=True)
        self.residual = None
        self.sent, self.received = WireStats(), WireStats()

    def step(self) -> float:
        parts = _recv(self.peer, group=self.group, stats=self.received)
        labels = _recv(self.peer, group=self.group, stats=self.received)[0].long()
        b, t = labels.shape
        h = _join(parts).reshape(b, t, -1).requires_grad_(True)
        logits = self.stage(h)
        loss = self.causal_lm.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1])
        loss.backward()
        g = h.grad.reshape(b * t, -1)
        if (
            self.cfg.rank is not None
            and self.cfg.error_feedback
            and self.residual is not None
            and self.residual.shape == g.shape
        ):
            g = g + self.residual
        grad_parts = _lowrank(g, self.cfg.rank)
        if self.cfg.rank is not None and self.cfg.error_feedback:
            self.residual = g - _join(grad_parts)
        _send(grad_parts, self.peer, self.group, self.sent)
        return float(loss.detach())

    @torch.no_grad()
    def evaluate(self) -> tuple[float, int]:
        """One evaluation batch from the edge: ``(loss, rows)``."""
        parts = _recv(self.peer, group=self.group)
        labels = _recv(self.peer, group=self.group)[0].long()
        b, t = labels.shape
        logits = self.stage(_join(parts).reshape(b, t, -1))
        return float(self.causal_lm.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1])), b
