"""The snapshot processes' wire protocol: ``multiprocessing.connection`` with an ``authkey`` (HMAC challenge both
ways), bytes only (``send_bytes`` / ``recv_bytes``: a JSON header, then raw payloads; never pickle), and descriptors
passed over the Unix socket (``send_handle``). A request is ``{"op": ..., "pid": ...}``; an answer carrying
``"error"`` is a refusal with its reason. ``SMPClient`` is a trainer's connection to its node's snapshot process.

Imports only the standard library and xxhash (the snapshot process imports it by path, without torch)."""

from __future__ import annotations

import json
import os
import threading
import time
from multiprocessing.connection import Client, Connection
from multiprocessing.reduction import recv_handle
from typing import Optional


def checksum(buf) -> str:
    """xxh3-64 of ``buf`` (hex): GB/s, so it runs on every snapshot; strong enough to catch corruption."""
    import xxhash

    return xxhash.xxh3_64_hexdigest(memoryview(buf))


def send(conn: Connection, header: dict, payload: Optional[bytes] = None) -> None:
    conn.send_bytes(json.dumps(header).encode())
    if payload is not None:
        conn.send_bytes(payload)


def recv(conn: Connection) -> dict:
    return json.loads(conn.recv_bytes())


def connect(address, key: bytes, timeout: float) -> Connection:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Client(address, family="AF_UNIX" if isinstance(address, str) else "AF_INET", authkey=key)
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise


class SMPClient:
    """A trainer's connection to its node's SMP."""

    def __init__(self, directory: str, key: bytes, timeout: float = 30.0):
        self.dir, self.key, self.timeout = directory, key, timeout
        self.conn = connect(os.path.join(directory, "smp.sock"), key, timeout)
        self.lock = threading.Lock()

    def call(self, header: dict, want_fd: bool = False):
        with self.lock:
            send(self.conn, dict(header, pid=os.getpid()))
            if not self.conn.poll(self.timeout):
                raise TimeoutError(f"the snapshot process in {self.dir} did not answer {header['op']} in "
                                   f"{self.timeout:.0f} s")
            reply = recv(self.conn)
            if "error" in reply:
                return reply, None
            fd = recv_handle(self.conn) if want_fd else None
            return reply, fd

    def info(self) -> dict:
        with open(os.path.join(self.dir, "smp.json")) as f:
            return json.load(f)

    def close(self) -> None:
        self.conn.close()
