"""NCCL point-to-point on a group's own communicator: every send and receive inside a batch.

torch runs an unbatched send/recv on a ProcessGroupNCCL that was not eagerly connected on a two-rank
communicator of its own per pair of ranks, created inside that call (ProcessGroupNCCL::pointToPoint, lazy
mode: one more communicator, stream and set of buffers per pair, for the group's life), and waits for the
pair's non-blocking init there, holding that communicator's lock, so that nothing (our deadline, an abort
from another thread) could end the wait before TORCH_NCCL_NONBLOCKING_TIMEOUT (30 min in a process whose
first NCCL use was not ours). Inside a coalescing region (Backend._start_coalescing / _end_coalescing, what
torch's batch_isend_irecv does) the operation runs on the group's one communicator instead, the one
open_group's connect built, on that communicator's stream: no pair communicator, no store key per pair,
one pool stream per group. A batch may hold several operations (a part's sends of one bucket to each of
its owners): NCCL runs them in one kernel, all at once. What may still wait is the region's end
(ncclGroupEnd): the first transfer between two ranks connects them (NCCL's runtime connect: every p2p
channel of the pair, whatever the size), which needs the peer at its matching operation, and is bounded
only by TORCH_NCCL_NONBLOCKING_TIMEOUT. A parts' group therefore connects every pair inside open_group
(collective.connect_pairs), so no update's transfer meets that wait; torch waits for it polling the
communicator's state (C10D_NCCL_CHECK_TIMEOUT_GROUPEND), taking the communicator's lock per poll
(torch 2.13; a torch without pytorch#170424, merged in January 2026, polled holding the lock, so an abort
waited for the non-blocking timeout), so an abort from another thread is not held off by it. The caller runs every start
in a thread of its own and waits for it against the transfer's deadline (transfer_waits.wait_call).
Start, operations and end run in that one thread: torch counts open batches per thread
(ncclActiveGroupCounter_), and a batch's state is the process group's (one batch at a time on a group).

The start's thread takes the caller's device and current stream: torch orders the communicator's stream
after the current stream of the thread that enqueues (its syncStream), which must be the stream the
caller wrote the buffer on (a part's pack copies; a worker's wait for the staging slot's last copy out).
Its outcome is then ordered before the caller's next work by CollectiveGroup.wait (work.synchronize()).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@contextlib.contextmanager
def on_stream(device: torch.device, stream: torch.cuda.Stream | None) -> Iterator[None]:
    """This thread's current device and stream set to the caller's (a CPU device: nothing to set)."""
    if device.type != "cuda" or stream is None:
        yield
        return
    with torch.cuda.device(device), torch.cuda.stream(stream):
        yield


def free_device_bytes(device: torch.device) -> int:
    """The driver's free memory on a CUDA device (0 elsewhere): NCCL's allocations show only there."""
    if device.type != "cuda":
        return 0
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


@dataclass(frozen=True, slots=True)
class PointToPoint:
    """One operation of a batch: send `tensor` to group rank `peer`, or receive it from there (`tag`: Gloo's; NCCL
    matches by order per pair)."""

    send: bool
    tensor: torch.Tensor
    peer: int
    tag: int = 0


def batched(pg: object, operations: Sequence[PointToPoint]) -> dist.Work:
    """Start `operations` as one batch on the group's own communicator; returns the batch's one work. Every step
    runs in this thread: torch counts open batches per thread."""
    if not operations:
        raise ValueError("an empty batch")
    pg._start_coalescing()  # type: ignore[attr-defined]
    try:
        for operation in operations:
            if operation.send:
                pg.send([operation.tensor], operation.peer, operation.tag)  # type: ignore[attr-defined]
            else:
                pg.recv([operation.tensor], operation.peer, operation.tag)  # type: ignore[attr-defined]
    except BaseException:
        with contextlib.suppress(Exception):
            pg._end_coalescing()  # type: ignore[attr-defined]  # leave no batch open on the group
        raise
    work = pg._end_coalescing()  # type: ignore[attr-defined]
    if work is None:
        raise RuntimeError("torch returned no work for a batched point-to-point operation")
    return work
