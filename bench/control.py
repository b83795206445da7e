"""The baselines' control channel: length-prefixed JSON over a TCP socket.

One request, one response, like the control RPC an engine exposes to its
trainer. Plain sockets are cheaper than gRPC, so this favours the baselines.
No pickle crosses the process boundary.
"""

from __future__ import annotations

import json
import socket
import struct

_LEN = struct.Struct("<I")


def send(sock: socket.socket, message: dict) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(body)) + body)


def _exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("control peer closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv(sock: socket.socket) -> dict:
    (length,) = _LEN.unpack(_exact(sock, _LEN.size))
    message = json.loads(_exact(sock, length))
    if not isinstance(message, dict):
        raise ValueError("control message is not an object")
    return message


def tune(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
