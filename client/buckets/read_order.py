"""Every read of a pack buffer comes after the copies into it: the one place that decides how.

Copies into a pack buffer may still be running when the packing call returns:
  - CUDA -> pinned CPU, non_blocking: a DMA on the source GPU's current stream;
  - CPU -> CUDA and CUDA -> CUDA: work on a CUDA stream, like any CUDA op.
The readers of a buffer are of two kinds:
  - the host: Gloo's broadcast of a CPU buffer, `.numpy()` for INLINE chunks, a
    checksum of a CPU buffer, the SHM server once the bucket is announced;
  - a CUDA stream: NCCL's broadcast of a CUDA buffer (NCCL orders its own stream
    after the current one), a checksum of a CUDA buffer.
So after the copies into a buffer, a CUDA event is recorded on the current stream
of every CUDA device they ran on (the sources' and the buffer's); before a read,
the host blocks on those events, or a CUDA reader's current stream waits on them.
Whatever the devices, the same two calls happen; only `read_order` (a pure
function, table-tested on CPU) knows which devices carry copies and how a reader
waits, and `CudaEvents` is the only code that touches CUDA (tests pass a fake).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch


class Wait(enum.Enum):
    NONE = "none"
    """Nothing asynchronous wrote the buffer (CPU to CPU, or no copy at all)."""
    HOST = "host"
    """The reader is the host (a CPU buffer): block until the events completed."""
    STREAM = "stream"
    """The reader is a CUDA stream (a CUDA buffer): that stream waits on the events, the host does not block."""


@dataclass(frozen=True, slots=True)
class ReadOrder:
    """How reads of one buffer are ordered after the copies into it."""

    record_on: tuple[torch.device, ...]
    """CUDA devices whose current stream ran copies into the buffer: one event on each."""
    wait: Wait
    reader: torch.device
    """Where the buffer lives, hence who reads it (the host for CPU, its stream for CUDA)."""


def devices_of(tensors: Iterable[torch.Tensor]) -> frozenset[torch.device]:
    """The devices copies come from (the one device check packing makes; tests fake it)."""
    return frozenset(t.device for t in tensors)


def read_order(source_devices: Iterable[torch.device], buffer_device: torch.device) -> ReadOrder:
    """The ordering for copies from tensors on `source_devices` into a buffer on `buffer_device`."""
    involved = {*source_devices, buffer_device}
    cuda = tuple(sorted((d for d in involved if d.type == "cuda"), key=lambda d: (d.index is None, d.index or 0)))
    if not cuda:
        return ReadOrder((), Wait.NONE, buffer_device)
    return ReadOrder(cuda, Wait.STREAM if buffer_device.type == "cuda" else Wait.HOST, buffer_device)


def wants_checksum(explicit: bool | None, source_devices: Iterable[torch.device], buffer_device: torch.device) -> bool:
    """Whether a bucket carries a WS64 checksum: as asked, else whenever its bytes came from or through CUDA
    memory (a cheap device reduction there, and the only end-to-end check of copies that NCCL or an
    asynchronous device-to-host copy could get wrong)."""
    if explicit is not None:
        return explicit
    return buffer_device.type == "cuda" or any(d.type == "cuda" for d in source_devices)


class Events(Protocol):
    """What ordering needs from CUDA."""

    def record(self, device: torch.device) -> object:
        """An event recorded now on `device`'s current stream."""

    def host_wait(self, event: object) -> None:
        """Block the calling thread until the event completed."""

    def stream_wait(self, device: torch.device, event: object) -> None:
        """Make `device`'s current stream wait for the event (the host does not block)."""


class CudaEvents:
    """The real thing."""

    def record(self, device: torch.device) -> object:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def host_wait(self, event: object) -> None:
        event.synchronize()  # type: ignore[attr-defined]

    def stream_wait(self, device: torch.device, event: object) -> None:
        torch.cuda.current_stream(device).wait_event(event)  # type: ignore[arg-type]


@dataclass(slots=True)
class BufferFence:
    """The events of the last copies into one buffer; every reader passes through `before_read`."""

    events: Events
    _order: ReadOrder | None = None
    _recorded: list[object] = field(default_factory=list)

    def after_copies(self, order: ReadOrder) -> None:
        """Call right after queueing the copies into the buffer, on the thread that queued them."""
        self._order = order
        self._recorded = [self.events.record(device) for device in order.record_on]

    def before_read(self) -> None:
        """Call before anything reads the buffer (waiting again on completed events is cheap)."""
        order = self._order
        if order is None or order.wait is Wait.NONE:
            return
        for event in self._recorded:
            if order.wait is Wait.HOST:
                self.events.host_wait(event)
            else:
                self.events.stream_wait(order.reader, event)
