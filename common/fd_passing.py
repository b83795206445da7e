"""File descriptors between local processes (SCM_RIGHTS over a unix socket).

Used for the worker->server fd channel (store arenas) and the local hand-off
to engines and same-host trainers. Descriptors go in batches, because the
kernel accepts at most 253 in one message.
"""

from __future__ import annotations

import socket

MAX_FDS_PER_MESSAGE = 250


def send_fds(sock: socket.socket, fds: list[int], tag: bytes = b"F") -> None:
    """Send every descriptor, in order, in as many messages as needed."""
    for start in range(0, len(fds), MAX_FDS_PER_MESSAGE):
        socket.send_fds(sock, [tag], fds[start : start + MAX_FDS_PER_MESSAGE])


def recv_fds(sock: socket.socket, count: int, tag: bytes = b"F") -> list[int]:
    """Receive exactly `count` descriptors sent by send_fds (blocking, or within the socket's timeout)."""
    received: list[int] = []
    while len(received) < count:
        data, fds, _flags, _address = socket.recv_fds(sock, len(tag), MAX_FDS_PER_MESSAGE)
        received.extend(fds)
        if data != tag:
            for fd in received:
                _close_quietly(fd)
            raise ConnectionError(f"unexpected message on the fd channel ({data[:8]!r})")
    return received


def _close_quietly(fd: int) -> None:
    import os

    try:
        os.close(fd)
    except OSError:
        pass


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a unix socket (SO_PEERCRED)."""
    import struct

    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid
