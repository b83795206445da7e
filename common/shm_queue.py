"""A single-producer, single-consumer message queue in shared memory.

Layout of the segment (all integers little-endian):

    [0:8)    magic b"WSQUEUE1"
    [8:16)   capacity of the ring in bytes
    [16:24)  head: total bytes ever written (only the producer stores it)
    [24:32)  tail: total bytes ever read (only the consumer stores it)
    [32:40)  heartbeat: CLOCK_MONOTONIC nanoseconds of the worker's last beat
             (command queues only; the worker stores it, the server reads it)
    [64:64+capacity)  the ring

Each message is a frame: u32 payload length, u32 CRC-32, then the payload (a
serialized protobuf message), wrapping around the ring's end. The CRC covers
the frame's absolute stream position, its length and its payload, so neither
zeroed memory nor a stale frame left from an earlier lap of the ring passes.
An eventfd "doorbell" wakes the consumer; the fd travels to the worker through
pass_fds, so no pickle and no name lookup is involved.

A frame whose length does not fit, or whose CRC does not match, raises
QueueCorrupted: the reader never trusts bytes it did not validate.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import select
import struct
import time
import zlib
from multiprocessing import shared_memory

_MAGIC = b"WSQUEUE1"
_HEADER_BYTES = 64
_FRAME = struct.Struct("<II")
_POSITION = struct.Struct("<QI")
MIN_CAPACITY = 4096


def _crc(position: int, payload: bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(_POSITION.pack(position, len(payload))))


class QueueCorrupted(Exception):
    """The ring holds a frame that fails validation."""


class QueueFull(Exception):
    """No room for the message before the deadline."""


class ShmQueue:
    """One direction of a worker channel over a shared-memory ring."""

    def __init__(self, buf: memoryview, doorbell_fd: int, *, initialise: bool, capacity: int = 0):
        self._buf = buf
        self.doorbell_fd = doorbell_fd
        if initialise:
            if capacity < MIN_CAPACITY or capacity + _HEADER_BYTES > len(buf):
                raise ValueError(f"capacity {capacity} does not fit a segment of {len(buf)} bytes")
            buf[0:8] = _MAGIC
            struct.pack_into("<QQQ", buf, 8, capacity, 0, 0)
        elif bytes(buf[0:8]) != _MAGIC:
            raise QueueCorrupted("segment does not start with the queue magic")
        self.capacity = struct.unpack_from("<Q", buf, 8)[0]
        if self.capacity + _HEADER_BYTES > len(buf):
            raise QueueCorrupted(f"capacity {self.capacity} exceeds segment size {len(buf)}")
        # Aligned 8-byte loads/stores through ctypes are single instructions.
        self._head = ctypes.c_uint64.from_buffer(buf, 16)
        self._tail = ctypes.c_uint64.from_buffer(buf, 24)
        self._heartbeat = ctypes.c_uint64.from_buffer(buf, 32)

    # -- heartbeat -------------------------------------------------------------
    def beat(self) -> None:
        """Record that the peer process is alive (monotonic clock, shared by all processes)."""
        self._heartbeat.value = time.monotonic_ns()

    def seconds_since_beat(self) -> float | None:
        """None if the peer never beat."""
        last = self._heartbeat.value
        return None if last == 0 else (time.monotonic_ns() - last) / 1e9

    # -- producer --------------------------------------------------------------
    def try_put(self, payload: bytes) -> bool:
        """Append one frame; False if the ring has no room right now."""
        needed = _FRAME.size + len(payload)
        if needed > self.capacity:
            raise ValueError(
                f"message of {len(payload)} bytes exceeds queue capacity {self.capacity}; "
                "raise queue_capacity_bytes"
            )
        head = self._head.value
        if self.capacity - (head - self._tail.value) < needed:
            return False
        frame = _FRAME.pack(len(payload), _crc(head, payload)) + payload
        self._write(head, frame)
        self._head.value = head + needed
        os.eventfd_write(self.doorbell_fd, 1)
        return True

    def put(self, payload: bytes, timeout: float = 10.0) -> None:
        """Blocking put with a deadline (used by the worker for events)."""
        deadline = time.monotonic() + timeout
        while not self.try_put(payload):
            if time.monotonic() > deadline:
                raise QueueFull(f"queue stayed full for {timeout} s")
            time.sleep(0.001)

    # -- consumer --------------------------------------------------------------
    def try_get(self) -> bytes | None:
        """Pop one frame's payload, or None if the ring is empty."""
        tail = self._tail.value
        available = self._head.value - tail
        if available == 0:
            return None
        if available < _FRAME.size or available > self.capacity:
            raise QueueCorrupted(f"ring holds {available} bytes, capacity {self.capacity}")
        length, crc = _FRAME.unpack(self._read(tail, _FRAME.size))
        if _FRAME.size + length > available:
            raise QueueCorrupted(f"frame length {length} exceeds the {available} bytes written")
        payload = self._read(tail + _FRAME.size, length)
        if _crc(tail, payload) != crc:
            raise QueueCorrupted(f"frame of {length} bytes fails its CRC")
        self._tail.value = tail + _FRAME.size + length
        return payload

    def get(self, timeout: float | None) -> bytes | None:
        """Wait for one payload up to timeout seconds (None: forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            payload = self.try_get()
            if payload is not None:
                return payload
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if remaining == 0.0:
                return None
            ready, _, _ = select.select([self.doorbell_fd], [], [], remaining)
            if ready:
                self.clear_doorbell()

    def clear_doorbell(self) -> None:
        """Reset the eventfd counter (it is non-blocking)."""
        try:
            os.eventfd_read(self.doorbell_fd)
        except BlockingIOError:
            pass

    # -- ring access -------------------------------------------------------------
    def _write(self, position: int, data: bytes) -> None:
        start = position % self.capacity
        first = min(len(data), self.capacity - start)
        base = _HEADER_BYTES
        self._buf[base + start : base + start + first] = data[:first]
        if first < len(data):
            self._buf[base : base + len(data) - first] = data[first:]

    def _read(self, position: int, length: int) -> bytes:
        start = position % self.capacity
        first = min(length, self.capacity - start)
        base = _HEADER_BYTES
        out = bytes(self._buf[base + start : base + start + first])
        if first < length:
            out += bytes(self._buf[base : base + length - first])
        return out

    def release(self) -> None:
        """Drop the ctypes views so the underlying mapping can be closed."""
        del self._head, self._tail, self._heartbeat
        self._buf = memoryview(b"")


class OwnedQueue:
    """The server's side: creates the segment and doorbell.

    The segment's name is unlinked as soon as it exists: the server keeps its
    mapping and file descriptor, and workers receive the descriptor, so nobody
    needs the name, and nothing is left in /dev/shm even if the server is
    SIGKILLed. The memory goes away with the last process that maps it.
    """

    def __init__(self, capacity: int) -> None:
        self.segment = shared_memory.SharedMemory(create=True, size=capacity + _HEADER_BYTES)
        self.segment.unlink()
        self.doorbell_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.queue = ShmQueue(self.segment.buf, self.doorbell_fd, initialise=True, capacity=capacity)

    @property
    def segment_fd(self) -> int:
        return self.segment._fd  # noqa: SLF001 - the fd is what the worker maps

    @property
    def name(self) -> str:
        return self.segment.name

    def reset(self) -> None:
        """Empty the ring (after the peer worker died and is restarted)."""
        self.queue.clear_doorbell()
        self.queue.release()
        self.queue = ShmQueue(
            self.segment.buf, self.doorbell_fd, initialise=True, capacity=self.queue.capacity
        )

    def close(self) -> None:
        """Unmap and close; idempotent."""
        if self.doorbell_fd < 0:
            return
        self.queue.release()
        os.close(self.doorbell_fd)
        self.doorbell_fd = -1
        self.segment.close()


class AttachedQueue:
    """The worker's side: maps a segment handed over as a file descriptor."""

    def __init__(self, segment_fd: int, doorbell_fd: int) -> None:
        size = os.fstat(segment_fd).st_size
        self._map = mmap.mmap(segment_fd, size)
        os.close(segment_fd)
        self.doorbell_fd = doorbell_fd
        self.queue = ShmQueue(memoryview(self._map), doorbell_fd, initialise=False)

    def close(self) -> None:
        self.queue.release()
        self._map.close()
