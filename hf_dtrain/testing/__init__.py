"""Helpers shared by the tests and the benchmarks: tiny models, byte counting, subprocess runners."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from contextlib import contextmanager

import torch

from hf_dtrain.models import build_llama


def tiny_llama(seed: int = 0, **overrides):
    """The "test" preset LLaMA (2 layers, hidden 64, vocab 128): a few milliseconds per step on CPU."""
    return build_llama("test", seed=seed, **overrides)


def random_batch(batch: int = 2, seq: int = 16, vocab: int = 128, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class SavedTensorCounter:
    """Counts the bytes autograd saves for backward, as unique storages (``saved_tensors_hooks``).

    ``exclude`` takes tensors (for example parameters) whose storages are not activations and should not count.
    """

    def __init__(self, exclude=()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._storages: dict[int, int] = {}

    def _pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self._exclude:
            self._storages[ptr] = max(self._storages.get(ptr, 0), st.nbytes())
        return t

    @staticmethod
    def _unpack(t):
        return t

    @property
    def nbytes(self) -> int:
        return sum(self._storages.values())

    @contextmanager
    def __call__(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_python(code: str, timeout: float = 300, env: dict | None = None, cwd: str | None = None) -> str:
    """Run ``code`` in a fresh Python process; return stdout, raise with stderr on failure or timeout."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd
    )
    if proc.returncode != 0:
        raise RuntimeError(f"subprocess failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc.stdout
