"""Memory admission: does this update fit, counting every worker that shares the memory?

Workers answer PrepareUpdate with the bytes they would still allocate. CPU
workers share the host's RAM, so their needs are summed and checked against
MemAvailable (minus a reserve for everything else on the host) and the
operator's --host-memory-limit-bytes; workers on the same CUDA device are
summed against that device's free memory. A refusal is RESOURCE_EXHAUSTED
before any worker allocated a byte or any byte moved.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from weightsync.common.errors import ResourceExhausted
from weightsync.server.supervisor import WorkerHandle
from weightsync.worker.v1 import worker_pb2 as wpb


def host_available_bytes() -> int:
    """MemAvailable: what the host can still give without swapping."""
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryAdmission:
    host_limit_bytes: int = 0
    """Cap on what the CPU workers' stores and buffers may hold together; 0: none."""
    reserve_bytes: int = 256 << 20
    """Host memory left for everything else (the server, engines, the OS)."""

    def check(self, prepared: list[tuple[WorkerHandle, wpb.UpdatePrepared]]) -> None:
        host = [(w, p) for w, p in prepared if w.host_memory]
        needed = sum(p.needed_bytes for _, p in host)
        if needed:
            available = host_available_bytes() - self.reserve_bytes
            where = f"MemAvailable minus the {self.reserve_bytes}-byte reserve"
            if self.host_limit_bytes:
                under_limit = self.host_limit_bytes - sum(p.held_bytes for _, p in host)
                if under_limit < available:
                    available, where = under_limit, f"--host-memory-limit-bytes {self.host_limit_bytes} minus what the workers hold"
            if needed > available:
                raise ResourceExhausted(
                    "HOST_OUT_OF_MEMORY",
                    f"the update needs {needed} more bytes of host memory across {sum(1 for _, p in host if p.needed_bytes)} "
                    f"CPU worker(s), but only {max(available, 0)} are available ({where})",
                    needed_bytes=needed, available_bytes=max(available, 0),
                )
        by_device: dict[str, list[wpb.UpdatePrepared]] = defaultdict(list)
        for worker, p in prepared:
            if not worker.host_memory and p.needed_bytes:
                by_device[worker.device].append(p)
        for device, answers in by_device.items():
            needed = sum(p.needed_bytes for p in answers)
            available = min(p.device_available_bytes for p in answers)
            if needed > available:
                raise ResourceExhausted(
                    "DEVICE_OUT_OF_MEMORY",
                    f"the update needs {needed} more bytes on {device}, which has {available} free",
                    needed_bytes=needed, available_bytes=available, device=device,
                )
