"""CUDA errors a worker cannot recover from in-process, and how it exits on them.

A CUDA error such as an illegal memory access is sticky: the process's CUDA
context is unusable, and every later command would fail WORKER_INTERNAL while
the heartbeat still said the worker was fine. The worker reports the failing
command, then exits with EXIT_DEVICE_FAULT so the supervisor restarts it (the
store survives on CPU; on CUDA it reads LOST until refilled).

A device that is gone (no device, busy or unavailable, driver mismatch) cannot
be fixed by a restart: the worker exits with EXIT_DEVICE_LOST, at start or
later, and the supervisor backs off instead of restarting it in a loop.

The classification uses the CUDA error code torch attaches to an
AcceleratorError where there is one, and the error text otherwise (NCCL and
older paths only give text).
"""

from __future__ import annotations

import enum

EXIT_DEVICE_FAULT = 86
"""Exit status of a worker whose CUDA context hit a sticky error (restart it)."""
EXIT_DEVICE_LOST = 87
"""Exit status of a worker whose device is gone (restart it only with back-off)."""


class DeviceFault(enum.Enum):
    STICKY = EXIT_DEVICE_FAULT
    LOST = EXIT_DEVICE_LOST

    @property
    def exit_code(self) -> int:
        return self.value


# cudaError_t values (CUDA runtime API) and the text cudaGetErrorString gives for them.
_STICKY_CODES = {
    214: "uncorrectable ecc error encountered",
    700: "an illegal memory access was encountered",
    702: "the launch timed out and was terminated",
    709: "context is destroyed",
    710: "device-side assert triggered",
    714: "hardware stack error",
    715: "an illegal instruction was encountered",
    716: "misaligned address",
    717: "operation not supported on global/shared address space",
    718: "invalid program counter",
    719: "unspecified launch failure",
}
_LOST_CODES = {
    3: "initialization error",
    35: "cuda driver version is insufficient for cuda runtime version",
    46: "cuda-capable device(s) is/are busy or unavailable",
    100: "no cuda-capable device is detected",
    101: "invalid device ordinal",
}
_STICKY_TEXT = (*_STICKY_CODES.values(), "unhandled cuda error")
_LOST_TEXT = (*_LOST_CODES.values(), "gpu has fallen off the bus", "device not found")


class DeviceLeftBusy(RuntimeError):
    """Work of ours may still run on the device and nothing in this process can end it (an NCCL kernel
    whose communicator's abort did not finish): only the process's exit frees the GPU. LOST, not STICKY:
    the restart is what frees it, and a device that keeps doing this is backed off from."""


def classify(error: BaseException) -> DeviceFault | None:
    """STICKY, LOST, or None for an error the worker survives (out of memory, a bad input...)."""
    if isinstance(error, DeviceLeftBusy):
        return DeviceFault.LOST
    code = getattr(error, "error_code", None)
    if isinstance(code, int):
        if code in _STICKY_CODES:
            return DeviceFault.STICKY
        if code in _LOST_CODES:
            return DeviceFault.LOST
    text = str(error).lower()
    if "cuda" not in text and "nccl" not in text:
        return None  # e.g. a Gloo or Python error that happens to say "misaligned address"
    if any(marker in text for marker in _LOST_TEXT):
        return DeviceFault.LOST
    if any(marker in text for marker in _STICKY_TEXT):
        return DeviceFault.STICKY
    return None
