"""Which GPU is which: UUIDs across processes, ordinals only inside one.

A CUDA ordinal ("cuda:0") means something only inside one process: it
depends on that process's CUDA_VISIBLE_DEVICES (Ray, for one, gives every
vLLM worker its own GPU as cuda:0). A GPU's UUID is the same everywhere. So
workers report their GPU's UUID, engines pick the worker on their own GPU by
UUID, and an IPC handle is opened on the local ordinal of the UUID it names.

The decisions are pure functions over plain lists, so they are tested
without a GPU; only `cuda_uuid` and `visible_uuids` ask torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from weightsync.common.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable


def normalize_uuid(text: str) -> str:
    """One spelling of a GPU UUID: lowercase, without nvidia-smi's "GPU-" prefix."""
    text = text.strip().lower()
    return text[4:] if text.startswith("gpu-") else text


def is_cuda(device: str) -> bool:
    return device == "cuda" or device.startswith("cuda:")


def cuda_ordinal(device: str) -> int:
    """The ordinal of "cuda:N" ("cuda": 0)."""
    if not is_cuda(device):
        raise ValueError(f"{device!r} is not a CUDA device")
    _, _, index = device.partition(":")
    if index and not index.isdigit():
        raise ValueError(f"{device!r} is not a CUDA device")
    return int(index or 0)


def cuda_uuid(ordinal: int) -> str:
    """The UUID of this process's CUDA device `ordinal` (initializes CUDA)."""
    import torch

    return normalize_uuid(str(torch.cuda.get_device_properties(ordinal).uuid))


def visible_uuids() -> list[str]:
    """UUIDs of the GPUs this process sees, by its own ordinal; [] without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [cuda_uuid(i) for i in range(torch.cuda.device_count())]


def local_ordinal(uuid: str, visible: Sequence[str]) -> int:
    """This process's ordinal of the GPU with `uuid` (visible: its GPUs' UUIDs by ordinal)."""
    wanted = normalize_uuid(uuid)
    if not wanted:
        raise InvalidArgument("DEVICE_UUID_MISSING", "the CUDA handle names no GPU UUID (a server too old "
                              "to say which GPU holds the arena)")
    for ordinal, candidate in enumerate(visible):
        if normalize_uuid(candidate) == wanted:
            return ordinal
    raise FailedPrecondition(
        "DEVICE_NOT_VISIBLE",
        f"the store lives on GPU {wanted}, which this process does not see (it sees "
        f"{', '.join(f'cuda:{i} {u}' for i, u in enumerate(visible)) or 'no GPU'}); run the engine on that GPU",
        device_uuid=wanted, visible=",".join(visible),
    )


@dataclass(frozen=True, slots=True)
class WorkerDevice:
    """What the server knows of one worker's device."""

    index: int
    device: str
    """The server's name for it: "cpu", "cuda:0" (the server's ordinal)."""
    uuid: str = ""
    """Normalized GPU UUID; "" for CPU, or for a GPU worker whose UUID is not known yet."""
    running: bool = True


def describe(workers: Sequence[WorkerDevice]) -> str:
    return ", ".join(f"{w.index}: {w.device}" + (f" ({w.uuid})" if w.uuid else "") for w in workers) or "none"


def pick_worker(workers: Sequence[WorkerDevice], *, worker_index: int, device: str, device_uuid: str) -> int:
    """The index of the worker a peer attaches to.

    worker_index >= 0 picks that worker. Else a CPU peer gets the first CPU worker and a CUDA peer
    the worker whose GPU UUID is its own: never the one with the same ordinal, which in another
    process may be another GPU.
    """
    if worker_index >= 0:
        if worker_index >= len(workers):
            raise NotFound("WORKER_NOT_FOUND", f"no worker {worker_index}; this server has {len(workers)}",
                           worker=worker_index, workers=len(workers))
        return worker_index
    devices = ",".join(w.device for w in workers)
    wanted = normalize_uuid(device_uuid)
    if not wanted:
        if is_cuda(device):
            raise InvalidArgument("DEVICE_UUID_MISSING", f"a CUDA peer ({device}) must say which GPU it is on "
                                  "(device_uuid): ordinals differ between processes", device=device)
        match = next((w for w in workers if w.device == (device or "cpu")), None)
        if match is None:
            raise NotFound("WORKER_NOT_FOUND", f"no worker on device {device!r} (workers: {describe(workers)})",
                           device=device, devices=devices)
        return match.index
    match = next((w for w in workers if w.uuid and w.uuid == wanted), None)
    if match is not None:
        return match.index
    unknown = [w for w in workers if is_cuda(w.device) and not w.uuid and not w.running]
    if unknown:
        raise Unavailable("WORKER_UNAVAILABLE", f"no running worker is on GPU {wanted}, and worker(s) "
                          f"{','.join(str(w.index) for w in unknown)} are restarting; retry shortly",
                          device_uuid=wanted, devices=devices)
    raise NotFound("WORKER_NOT_FOUND", f"no worker on the peer's GPU {device or 'cuda'} ({wanted}); workers: "
                   f"{describe(workers)}", device=device, device_uuid=wanted, devices=devices,
                   uuids=",".join(w.uuid for w in workers))
