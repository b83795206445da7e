"""The CUDA paths, on one GPU: ordering of copies, CUDA workers writing the host store, a CUDA
engine reading it, the device lane's staging and copy stream, device WS64.

The trainer's tensors are written on the current stream right behind a long
`torch.cuda._sleep`, then pushed at once: a push that reads them (or its pack buffers) before
those kernels ran sends stale bytes, and `verify` (WS64 of the store) plus the bytes an engine
maps catch it. Engines get a long kernel queued before their copies out of the pinned store,
then an IN_PLACE push follows at once: an engine that released its lease before its copies ran
would read torn bytes (a control run without the release's synchronize shows it). A CUDA
worker's device staging is taken again only after the copy out of it ran, and goes back to the
device at an abort.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from weightsync.client import WeightSyncClient
from weightsync.common.checksum import ws64
from weightsync.common.collective import BUCKET_TAIL_BYTES
from weightsync.common.dtypes import SUPPORTED_PROTO_DTYPES, entry_for_proto
from weightsync.engine import EngineClient, ModuleFollower, apply_to_module
from weightsync.v1 import weight_sync_service_pb2 as pb

from gpukit import (
    SLEEP_CYCLES,
    assert_same_bytes,
    gpu_model,
    info,
    mapped_copy,
    written_behind_a_sleep,
)
from helpers import wait_for

pytestmark = pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", ["inline", "shm", "collective"])
@pytest.mark.parametrize("store", ["cpu_server", "cuda_server"])
def test_a_cuda_trainer_sends_the_bytes_its_stream_wrote(transport, store, request):
    """Into a node of a CPU worker and of a CUDA worker: Gloo, INLINE and SHM land in the host store
    whatever the worker's device (NCCL needs two GPUs: test_two_gpus.py)."""
    server = request.getfixturevalue(store)
    with WeightSyncClient(server.address, timeout=120) as client:
        if transport == "collective":
            client.create_group(backend="auto", timeout=60)  # a worker on this GPU: auto picks Gloo
        for step in range(3):
            model = written_behind_a_sleep(gpu_model(step))
            mode = "staged" if step % 2 else "in_place"
            client.push(model, version=f"v{step}", mode=mode, transport=transport, bucket_size_bytes=1 << 20,
                        allow_new_tensors=True)
            assert client.verify(model).ok, f"step {step}: the store holds other bytes than the trainer's stream wrote"
            assert_same_bytes(mapped_copy(server, "cuda:0"), model)
    worker = info(server).workers[0]
    assert not worker.staging_on_device  # Gloo, INLINE and SHM never touch a worker's GPU


def module_like(model: dict[str, torch.Tensor]) -> tuple[torch.nn.Module, dict[str, str]]:
    """A module with an empty CUDA buffer per tensor, and the store name -> buffer name map."""
    module = torch.nn.Module()
    for name, tensor in model.items():
        module.register_buffer(name.replace(".", "_"), torch.empty_like(tensor, device="cuda"))
    return module, {n: n.replace(".", "_") for n in model}


def follow_then_overwrite(server, monkeypatch, *, synchronize: bool,
                          sleep_cycles: int = SLEEP_CYCLES) -> tuple[dict, dict, dict, bool]:
    """An engine copies v1 behind a long kernel; an IN_PLACE push of v2 (built on the CPU, so nothing of
    it waits for that kernel) follows at once. Returns v1, v2, what the engine's module holds, and
    whether the kernel (so every copy queued behind it) was still pending when the push returned."""
    from weightsync.engine import client as engine_client

    if not synchronize:
        monkeypatch.setattr(engine_client, "synchronize_devices", lambda devices: None)
    first = {n: t.cpu() for n, t in gpu_model(10, scale=32).items()}
    second = {n: t.cpu() for n, t in gpu_model(11, scale=32).items()}
    module, name_map = module_like(first)
    with WeightSyncClient(server.address, timeout=120) as client:
        client.push(first, version="v1", transport="inline", allow_new_tensors=True)
        with EngineClient(server=server.address, name="module", device="cuda:0") as engine:
            with engine.acquire():  # map and pin the store now: no registration runs behind the kernel
                pass
            follower = ModuleFollower(engine, module, name_map=name_map)
            torch.cuda.synchronize()
            torch.cuda._sleep(sleep_cycles)  # the follower's copies queue behind this
            slept = torch.cuda.Event()
            slept.record()
            assert follower.update()
            client.push(second, version="v2", mode="in_place", transport="inline")  # writes the live bytes
            pending = not slept.query()
            torch.cuda.synchronize()
    return first, second, {n: getattr(module, name_map[n]) for n in first}, pending


