"""Framing of the local hand-off socket (weightsync/v1/local.proto).

Each message is a u32 little-endian length and a serialized protobuf message.
Descriptors ride as SCM_RIGHTS on the first bytes of the message that names
them. The server side is asynchronous (asyncio sock_* calls on a non-blocking
socket); the client side (engines, SHM trainers) is a plain blocking socket.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import struct

from weightsync.v1 import local_pb2

LENGTH = struct.Struct("<I")
MAX_FRAME_BYTES = 256 << 20
MAX_FDS = 250


class LocalWireError(ConnectionError):
    """The peer sent something that is not a frame, or went away mid-frame."""


def frame(message) -> bytes:
    payload = message.SerializeToString()
    return LENGTH.pack(len(payload)) + payload


# -- server side (asyncio) ----------------------------------------------------------
async def read_frame(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> bytes | None:
    """One frame's payload; None at a clean end of stream."""
    header = await _read_exactly(loop, conn, LENGTH.size, eof_ok=True)
    if header is None:
        return None
    (length,) = LENGTH.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise LocalWireError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    payload = await _read_exactly(loop, conn, length, eof_ok=False)
    assert payload is not None
    return payload


async def _read_exactly(loop: asyncio.AbstractEventLoop, conn: socket.socket, size: int, *, eof_ok: bool) -> bytes | None:
    chunks, got = [], 0
    while got < size:
        chunk = await loop.sock_recv(conn, size - got)
        if not chunk:
            if eof_ok and got == 0:
                return None
            raise LocalWireError("the peer closed the connection mid-frame")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


async def write_frame(loop: asyncio.AbstractEventLoop, conn: socket.socket, message, fds: list[int] = ()) -> None:
    data = frame(message)
    if fds:
        if len(fds) > MAX_FDS:
            raise LocalWireError(f"{len(fds)} descriptors in one message; at most {MAX_FDS}")
        first = data[:4096]
        while True:
            try:
                sent = conn.sendmsg([first], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))])
                break
            except BlockingIOError:
                await _writable(loop, conn)
        data = data[sent:]
    if data:
        await loop.sock_sendall(conn, data)


async def _writable(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
    ready = loop.create_future()
    loop.add_writer(conn.fileno(), ready.set_result, None)
    try:
        await ready
    finally:
        loop.remove_writer(conn.fileno())


# -- client side (blocking) -------------------------------------------------------------
class LocalConnection:
    """A blocking client of the server's local socket: one request, one response."""

    def __init__(self, path: str, timeout: float = 60.0) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(path)
        except OSError:
            self._sock.close()
            raise

    def request(self, request: local_pb2.LocalRequest) -> tuple[local_pb2.LocalResponse, list[int]]:
        """Send one request; the response and the descriptors that came with it (now ours)."""
        self._sock.sendall(frame(request))
        header, fds, _flags, _address = socket.recv_fds(self._sock, LENGTH.size, MAX_FDS)
        while len(header) < LENGTH.size:
            more = self._sock.recv(LENGTH.size - len(header))
            if not more:
                close_fds(fds)
                raise LocalWireError("the server closed the connection")
            header += more
        (length,) = LENGTH.unpack(header)
        payload = bytearray()
        while len(payload) < length:
            chunk = self._sock.recv(min(length - len(payload), 1 << 20))
            if not chunk:
                close_fds(fds)
                raise LocalWireError("the server closed the connection mid-response")
            payload += chunk
        response = local_pb2.LocalResponse()
        response.ParseFromString(bytes(payload))
        return response, fds

    def hung_up(self) -> bool:
        """Whether the server closed this connection (it exited or restarted), without waiting: between
        requests nothing else arrives, so a readable socket here is one at its end."""
        if self._sock.fileno() < 0:
            return True
        poller = select.poll()
        poller.register(self._sock, select.POLLIN | select.POLLHUP | select.POLLERR)
        events = poller.poll(0)
        if not events:
            return False
        try:
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def close(self) -> None:
        self._sock.close()


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
