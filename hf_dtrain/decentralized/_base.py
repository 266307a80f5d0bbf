"""What the decentralized optimizers share: the topology and process group, byte accounting, the flat view of the
parameters that is gossiped, the model's loss (for leader-based methods) and the DDP ``noop`` attachment."""

from __future__ import annotations

import torch
from torch import nn

from hf_dtrain.errors import SettingsError

from ..distributed.counters import WireStats
from ..distributed.engines import WholeReplicaGuard, keep_gradients_local
from ..optimizer_wrapper import closure_loss
from .gossip import AsyncGossip, check_world, consensus_distance, flatten, gossip, require_world, unflatten_into
from .topology import Topology


def resolve_topology(topology: str | Topology, world: int, **kwargs) -> Topology:
    if isinstance(topology, Topology):
        return topology
    if isinstance(topology, str):
        return Topology.named(topology, world, **kwargs)
    raise TypeError(
        f"topology must be a Topology or a name (ring, torus, exponential, fully_connected, matcha), got "
        f"{type(topology).__name__}."
    )


class GossipMixin:
    """Mixed into a ``torch.optim.Optimizer``: ``_init_gossip`` after the parameter groups exist."""

    exchanges_gradients_itself = True  # DDP must not average (noop hook), and a Trainer must not clip local grads

    def _init_gossip(self, topology, process_group=None, model: nn.Module | None = None, **topology_kwargs):
        self._replica_guard = WholeReplicaGuard(self, type(self).__name__)
        self.topology = resolve_topology(topology, require_world(process_group), **topology_kwargs)
        self.rank = check_world(self.topology, process_group)
        self.process_group = process_group
        self.stats = WireStats()
        self.gossip_steps = 0
        self._last_loss: float | None = None
        if model is not None:
            model.register_forward_hook(self._record_loss)

    def _init_async(self, asynchronous: bool, max_staleness: int) -> None:
        """``asynchronous=True``: gossip with :class:`AsyncGossip` (no rank waits for a round; values at most
        ``max_staleness`` of this rank's steps old). Call :meth:`finish` on every rank at the end of training."""
        self.asynchronous = bool(asynchronous)
        self._async = None
        if self.asynchronous:
            numel = sum(p.numel() for p in self._gossiped_params())
            dtype = self._gossiped_params()[0].dtype
            self._async = AsyncGossip(numel, self.topology, self.process_group, max_staleness, self.stats, dtype)

    def _mix(self, flat: torch.Tensor, step: int) -> torch.Tensor:
        """One gossip round: synchronous (every neighbour's value of this step) or asynchronous (the newest)."""
        if self._async is not None:
            return self._async.mix(flat)
        return gossip(flat, self.topology, step, self.process_group, self.stats)

    def finish(self) -> None:
        """End of training (every rank): asynchronous gossip sends its last message and takes the neighbours'; a no-op
        for synchronous gossip."""
        if getattr(self, "_async", None) is not None:
            self._async.close()

    # the loss of the current step, for methods that pick a leader by loss: from a forward hook on the model
    # (HF models return an output with .loss), or given with ``optimizer.set_loss(loss)`` before ``step()``
    def _record_loss(self, module, inputs, output):
        loss = getattr(output, "loss", None)
        if loss is None and torch.is_tensor(output) and output.dim() == 0:
            loss = output
        if loss is not None and torch.is_grad_enabled():
            self._last_loss = loss.detach()

    def set_loss(self, loss) -> None:
        self._last_loss = loss.detach() if torch.is_tensor(loss) else torch.tensor(float(loss))

    def _current_loss(self) -> float:
        if self._last_loss is None:
            raise SettingsError(
                f"{type(self).__name__} picks leaders by the current loss: pass model= (a model whose "
                "forward returns .loss, as transformers models do) or call optimizer.set_loss(loss) "
                "before optimizer.step()."
            )
        return float(self._last_loss)

    def _closure_loss(self, closure):
        """Run ``step(closure)``'s closure with gradients on; its loss is also this step's loss for leader picks."""
        self._replica_guard.check_step(self)
        if closure is None:
            return None
        loss = closure_loss(closure)
        self.set_loss(loss)
        return loss

    # checkpoints of the wrapping optimizers: the step counter (it seeds time-varying graphs) next to the wrapped
    # optimizer's state
    def _wrapper_state(self) -> dict:
        return {"gossip_steps": self.gossip_steps}

    def _load_wrapper_state(self, state: dict) -> None:
        self.gossip_steps = int(state["gossip_steps"])

    def _gossiped_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    def _flat(self) -> torch.Tensor:
        return flatten(self._gossiped_params())

    def _set_flat(self, flat: torch.Tensor) -> None:
        unflatten_into(flat, self._gossiped_params())

    def consensus_distance(self) -> float:
        """``sqrt(mean_i ||x_i - x̄||²)`` of the parameters across ranks (a collective: call on every rank)."""
        return consensus_distance(self._gossiped_params(), self.process_group)

    @staticmethod
    def attach_ddp(ddp_model) -> None:
        """Keep DDP from averaging the gradients (this optimizer gossips the parameters itself): DDP's
        ``noop_hook``, as ``hf_dtrain.comm.register(ddp_model, "noop")``; with the Trainer,
        ``CommHookCallback.attach(trainer, "noop")``."""
        keep_gradients_local(ddp_model)