def test_an_engine_keeps_its_lease_until_its_gpu_copies_ran(cuda_server, monkeypatch):
    first, _second, held, pending = follow_then_overwrite(cuda_server, monkeypatch, synchronize=True)
    assert not pending  # update() returned only once the copies ran (the release waited for them)
    assert_same_bytes(held, first)  # v1 whole, never torn


def test_without_the_release_synchronize_the_engine_would_copy_torn_bytes(cuda_server, monkeypatch):
    """The control: the same sequence, the release not waiting for the engine's copies. The copies are
    asynchronous (apply_to_module queues them), so the lease went while they waited behind the kernel,
    and the IN_PLACE push rewrote the store under them: the module gets v2's bytes, not v1's."""
    first, second, held, pending = follow_then_overwrite(cuda_server, monkeypatch, synchronize=False,
                                                         sleep_cycles=5 * SLEEP_CYCLES)
    assert pending, "the push took longer than the queued kernel: this control shows nothing (raise sleep_cycles)"
    with pytest.raises(AssertionError):
        assert_same_bytes(held, first)
    assert_same_bytes(held, second)  # every copy ran after the push had rewritten the store


@pytest.mark.parametrize("engine_device", ["cuda:0", "cpu"])
def test_apply_to_module_queues_its_copies_and_the_release_waits_for_them(cuda_server, engine_device):
    """apply_to_module returns with its copies from the store still queued behind a long kernel (from the
    pinned mapping of a CUDA engine); the snapshot's release waits for them before the lease goes, also
    when the EngineClient was opened on the CPU (the devices copied to join the snapshot's)."""
    model = {n: t.cpu() for n, t in gpu_model(12, scale=32).items()}
    module, name_map = module_like(model)
    with WeightSyncClient(cuda_server.address, timeout=120) as client:
        client.push(model, version="v1", transport="inline", allow_new_tensors=True)
    with EngineClient(server=cuda_server.address, name="apply", device=engine_device) as engine:
        with engine.acquire():  # map (and pin) the store before the kernel is queued
            pass
        snapshot = engine.acquire()
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        slept = torch.cuda.Event()
        slept.record()
        apply_to_module(module, snapshot, name_map=name_map)
        if engine_device == "cuda:0":  # from pageable memory CUDA may wait for the stream before it copies
            assert not slept.query(), "apply_to_module waited for its copies: they are not asynchronous"
        assert snapshot.devices == frozenset({torch.device("cuda", 0)})
        snapshot.release(applied=True)
        assert slept.query(), "the lease went before the engine's copies ran"
    assert_same_bytes({n: getattr(module, name_map[n]) for n in model}, model)


def test_a_killed_cuda_worker_loses_nothing(cuda_server):
    """The store is host memory the server keeps: a CUDA worker's death costs no weights (it used to be
    LOST until a full update refilled it)."""
    with WeightSyncClient(cuda_server.address, timeout=120) as client:
        client.push(gpu_model(20), version="v1", transport="inline", allow_new_tensors=True)
        pid = info(cuda_server).workers[0].pid
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: info(cuda_server).workers[0].state == pb.WORKER_STATE_RUNNING
                 and info(cuda_server).workers[0].pid != pid, timeout=120)
        assert info(cuda_server).store_state == pb.STORE_STATE_CONSISTENT
        assert_same_bytes(mapped_copy(cuda_server, "cuda:0"), gpu_model(20))
        client.push(gpu_model(21), version="v2", transport="inline")  # a partial update is fine: nothing was lost
        assert_same_bytes(mapped_copy(cuda_server, "cuda:0"), gpu_model(21))


