"""The GPU paths' decisions, on CPU with fakes: device identity by UUID, IPC handle lifetimes.

- Engines find the worker on their own GPU by UUID, never by an ordinal (each process numbers its
  GPUs after its own CUDA_VISIBLE_DEVICES), and open a handle on their ordinal of its GPU.
- The server's cache of a CUDA worker's exported handles belongs to one worker incarnation: a
  restarted worker numbers its arenas from 1 again, and the old handles name dead memory.
- Workers share each committed arena once (torch adds a reference counter per share) and never
  an update's uncommitted arenas; arenas that left the store are collected.
- Engines map each arena once per incarnation, not once per acquire.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
import torch

from weightsync.common.device_identity import (
    WorkerDevice,
    local_ordinal,
    normalize_uuid,
    pick_worker,
)
from weightsync.common.errors import WeightSyncError
from weightsync.engine import client as engine_client
from weightsync.engine.client import EngineClient, EngineError
from weightsync.gpu_worker.cuda_export import ArenaExporter, committed_arena_ids
from weightsync.gpu_worker.memory import Arena
from weightsync.gpu_worker.store import Region, Segment
from weightsync.server.engines import EngineRegistry
from weightsync.server.leases import LeaseTable
from weightsync.server.local_socket import LocalHandoff, _Peer
from weightsync.server.state import PublishedVersion
from weightsync.server.store_keeper import DeviceExports, KeptStore
from weightsync.server.supervisor import WorkerHandle
from weightsync.v1 import local_pb2, tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb

GPU_A = "8f0e0c3a-1111-2222-3333-444444444444"
GPU_B = "1c2d3e4f-5555-6666-7777-888888888888"


def refused(call) -> WeightSyncError:
    with pytest.raises(WeightSyncError) as caught:
        call()
    return caught.value


# -- which worker, which ordinal --------------------------------------------------------------------------------
def test_uuids_have_one_spelling():
    assert normalize_uuid(f"GPU-{GPU_A.upper()}") == GPU_A == normalize_uuid(f" {GPU_A}\n")


def test_a_gpu_engine_gets_the_worker_on_its_own_gpu_whatever_its_ordinal():
    workers = [WorkerDevice(0, "cuda:0", GPU_A), WorkerDevice(1, "cuda:1", GPU_B), WorkerDevice(2, "cpu")]
    # Ray gives the engine on GPU B the ordinal cuda:0: it must still read worker 1, not worker 0.
    assert pick_worker(workers, worker_index=-1, device="cuda:0", device_uuid=f"GPU-{GPU_B}") == 1
    assert pick_worker(workers, worker_index=-1, device="cuda:0", device_uuid=GPU_A) == 0
    assert pick_worker(workers, worker_index=-1, device="cpu", device_uuid="") == 2
    assert pick_worker(workers, worker_index=1, device="cpu", device_uuid="") == 1


def test_no_worker_on_the_engines_gpu_names_the_workers_devices():
    workers = [WorkerDevice(0, "cuda:0", GPU_A), WorkerDevice(1, "cpu")]
    error = refused(lambda: pick_worker(workers, worker_index=-1, device="cuda:3", device_uuid=GPU_B))
    assert (error.code, error.reason) == (grpc.StatusCode.NOT_FOUND, "WORKER_NOT_FOUND")
    assert error.metadata == {"device": "cuda:3", "device_uuid": GPU_B, "devices": "cuda:0,cpu", "uuids": f"{GPU_A},"}
    assert f"0: cuda:0 ({GPU_A}), 1: cpu" in error.message
    error = refused(lambda: pick_worker(workers, worker_index=-1, device="cuda:0", device_uuid=""))
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "DEVICE_UUID_MISSING")
    error = refused(lambda: pick_worker([WorkerDevice(0, "cuda:0", GPU_A)], worker_index=-1, device="cpu",
                                        device_uuid=""))
    assert (error.reason, error.metadata["devices"]) == ("WORKER_NOT_FOUND", "cuda:0")
    error = refused(lambda: pick_worker(workers, worker_index=4, device="cpu", device_uuid=""))
    assert (error.reason, error.metadata) == ("WORKER_NOT_FOUND", {"worker": "4", "workers": "2"})


def test_a_restarting_worker_whose_gpu_is_unknown_is_retry_later_not_absent():
    workers = [WorkerDevice(0, "cuda:0", GPU_A), WorkerDevice(1, "cuda:1", "", running=False)]
    error = refused(lambda: pick_worker(workers, worker_index=-1, device="cuda:0", device_uuid=GPU_B))
    assert (error.code, error.reason) == (grpc.StatusCode.UNAVAILABLE, "WORKER_UNAVAILABLE")


def test_a_handle_opens_on_this_process_s_ordinal_of_its_gpu():
    visible = [GPU_B, GPU_A]  # this process numbers the GPUs the other way round
    assert local_ordinal(f"GPU-{GPU_A}", visible) == 1
    assert local_ordinal(GPU_B, visible) == 0
    error = refused(lambda: local_ordinal(GPU_A, [GPU_B]))
    assert (error.code, error.reason, error.metadata["device_uuid"]) == (
        grpc.StatusCode.FAILED_PRECONDITION, "DEVICE_NOT_VISIBLE", GPU_A)
    assert refused(lambda: local_ordinal("", visible)).reason == "DEVICE_UUID_MISSING"


# -- the server's cache of exported handles ------------------------------------------------------------------------
def handle(arena_id: int, tag: bytes, uuid: str = GPU_A) -> local_pb2.ArenaHandle:
    h = local_pb2.ArenaHandle(arena_id=arena_id, size_bytes=4096, fd_index=-1)
    h.cuda.handle, h.cuda.device_uuid, h.cuda.device = tag, uuid, 0
    return h


def test_exports_belong_to_one_worker_incarnation():
    exports = DeviceExports()
    assert exports.absorb(0, 0, GPU_A, [handle(1, b"first-process")])
    assert exports.lookup(0, [1])[1].cuda.handle == b"first-process" and exports.uuid(0) == GPU_A
    assert exports.lookup(0, [1, 2]) is None  # arena 2 was never exported
    # The worker restarted: its arenas are numbered from 1 again, in other memory.
    assert exports.lookup(1, [1]) is None and exports.uuid(1) == ""
    assert not exports.absorb(0, 1, GPU_A, [handle(1, b"late-answer-of-the-dead")])  # answered before it died
    assert exports.lookup(1, [1]) is None
    assert exports.absorb(1, 1, GPU_A, [handle(1, b"second-process")])
    assert exports.lookup(1, [1])[1].cuda.handle == b"second-process" and exports.lookup(0, [1]) is None


def test_a_dead_workers_exports_go_with_its_store():
    kept = KeptStore()
    kept.exports.absorb(3, 3, GPU_A, [handle(1, b"h")])
    kept.forget()  # what the supervisor does when a worker whose store is not kept dies
    assert kept.exports.lookup(3, [1]) is None and kept.exports.uuid(3) == ""


class FakeSupervisor:
    """Answers ExportStoreCommand like a CUDA worker; each process has handles of its own."""

    def __init__(self, workers: list[WorkerHandle], uuids: dict[int, str]) -> None:
        self.workers = workers
        self.uuids = uuids
        self.exports: list[tuple[int, int]] = []

    async def call(self, worker: WorkerHandle, timeout: float, **command) -> wpb.WorkerEvent:
        assert list(command) == ["export_store"]
        self.exports.append((worker.index, worker.restart_count))
        arenas = [handle(a.arena_id, f"w{worker.index}-p{worker.restart_count}-a{a.arena_id}".encode(),
                         self.uuids[worker.index]) for a in worker.kept.layout.arenas] if worker.kept.layout else []
        return wpb.WorkerEvent(store_exported=wpb.StoreExported(device_uuid=self.uuids[worker.index], arenas=arenas))


def cuda_worker(index: int) -> WorkerHandle:
    worker = WorkerHandle(index, f"cuda:{index}", None, None, state=pb.WORKER_STATE_RUNNING)  # type: ignore[arg-type]
    commit(worker)
    return worker


def commit(worker: WorkerHandle) -> None:
    """What a commit of one 8-byte tensor in arena 1 reports (a restarted worker starts at arena 1 too)."""
    manifest = wpb.StoreManifest(tensors_included=True)
    manifest.arenas.add(arena_id=1, size_bytes=4096)
    manifest.segments.add(size_bytes=8).live.arena_id = 1
    manifest.tensors.add(name="w", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[2], segment=0, size_bytes=8)
    worker.kept.absorb(manifest, [], [])
    worker.store = wpb.StoreStatus(state=pb.STORE_STATE_CONSISTENT, tensor_count=1, store_bytes=8)


def handoff(supervisor: FakeSupervisor) -> LocalHandoff:
    publisher = SimpleNamespace(version=PublishedVersion(7, "v1", 1))
    return LocalHandoff("/nonexistent.sock", supervisor=supervisor, publisher=publisher,  # type: ignore[arg-type]
                        leases=LeaseTable(), engines=EngineRegistry(), ingress=None,
                        credentials=SimpleNamespace(token=""), allowed_uids=(),  # type: ignore[arg-type]
                        command_timeout=5.0)


def test_the_local_socket_never_hands_out_a_dead_workers_handles():
    async def scenario() -> None:
        worker = cuda_worker(0)
        supervisor = FakeSupervisor([worker], {0: GPU_A})
        local = handoff(supervisor)
        peer = _Peer(1, 0, worker=worker)

        async def acquired() -> local_pb2.AcquireVersionResponse:
            response, fds = await local._acquire(peer, local_pb2.AcquireVersionRequest())
            assert fds == []
            await local._release(peer, local_pb2.ReleaseVersionRequest(lease_id=response.acquire_version.lease_id))
            return response.acquire_version

        first = await acquired()
        assert [(a.arena_id, a.cuda.handle, a.cuda.device_uuid) for a in first.arenas] == [(1, b"w0-p0-a1", GPU_A)]
        assert first.worker_incarnation == 0
        await acquired()
        assert supervisor.exports == [(0, 0)]  # exported once, then kept
        # The worker dies (the supervisor forgets a device store and counts the restart), a new process
        # refills its store: arena 1 again, other memory.
        worker.kept.forget()
        worker.restart_count += 1
        commit(worker)
        second = await acquired()
        assert [(a.arena_id, a.cuda.handle) for a in second.arenas] == [(1, b"w0-p1-a1")]
        assert second.worker_incarnation == 1 and supervisor.exports == [(0, 0), (0, 1)]

    asyncio.run(scenario())


def test_a_gpu_engine_attaches_to_the_worker_on_its_gpu():
    async def scenario() -> None:
        workers = [cuda_worker(0), cuda_worker(1)]
        supervisor = FakeSupervisor(workers, {0: GPU_A, 1: GPU_B})
        local = handoff(supervisor)
        peer = _Peer(1, 0)
        response = await local._attach(peer, local_pb2.AttachStoreRequest(
            worker_index=-1, device="cuda:0", device_uuid=f"GPU-{GPU_B.upper()}"))
        assert (response.attach_store.worker_index, response.attach_store.device_uuid) == (1, GPU_B)
        assert peer.worker is workers[1]
        assert sorted(supervisor.exports) == [(0, 0), (1, 0)]  # learned once per worker process
        await local._attach(_Peer(2, 0), local_pb2.AttachStoreRequest(worker_index=-1, device="cuda:0",
                                                                      device_uuid=GPU_A))
        assert len(supervisor.exports) == 2

    asyncio.run(scenario())


# -- the worker shares each committed arena once ---------------------------------------------------------------
def device_arena(arena_id: int) -> Arena:
    return Arena(arena_id, torch.zeros(4096, dtype=torch.uint8))  # fd -1: device memory, as far as sharing goes


class Shares:
    def __init__(self) -> None:
        self.shared: list[int] = []
        self.collected = 0

    def share(self, data: torch.Tensor) -> tuple:
        self.shared.append(data.data_ptr())
        return (0, f"ipc-{len(self.shared)}".encode(), data.numel(), 0, b"/ref", 8 * len(self.shared), None, False)

    def collect(self) -> None:
        self.collected += 1


def store(arenas: dict[int, Arena], segments: list[Segment], first_new_segment: int | None = None):
    update = None if first_new_segment is None else SimpleNamespace(
        plan=SimpleNamespace(first_new_segment=first_new_segment))
    return SimpleNamespace(arenas=arenas, segments=segments, update=update)


def test_only_committed_live_arenas_are_exported():
    segments = [Segment(8, Region(1, 0), Region(3, 0), b""), Segment(8, Region(2, 0), None, b"")]
    assert committed_arena_ids(store({}, segments)) == {1, 2}
    # An update in flight: its new segment (arena 4) and its shadows (arena 3) hold no committed bytes.
    segments.append(Segment(8, Region(4, 0), None, b""))
    assert committed_arena_ids(store({}, segments, first_new_segment=2)) == {1, 2}


def test_each_arena_is_shared_once_and_collected_when_it_leaves():
    shares = Shares()
    exporter = ArenaExporter(GPU_A, share=shares.share, collect=shares.collect)
    arenas = {i: device_arena(i) for i in (1, 2, 3)}
    first = exporter.export(arenas, {1, 2})
    assert [(h.arena_id, h.cuda.device_uuid, h.cuda.handle) for h in first] == [(1, GPU_A, b"ipc-1"),
                                                                                (2, GPU_A, b"ipc-2")]
    assert first[0].cuda.ref_counter_handle == b"/ref" and first[0].cuda.allocation_size_bytes == 4096
    again = exporter.export(arenas, {1, 2})
    assert [h.cuda.handle for h in again] == [b"ipc-1", b"ipc-2"] and len(shares.shared) == 2
    assert shares.collected == 0
    gone = arenas.pop(2)  # an arena left the store; kept alive here so that its address is not reused
    arenas[2] = device_arena(2)  # and another allocation got its id
    assert arenas[2].data.data_ptr() != gone.data.data_ptr()
    third = exporter.export(arenas, {1, 2, 3})
    assert [h.cuda.handle for h in third] == [b"ipc-1", b"ipc-3", b"ipc-4"] and shares.collected == 1
    host = Arena(5, torch.zeros(8, dtype=torch.uint8), fd=99)  # host memory goes as a descriptor
    assert [h.arena_id for h in exporter.export({**arenas, 5: host}, {1, 5})] == [1]


# -- the engine maps each arena once per worker incarnation ----------------------------------------------------
def test_the_engine_maps_an_arena_once_per_incarnation_on_its_own_ordinal(monkeypatch):
    opened: list[tuple[bytes, int]] = []

    def fake_open(arena: local_pb2.ArenaHandle, ordinal: int) -> torch.Tensor:
        opened.append((arena.cuda.handle, ordinal))
        return torch.zeros(arena.size_bytes, dtype=torch.uint8)

    monkeypatch.setattr(engine_client, "_open_cuda", fake_open)
    engine = object.__new__(EngineClient)
    engine._mapped, engine._visible = {}, [GPU_B, GPU_A]
    first = engine._map(handle(1, b"p0"), [], 0)
    assert engine._map(handle(1, b"p0"), [], 0) is first  # the same memory: the same mapping
    assert opened == [(b"p0", 1)]  # GPU A is this process's cuda:1, whatever the worker calls it
    assert engine._map(handle(1, b"p1"), [], 1) is not first  # a restarted worker: mapped anew
    assert opened == [(b"p0", 1), (b"p1", 1)]
    engine._forget_unlisted({})
    assert engine._mapped == {}
    with pytest.raises(EngineError) as caught:
        engine._map(handle(2, b"p1", uuid=normalize_uuid("GPU-ffffffff-0000-0000-0000-000000000000")), [], 1)
    assert (caught.value.reason, caught.value.code) == ("DEVICE_NOT_VISIBLE", grpc.StatusCode.FAILED_PRECONDITION)
