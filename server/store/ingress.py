"""The ingress: host shared memory where bucket bytes arrive without a collective.

One memfd, split into slots; bucket k of an INLINE or SHM update uses slot
k % slot_count. INLINE: the server writes each BucketChunk into the slot. SHM:
a trainer on the host maps the ingress (local socket) and writes the bucket
itself. Either way the bucket's owner then copies it from the slot into the
node store (workers map the ingress read-only, inherited at spawn), so the bytes
never cross a socket between server and workers. A slot is reused only after the
owner applied the bucket that used it: the session waits (INLINE) or refuses an
early announcement (SHM).

Pages are touched on first use, not at start-up: an idle server holds no
ingress memory.
"""

from __future__ import annotations

import mmap
import os

from weightsync.common import byte_passes


class Ingress:
    """The server's side: owns the memfd, writes INLINE chunks."""

    first_slot = 0
    """Sequence 0's slot: the whole ingress is one run of slots (update.streams.IngressShare: a part's)."""

    def __init__(self, slot_bytes: int, slot_count: int) -> None:
        if slot_bytes <= 0 or slot_count < 2:
            raise ValueError(f"ingress needs slot_bytes > 0 and at least 2 slots, got {slot_bytes} x {slot_count}")
        self.slot_bytes = slot_bytes
        self.slot_count = slot_count
        self.size_bytes = slot_bytes * slot_count
        self.fd = os.memfd_create("weightsync-ingress", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size_bytes)
        self._map = mmap.mmap(self.fd, self.size_bytes, flags=mmap.MAP_SHARED)
        self.view = memoryview(self._map)

    def slot_offset(self, sequence: int) -> int:
        return (sequence % self.slot_count) * self.slot_bytes

    def write(self, sequence: int, offset_bytes: int, data: bytes | memoryview) -> None:
        """Copy an INLINE chunk into bucket `sequence`'s slot (bounds checked by the caller)."""
        start = self.slot_offset(sequence) + offset_bytes
        self.view[start : start + len(data)] = data
        byte_passes.copied("server.ingress", len(data))

    def close(self) -> None:
        self.view.release()
        self._map.close()
        os.close(self.fd)
