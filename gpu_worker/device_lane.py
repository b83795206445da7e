"""A CUDA worker's device lane: two staging buffers, a copy stream, and an event per buffer.

A staging buffer is received into again only once the copy out of it completed (the current stream waits
on its event), and drain() waits for every copy: nothing reads the store's bytes before they are there
(gpu_worker/receiver.py's module docstring).

Releasing the staging gives torch's cached blocks back to the device (empty_cache), which first waits for
every event recorded on a stream that used a freed block: NCCL's stream, behind a receive whose transfer
failed, until that group's abort ends its kernel (or forever, if the abort hangs). While `hold_cache` says
such work may still be queued (GroupTable.device_busy), the blocks stay cached and are given back at the
next release or ensure() after it no longer does: an abort is answered at once, not after the kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from weightsync.gpu_worker.memory import release_cached_device_memory


class DeviceLane:
    """Two device staging buffers, a copy stream, and an event per buffer (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.slots: list[torch.Tensor] = []
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self._next = 0
        self._stream: torch.cuda.Stream | None = None
        self.hold_cache: Callable[[], bool] = lambda: False
        """Whether a failed transfer's work may still be queued on this device (the worker's GroupTable)."""
        self.cache_release_pending = False
        """The staging was released while hold_cache held: torch's cached blocks still wait to go back."""

    @property
    def held_bytes(self) -> int:
        return sum(s.numel() for s in self.slots)

    def ensure(self, size: int) -> None:
        self.release_cache()
        if self.slots and self.slots[0].numel() >= size:
            return
        self.drain()
        self.slots = [torch.empty(max(size, 1), dtype=torch.uint8, device=self.device) for _ in range(2)]
        self.copied = [None, None]

    def take(self, size: int) -> tuple[int, torch.Tensor]:
        """The next staging buffer, once the copy out of it completed (a wait on the device, not here)."""
        index, self._next = self._next, self._next ^ 1
        event = self.copied[index]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        return index, self.slots[index][:size]

    @property
    def copy_stream(self) -> torch.cuda.Stream:
        """The stream the copies out of staging run on (created at first use)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def copy_out(self, index: int, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy (device source, host destination) pairs on the copy stream, after what the current stream
        did (the receive); the buffer is reused only after these copies (its event)."""
        stream = self.copy_stream
        received = torch.cuda.Event()
        received.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            stream.wait_event(received)
            for source, destination in pairs:
                destination.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self.copied[index] = done

    def drain(self) -> None:
        """Every copy out of staging completed (before a commit or an abort is answered)."""
        if self._stream is not None:
            self._stream.synchronize()

    def release(self) -> None:
        """Every copy out completed, then the staging buffers and torch's cached blocks go back to the device
        (the blocks later, while hold_cache holds: see the module docstring)."""
        self.drain()
        self.slots = []
        self.copied = [None, None]
        self.cache_release_pending = True
        self.release_cache()

    def release_cache(self) -> None:
        """Give torch's cached blocks back to the device, if a release asked for it and nothing holds it."""
        if self.cache_release_pending and not self.hold_cache():
            self.cache_release_pending = False
            release_cached_device_memory(self.device)
