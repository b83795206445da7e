"""SHM: each bucket written into the server's ingress slots (same host), then announced (see base.py)."""

from __future__ import annotations

import mmap
import warnings

import grpc
import torch

from weightsync.client._loop import LoopThread
from weightsync.client.errors import WeightSyncClientError, WeightSyncRpcError
from weightsync.client.packing import PackBuffers, Payload, TensorSource, fill_bucket
from weightsync.client.planning import PlannedBucket
from weightsync.client.streams import UpdateStream
from weightsync.client.transports.base import announce
from weightsync.common.checksum import tensor_checksum
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb


class ShmSink:
    """Write each bucket into the server's ingress (same host), then announce it."""

    transport = pb.TRANSPORT_SHM
    broken = False
    """Nothing of a group to break."""
    frames = None
    """Buckets go into the server's memory whole: nothing to compress."""

    def __init__(self, loop: LoopThread, fd: int, slot_bytes: int, slot_count: int, timeout: float) -> None:
        self._loop = loop
        self._map = mmap.mmap(fd, slot_bytes * slot_count, flags=mmap.MAP_SHARED)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            ingress = torch.frombuffer(self._map, dtype=torch.uint8)
        self._ingress_slots = [ingress[i * slot_bytes : (i + 1) * slot_bytes] for i in range(slot_count)]
        self.buffers = PackBuffers(torch.device("cpu"), slots=self._ingress_slots)
        self._run = (0, slot_count)
        """The slots this push writes (first, count): UpdateReady's run, the whole ingress for a push of one."""
        self._slot_count = slot_count
        self._timeout = timeout

    def _use_run(self, streams: list[UpdateStream]) -> None:
        """Pack into the run of slots the server gave this stream (UpdateReady.ingress_slot_first/_count:
        a part's own share, so parts on one host never write each other's slots). A server that names none
        (older than parts over SHM) gave the whole ingress."""
        ready = streams[0].ready.result()
        run = (ready.ingress_slot_first, ready.ingress_slot_count) if ready.ingress_slot_count else (
            0, len(self._ingress_slots))
        first, count = run
        if run == self._run:
            return
        if first < 0 or count < 1 or first + count > len(self._ingress_slots):
            raise WeightSyncClientError(f"{streams[0].server} gave ingress slots {first}..{first + count - 1} "
                                        f"(UpdateReady), outside the {len(self._ingress_slots)} slots mapped")
        self.buffers = PackBuffers(torch.device("cpu"), slots=self._ingress_slots[first : first + count])
        self._run = run
        self._slot_count = count

    def fill(self, index: int, bucket: PlannedBucket, source: TensorSource, streams: list[UpdateStream]) -> Payload:
        if index == 0:
            self._use_run(streams)
        # Bucket k reuses the slot of bucket k - slots: the server must have applied that one.
        earlier = index - self._slot_count + 1
        if earlier > 0:
            for stream in streams:
                if not stream.wait_applied(earlier, self._timeout):
                    raise WeightSyncRpcError(stream.server, grpc.StatusCode.DEADLINE_EXCEEDED, "BUCKET_NOT_APPLIED",
                                             f"bucket {earlier - 1} was not applied within {self._timeout:g} s", {})
        payload = fill_bucket(self.buffers, bucket, index, source)
        if not payload.packed:  # the caller's own memory: it still has to reach the slot
            slot = self.buffers.slots[index % self._slot_count][: payload.size]
            slot.copy_(payload.read())
            payload = Payload(slot, packed=True, source_devices=payload.source_devices)
        return payload

    def send(self, index: int, payload: Payload, checksum: tensor_pb2.Checksum,
             streams: list[UpdateStream]) -> BaseException | None:
        for stream in streams:
            if stream.failed:
                return stream.reported_error
        data = payload.read()  # the server reads the slot once it is announced
        if checksum.algorithm == tensor_pb2.CHECKSUM_ALGORITHM_UNSPECIFIED:
            checksum = tensor_checksum(data)  # required for SHM: the workers check their copy of the slot
        announce(self._loop, streams, index, payload.size, checksum, layout=payload.layout)
        return None

    def finish(self) -> BaseException | None:
        return None

    def close(self) -> None:
        self.buffers.release()
        self._ingress_slots.clear()
        try:
            self._map.close()
        except BufferError:
            pass  # a view outlives us; the GC unmaps it