def test_staged_in_place_and_abort_on_a_cuda_worker(cuda_server):
    from weightsync.client import UpdateFailed

    with WeightSyncClient(cuda_server.address, timeout=120) as client:
        client.push(gpu_model(30), version="v1", mode="in_place", transport="inline", allow_new_tensors=True)
        client.push(gpu_model(31), version="v2", mode="staged", transport="inline")
        assert_same_bytes(mapped_copy(cuda_server, "cuda:0"), gpu_model(31))

        def abort_after_first(report) -> None:
            if report.bucket == 1:
                raise RuntimeError("trainer gives up")

        for mode in ("staged", "in_place"):
            with pytest.raises((UpdateFailed, RuntimeError)):
                client.push(gpu_model(32), version="aborted", mode=mode, transport="inline",
                            bucket_size_bytes=1 << 18, progress=abort_after_first)
            if mode == "staged":  # the base, bit for bit
                assert info(cuda_server).store_state == pb.STORE_STATE_CONSISTENT
                assert_same_bytes(mapped_copy(cuda_server, "cuda:0"), gpu_model(31))
            else:
                assert info(cuda_server).store_state == pb.STORE_STATE_INCONSISTENT
        client.push(gpu_model(33), version="v3", mode="in_place", transport="inline")
        assert client.verify(gpu_model(33)).ok


