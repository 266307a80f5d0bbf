"""The snapshot processes' wire: peer connections send small messages at once, and slot ranges sent by the kernel
arrive as one message."""

import socket
import tempfile
import threading
from multiprocessing.connection import Listener

from hf_dtrain.fault.wire import authenticate, connect, no_delay, recv_array, send_ranges


def test_peer_connections_send_small_messages_without_delay():
    """A request after the handshake is not held back for a delayed ACK (40 ms per peer call without it); byte
    ranges of a file sent with ``sendfile`` arrive as one message, received straight into an array."""
    key = b"k" * 16
    listener = Listener(("127.0.0.1", 0))
    served = {}

    def serve():
        conn = listener.accept()
        no_delay(conn)
        authenticate(conn, key, 5.0)
        served["array"] = recv_array(conn)
        conn.send_bytes(b"ok")
        conn.close()

    t = threading.Thread(target=serve, daemon=True)  # a failed assertion below leaves it, not the run, waiting
    t.start()
    conn = connect(listener.address, key, 5.0)
    sock = socket.socket(fileno=conn.fileno())
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        sock.detach()
    with tempfile.TemporaryFile() as f:
        f.write(bytes(range(256)) * 8)
        f.flush()
        send_ranges(conn, [(f.fileno(), 10, 100), (f.fileno(), 1000, 50)])
    assert conn.recv_bytes() == b"ok"
    t.join(10)
    conn.close()
    listener.close()
    data = bytes(range(256)) * 8
    assert served["array"].tobytes() == data[10:110] + data[1000:1050]
