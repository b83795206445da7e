"""Memory admission: does this update fit, before anything is allocated or moved?

The node's store is host memory (server/store/node_store.py): what an update adds to it (new segments,
STAGED shadows the first time) is counted against MemAvailable minus a reserve for
everything else on the host, and the operator's --host-memory-limit-bytes (minus what the
store and the workers' host staging already hold). Staging a worker would still allocate
counts where it lives: host memory for Gloo, INLINE and SHM, the worker's device for an
NCCL broadcast (two buffers of the largest bucket), against the free memory that worker
last reported. A refusal is RESOURCE_EXHAUSTED before any byte is allocated or moved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from weightsync.common.errors import ResourceExhausted
from weightsync.server.workers.worker_fleet import FleetWorker


def host_available_bytes() -> int:
    """MemAvailable: what the host can still give without swapping."""
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


@dataclass(frozen=True, slots=True)
class StagingNeed:
    """The staging one worker must hold for an update."""

    worker: FleetWorker
    size_bytes: int
    on_device: bool
    lane_bytes: int = 0
    """Staging for the other lanes of an update fed by several streams (prepare.staging_needs):
    allocated for this update alone, on top of the staging the worker keeps."""

    @property
    def growth(self) -> int:
        """What it would allocate: staging is reused, and grows only; the other lanes' is new each update."""
        held = self.worker.status.staging_bytes
        return max(0, self.size_bytes - held) + self.lane_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryAdmission:
    host_limit_bytes: int = 0
    """Cap on what the store and the workers' host staging may hold together; 0: none."""
    reserve_bytes: int = 256 << 20
    """Host memory left for everything else (the server, engines, the OS)."""
    store_held_bytes: Callable[[], int] = lambda: 0
    """What the store holds now (for the cap)."""
    available: Callable[[], int] = host_available_bytes

    def check(self, *, store_bytes: int, staging: list[StagingNeed]) -> None:
        host_staging = sum(n.growth for n in staging if not n.on_device)
        needed = store_bytes + host_staging
        if needed:
            available = self.available() - self.reserve_bytes
            where = f"MemAvailable minus the {self.reserve_bytes}-byte reserve"
            if self.host_limit_bytes:
                held = self.store_held_bytes() + sum(n.worker.status.staging_bytes for n in staging
                                                     if not n.on_device)
                under_limit = self.host_limit_bytes - held
                if under_limit < available:
                    available, where = under_limit, f"--host-memory-limit-bytes {self.host_limit_bytes} minus what the store and staging hold"
            if needed > available:
                raise ResourceExhausted(
                    "HOST_OUT_OF_MEMORY",
                    f"the update needs {needed} more bytes of host memory ({store_bytes} for the store, "
                    f"{host_staging} for staging), but only {max(available, 0)} are available ({where})",
                    needed_bytes=needed, available_bytes=max(available, 0),
                )
        for need in staging:
            if need.on_device and need.growth > need.worker.status.device_available_bytes:
                raise ResourceExhausted(
                    "DEVICE_OUT_OF_MEMORY",
                    f"worker {need.worker.index} needs {need.growth} more bytes of staging on {need.worker.device}, "
                    f"which has {need.worker.status.device_available_bytes} free",
                    needed_bytes=need.growth, available_bytes=need.worker.status.device_available_bytes,
                    device=need.worker.device,
                )