def test_the_device_lane_takes_a_staging_buffer_again_only_after_the_copy_out_of_it_ran():
    """A CUDA worker's NCCL path, in this process: three buckets through the two device staging buffers.
    The copy out of bucket 0 (slot 0) is held on the lane's copy stream behind a long kernel; bucket 2
    takes slot 0 again and its "broadcast" writes it at once: unless that write waits on device for
    slot 0's copy-out event, bucket 0 reaches the store as bucket 2's bytes. Each "broadcast" writes
    its buffer behind a kernel on the current stream (the copy out waits for it through an event; the
    tail check reads the buffer too). Commit waits for every copy. Staging is the only device memory
    the receiver holds, and release gives it back."""
    import mmap as mmap_module

    from weightsync.gpu_worker.memory import map_arena
    from weightsync.gpu_worker.receiver import Receiver
    from weightsync.worker.v1 import worker_pb2 as wpb

    size, buckets = 4 << 20, 3
    fd = os.memfd_create("arena")
    os.ftruncate(fd, size * buckets)
    receiver = Receiver(torch.device("cuda:0"))
    torch.cuda.synchronize()
    allocated_before = torch.cuda.memory_allocated(0)
    receiver.maps.add(map_arena(1, os.dup(fd), size * buckets, torch.device("cuda:0")))
    assert receiver.maps.arenas[1].pinned, "the store mapping is pinned for DMA"

    def prepare(update_id: str) -> None:
        command = wpb.PrepareUpdateCommand(update_id=update_id, group_id="g", staged=False,
                                           largest_bucket_bytes=size)
        for k in range(buckets):
            command.buckets.add(sequence=k, size_bytes=size,
                                receive_into=wpb.Region(arena_id=1, offset_bytes=k * size))
        receiver.prepare(command, device_lane=True)

    def receive(update_id: str, k: int) -> None:
        value = k + 1 if update_id == "u" else k + 101  # the warm-up's bytes differ from the checked update's

        def broadcast(buffer: torch.Tensor) -> None:  # what NCCL writes, queued behind a kernel
            torch.cuda._sleep(SLEEP_CYCLES // 8)
            buffer.fill_(value)

        tail = bytes([value]) * BUCKET_TAIL_BYTES  # the bucket's last bytes, as the trainer announces them
        receive = wpb.ReceiveBucketCommand(update_id=update_id, sequence=k, size_bytes=size, tail=tail)
        applied = receiver.receive_collective(receive, broadcast, device_lane=True)
        assert applied is not None and applied.fast_path

    # A first update through the same path, so that no first use (a kernel's lazy loading, a first
    # allocation) runs while slot 0's copy out is held below: the first GPU run (H200) found the hold
    # over before bucket 1 was received.
    prepare("warm-up")
    for k in range(buckets):
        receive("warm-up", k)
    receiver.commit("warm-up")
    prepare("u")
    lane = receiver.lane
    assert lane is not None
    assert torch.cuda.memory_allocated(0) - allocated_before == 2 * size  # two staging buffers, nothing else

    with torch.cuda.stream(lane.copy_stream):
        torch.cuda._sleep(4 * SLEEP_CYCLES)  # bucket 0's copy out of slot 0 queues behind this (~4 s)
    started = time.monotonic()
    receive("u", 0)
    receive("u", 1)
    assert lane.copied[0] is not None and not lane.copied[0].query(), \
        f"bucket 0's copy out already ran ({time.monotonic() - started:.2f} s after the hold began, which should " \
        "last ~4 s): the reuse of slot 0 below would show nothing"
    receive("u", 2)  # slot 0 again
    receiver.commit("u")  # waits for the copy stream
    with mmap_module.mmap(fd, size * buckets, prot=mmap_module.PROT_READ) as view:
        held = torch.frombuffer(bytearray(view), dtype=torch.uint8)
    for k in range(buckets):
        got = torch.unique(held[k * size : (k + 1) * size]).tolist()
        assert got == [k + 1], f"bucket {k}: the store holds bytes {got[:4]}: a staging buffer was written " \
                               "before the copy out of it ran, or the copy ran before the receive"
    receiver.release()
    assert torch.cuda.memory_allocated(0) == allocated_before
    os.close(fd)


def test_a_cuda_worker_gives_its_device_staging_back_at_an_abort():
    """Through the worker's command handling, in this process: a prepare that takes the device lane (as an
    NCCL group's does; joining one needs two GPUs) allocates two staging buffers on the GPU; the abort
    gives them back, and torch's cached blocks with them (empty_cache); the next update allocates again."""
    from weightsync.common.shm_queue import OwnedQueue
    from weightsync.gpu_worker.worker import Worker
    from weightsync.worker.v1 import worker_pb2 as wpb

    size = 64 << 20
    commands, events = OwnedQueue(1 << 16), OwnedQueue(1 << 16)
    config = wpb.WorkerConfig(index=0, device="cuda:0", queue_capacity_bytes=1 << 16, parent_pid=os.getpid())
    worker = Worker(config, commands.queue, events.queue, None)
    worker._device_lane = lambda group_id: True  # as for an NCCL group
    ids = iter(range(1, 100))

    def send(**command) -> wpb.WorkerEvent:
        worker._dispatch(wpb.WorkerCommand(command_id=next(ids), **command).SerializeToString())
        event = wpb.WorkerEvent.FromString(events.queue.get(timeout=30))
        assert event.WhichOneof("event") != "command_failed", event.command_failed
        return event

    def prepare(update_id: str) -> wpb.WorkerEvent:
        return send(prepare_update=wpb.PrepareUpdateCommand(update_id=update_id, staged=False,
                                                            largest_bucket_bytes=size))

    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        allocated, reserved = torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)
        prepared = prepare("u1").update_prepared
        assert prepared.staging_on_device and prepared.staging_bytes == 2 * size
        assert torch.cuda.memory_allocated(0) - allocated == 2 * size
        aborted = send(abort_update=wpb.AbortUpdateCommand(update_id="u1"))
        assert aborted.status.staging_bytes == 0
        assert torch.cuda.memory_allocated(0) == allocated
        assert torch.cuda.memory_reserved(0) <= reserved, "the staging stayed in torch's cache"
        assert prepare("u2").update_prepared.staging_bytes == 2 * size  # the next update allocates again
        committed = send(commit_update=wpb.CommitUpdateCommand(update_id="u2"))
        assert committed.status.staging_bytes == 2 * size  # kept for the update after
        assert send(leave_group=wpb.LeaveGroupCommand(group_id="g")).status.staging_bytes == 0
        assert torch.cuda.memory_allocated(0) == allocated
    finally:
        commands.close()
        events.close()


