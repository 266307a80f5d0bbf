"""Parrot's client state manager: what a stateful algorithm keeps for each client between the rounds it takes part
in (SCAFFOLD's control variate, the uplink's error-feedback residual, the optimizer state when kept, the position in
the client's data), on disk in safetensors (no pickle), in an owner-only directory, one file per client."""

from __future__ import annotations

import json
import os
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


class ClientStateStore:
    """``load(client)`` / ``save(client, tensors, meta)``: tensors by name plus a small JSON-able ``meta``."""

    def __init__(self, directory: str | None = None) -> None:
        if directory is None:
            directory = tempfile.mkdtemp(prefix="hf_dtrain_clients_")  # mkdtemp: mode 0700
        os.makedirs(directory, mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)
        self.directory = directory

    def _path(self, client: int) -> str:
        return os.path.join(self.directory, f"client_{client:06d}.safetensors")

    def load(self, client: int) -> tuple[dict[str, torch.Tensor], dict]:
        path = self._path(client)
        if not os.path.exists(path):
            return {}, {}

        with safe_open(path, framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("hf_dtrain", "{}"))
        return load_file(path), meta

    def save(self, client: int, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        path = self._path(client)
        tmp = path + ".tmp"
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
            tmp,
            metadata={"hf_dtrain": json.dumps(meta)},
        )
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
