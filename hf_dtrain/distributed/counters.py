"""Byte and memory counters: what a rank hands to collectives (:class:`WireStats`) and what autograd saves
for backward (:class:`SavedTensorCounter`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


@dataclass
class WireStats:
    """Bytes this rank hands to collectives, per optimizer step.

    Counted as the payload of each collective call (``numel * element_size`` of the tensor this rank contributes),
    the same way for every method and for the dense baseline, so ratios between methods are exact. (A ring all-reduce
    moves ``2 (N - 1) / N`` times its payload over each link; that factor is common to all all-reduce methods.)
    """

    steps: list[int] = field(default_factory=list)  # payload bytes of every finished step
    current: int = 0
    collectives: int = 0  # collective calls in the current step

    def add(self, tensor: torch.Tensor) -> None:
        self.add_bytes(tensor.numel() * tensor.element_size())

    def add_bytes(self, nbytes: int) -> None:
        self.current += int(nbytes)
        self.collectives += 1

    def end_step(self) -> None:
        self.steps.append(self.current)
        self.current = 0
        self.collectives = 0

    @property
    def last_step_bytes(self) -> int | None:
        return self.steps[-1] if self.steps else None

    def summary(self) -> dict:
        """``{steps, bytes_per_step_mean, bytes_last_step}``: what the jobs report."""
        steps = list(self.steps)
        return {
            "steps": len(steps),
            "bytes_per_step_mean": sum(steps) / max(1, len(steps)),
            "bytes_last_step": steps[-1] if steps else None,
        }


def wire_summary(*owners) -> dict | None:
    """The :meth:`WireStats.summary` of the first of ``owners`` (a hook's state, an optimizer) that counts its
    bytes (``.stats``), or None."""
    for owner in owners:
        stats = getattr(owner, "stats", None)
        if stats is not None:
            return stats.summary()
    return None


class SavedTensorCounter:
    """Counts the bytes autograd saves for backward, as unique storages (``saved_tensors_hooks``).

    ``exclude`` takes tensors (for example parameters) whose storages are not activations and should not count.
    ``tag``: a callable naming where a tensor is saved (the module running, for a step profile); ``by_tag`` then
    splits the bytes by the tag under which each storage was first saved.
    """

    def __init__(self, exclude=(), tag=None):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._storages: dict[int, int] = {}
        self._tag = tag
        self._tags: dict[int, str] = {}

    def _pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self._exclude:
            self._storages[ptr] = max(self._storages.get(ptr, 0), st.nbytes())
            if self._tag is not None and ptr not in self._tags:
                self._tags[ptr] = self._tag()
        return t

    @property
    def by_tag(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for ptr, nbytes in self._storages.items():
            key = self._tags.get(ptr, "other")
            out[key] = out.get(key, 0) + nbytes
        return out

    @staticmethod
    def _unpack(t):
        return t

    @property
    def nbytes(self) -> int:
        return sum(self._storages.values())

    @contextlib.contextmanager
    def __call__(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self