@pytest.mark.parametrize("proto_dtype", SUPPORTED_PROTO_DTYPES)
def test_device_ws64_equals_the_cpu_reference(proto_dtype):
    dtype = entry_for_proto(proto_dtype).torch_dtype
    raw = torch.randint(0, 256, (4099 * 8 + 5,), dtype=torch.uint8)
    size = torch.tensor([], dtype=dtype).element_size()
    cpu = raw[: raw.numel() // size * size].view(dtype)
    assert ws64(cpu.cuda()) == ws64(cpu)


def test_the_kept_delta_copy_waits_for_the_callers_stream():
    """The kept copy (delta) is refreshed in a thread of its own: its copies must wait for the
    writes the caller's stream queued, or it keeps stale bytes and the next patch is wrong."""
    from weightsync.client.delta.base import DeltaBase

    base = DeltaBase()
    first = gpu_model(1)
    base.committed(list(first.items()), None, {"s": 1})
    torch.cuda.synchronize()
    second = gpu_model(2)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # the caller writes on a stream the thread does not use
        written_behind_a_sleep(second)  # still being written when the thread starts
        base.take_in_background(list(second.items()), None)
    base.committed(list(second.items()), None, {"s": 2})
    assert_same_bytes(base.tensors, second)
    nxt = {n: t.clone() for n, t in second.items()}
    for t in nxt.values():
        t.view(-1)[:1] += 1
    choice = base.choose(list(nxt.items()), auto=False)
    assert {n: p.checksum for n, p in choice.patches.items()} == {n: ws64(t) for n, t in nxt.items() if n in choice.patches}


@pytest.mark.parametrize("transport", ["inline", "collective"])
def test_cuda_tensors_pushed_as_patches_land_exactly(cuda_server, transport):
    """Sparse steps of CUDA tensors, written on the caller's stream behind a long kernel, pushed as
    patches: the compare reads them on that stream, and the kept copy, updated in its own thread
    while the patches move, waits for the writes before it takes them (a stale copy makes the next
    step's patch wrong, which the WS64 in the plan turns into DATA_LOSS)."""
    with WeightSyncClient(cuda_server.address, timeout=120) as client:
        if transport == "collective":
            client.create_group(backend="auto", timeout=60)  # a worker on this GPU: auto picks Gloo
        model = gpu_model(50)
        client.push(model, version="v0", transport=transport, allow_new_tensors=True, delta=True)
        for step in range(1, 4):
            torch.cuda._sleep(SLEEP_CYCLES)
            for tensor in model.values():
                tensor.view(-1)[step::97] += 1  # ~1% of the elements, behind the sleep
            mode = "staged" if step % 2 else "in_place"
            result = client.push(model, version=f"v{step}", mode=mode, transport=transport, delta=True)
            assert result.bytes_sent < 0.1 * result.dense_bytes, f"step {step} did not go as patches"
            assert client.verify(model).ok, f"step {step}: the store holds other bytes than the trainer's"
            assert_same_bytes(mapped_copy(cuda_server, "cuda:0"), model)


@pytest.mark.parametrize("transport", ["inline", "collective"])
def test_deferred_buckets_reach_a_cuda_worker(cuda_server, transport, monkeypatch):
    """Host tensors compared while their patches travel (deferred buckets; the link declared slow):
    the CUDA worker takes each bucket's route from its receive command, not from the prepare, and
    writes the patches into the host store bit for bit."""
    from weightsync.client.delta import deferred
    from weightsync.client.delta import policy as delta_policy

    monkeypatch.setattr(delta_policy, "DEFER_BELOW_BYTES_PER_SECOND", float("inf"))
    monkeypatch.setattr(deferred, "MIN_GROUP_BYTES", 64 << 10)
    with WeightSyncClient(cuda_server.address, timeout=120) as client:
        if transport == "collective":
            client.create_group(backend="auto", timeout=60)  # host tensors: Gloo
        model = {n: t.cpu() for n, t in gpu_model(70).items()}
        client.push(model, version="v0", transport=transport, allow_new_tensors=True, delta=True)
        for step in range(1, 4):
            for tensor in model.values():
                tensor.view(-1)[step::97] += 1
            mode = "staged" if step % 2 else "in_place"
            result = client.push(model, version=f"v{step}", mode=mode, transport=transport, delta=True)
            assert result.bytes_sent < 0.1 * result.dense_bytes, f"step {step} did not go as patches"
            assert client.verify(model).ok, f"step {step}"
            assert_same_bytes(mapped_copy(cuda_server, "cuda:0"), model)
