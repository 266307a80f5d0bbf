"""The snapshot processes' wire protocol: ``multiprocessing.connection`` with an ``authkey`` (HMAC challenge both
ways), bytes only (``send_bytes`` / ``recv_bytes``: a JSON header, then raw payloads; never pickle), and descriptors
passed over the Unix socket (``send_handle``). A request is ``{"op": ..., "pid": ...}``; an answer carrying
``"error"`` is a refusal with its reason. ``SMPClient`` is a trainer's connection to its node's snapshot process.

Imports only the standard library, xxhash and (for ``recv_array``) numpy: the snapshot process imports it by path,
without torch."""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
import tempfile
import threading
import time
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from multiprocessing.reduction import recv_handle

import numpy as np
import xxhash


def checksum(buf) -> str:
    """xxh3-64 of ``buf`` (hex): GB/s, so it runs on every snapshot; strong enough to catch corruption."""
    return xxhash.xxh3_64_hexdigest(memoryview(buf))


def send(conn: Connection, header: dict, payload: bytes | None = None) -> None:
    conn.send_bytes(json.dumps(header).encode())
    if payload is not None:
        conn.send_bytes(payload)


def recv(conn: Connection) -> dict:
    return json.loads(conn.recv_bytes())


def _frame_header(n: int) -> bytes:
    # multiprocessing.connection's framing: a signed 4-byte length, or -1 and an 8-byte length
    return struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise EOFError("the peer closed the connection mid-message")
        got += n


def send_ranges(conn: Connection, ranges: list) -> None:
    """One message (as ``conn.send_bytes`` frames it) made of byte ranges of files, ``[(fd, offset, count)]``,
    sent by the kernel (``os.sendfile``): a snapshot slot goes to a peer with no copy in this process."""
    total = sum(count for _, _, count in ranges)
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        sock.sendall(_frame_header(total))
        for fd, offset, count in ranges:
            while count:
                sent = os.sendfile(sock.fileno(), fd, offset, count)
                if not sent:
                    raise EOFError("a snapshot slot ended before the range sent from it")
                offset, count = offset + sent, count - sent
    finally:
        sock.close()  # the duplicate descriptor only


def recv_array(conn: Connection):
    """One message (framed by ``conn.send_bytes``) received straight into a fresh uint8 NumPy array: no
    intermediate buffer (``recv_bytes`` grows one in Python, several times slower for megabytes)."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        head = bytearray(4)
        _recv_exact(sock, memoryview(head))
        (n,) = struct.unpack("!i", head)
        if n == -1:
            head = bytearray(8)
            _recv_exact(sock, memoryview(head))
            (n,) = struct.unpack("!Q", head)
        out = np.empty(n, dtype=np.uint8)
        _recv_exact(sock, memoryview(out))
        return out
    finally:
        sock.close()


def private_dir(path: str) -> str:
    """Create ``path`` (and missing parents) owner-only (0700) and verify it: a real directory (not a symlink), owned
    by this user, no access for group or others (one of ours that others could only read is tightened to 0700). A
    directory another user created first, or one others could write into, is a ``PermissionError`` naming the path
    and the fix (nothing is written into it)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        owner = "a symlink" if stat.S_ISLNK(st.st_mode) else f"owned by uid {st.st_uid}"
        raise PermissionError(
            f"{path} is {owner}, not a private directory of uid {os.getuid()}: another user may "
            "have created it to intercept or deny the snapshot service. Remove it, or set "
            "fault_tolerance.directory to a directory of your own."
        )
    if st.st_mode & 0o077 and not st.st_mode & 0o022:  # ours, readable by others, writable by none: tighten it
        os.chmod(path, 0o700)
    elif st.st_mode & 0o077:  # others could have written into it: nothing in it can be trusted
        raise PermissionError(
            f"{path} has mode {oct(st.st_mode & 0o7777)}: other users can write into it, and the snapshot service "
            "needs a directory only you can reach. Set --fault-tolerance.directory to a new directory, e.g. "
            f"{os.path.join(path, f'hf_dtrain_ft_{os.getuid()}')} (hf_dtrain creates it 0700), or leave it unset "
            "for the per-user default. Do not change the mode of a shared directory such as /tmp."
        )
    return path


def runtime_root() -> str:
    """This user's private root for snapshot processes: ``$XDG_RUNTIME_DIR/hf_dtrain_ft`` when that is set (a
    per-user tmpfs), else ``<tmp>/hf_dtrain_ft_<uid>``; created 0700 and verified (:func:`private_dir`)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK):
        return private_dir(os.path.join(xdg, "hf_dtrain_ft"))
    return private_dir(os.path.join(tempfile.gettempdir(), f"hf_dtrain_ft_{os.getuid()}"))


def authenticate(conn: Connection, key: bytes, deadline: float) -> None:
    """The HMAC challenge both ways (``multiprocessing``'s own), bounded by ``deadline`` seconds: a peer that
    connects and sends nothing is dropped after it, and (run in the connection's own thread) never delays others."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        timeval = struct.pack("ll", int(deadline), int((deadline % 1) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        deliver_challenge(conn, key)
        answer_challenge(conn, key)
        zero = struct.pack("ll", 0, 0)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, zero)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, zero)
    finally:
        sock.close()  # the duplicate descriptor only; the options belong to the socket and were reset above


def no_delay(conn: Connection) -> Connection:
    """A TCP connection's small messages sent at once: without ``TCP_NODELAY`` a request written after the
    handshake waits for the delayed ACK of the last one (about 40 ms on Linux, every peer call)."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.close()  # the duplicate descriptor only; the option belongs to the socket
    return conn


def connect(address, key: bytes, timeout: float) -> Connection:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if isinstance(address, str):
                return Client(address, family="AF_UNIX", authkey=key)
            # the handshake itself is four small messages: no delay from the first one
            sock = socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic()))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(None)
            conn = Connection(sock.detach())
            try:
                answer_challenge(conn, key)
                deliver_challenge(conn, key)
            except BaseException:
                conn.close()
                raise
            return conn
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
                raise TimeoutError(
                    f"the snapshot process in {self.dir} did not answer {header['op']} in {self.timeout:.0f} s"
                )
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
