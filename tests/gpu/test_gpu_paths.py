"""The CUDA paths, on one GPU: ordering of copies, CUDA stores, IPC leases, device WS64.

The trainer's tensors are written on the current stream right behind a long
`torch.cuda._sleep`, then pushed at once: a push that reads them (or its pack buffers) before
those kernels ran sends stale bytes, and `verify` (WS64 on every worker) plus the bytes an
engine maps catch it. Engines get a long kernel queued before their copies, then an IN_PLACE
push follows at once: an engine that released its lease before its copies ran would read torn
bytes.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from weightsync.client import WeightSyncClient
from weightsync.common.checksum import ws64
from weightsync.common.dtypes import SUPPORTED_PROTO_DTYPES, entry_for_proto
from weightsync.engine import EngineClient, ModuleFollower
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
    if transport == "collective" and store == "cuda_server":
        pytest.skip("COLLECTIVE into a CUDA store is NCCL: trainer and worker need two GPUs (test_two_gpus.py)")
    server = request.getfixturevalue(store)
    device = "cuda:0" if store == "cuda_server" else "cpu"
    with WeightSyncClient(server.address, timeout=120) as client:
        if transport == "collective":
            client.create_group(backend="gloo", timeout=60)
        for step in range(3):
            model = written_behind_a_sleep(gpu_model(step))
            mode = "staged" if step % 2 else "in_place"
            client.push(model, version=f"v{step}", mode=mode, transport=transport, bucket_size_bytes=1 << 20,
                        allow_new_tensors=True)
            assert client.verify(model).ok, f"step {step}: a worker holds other bytes than the trainer's stream wrote"
            assert_same_bytes(mapped_copy(server, device), model)


def test_an_engine_keeps_its_lease_until_its_gpu_copies_ran(cuda_server):
    module = torch.nn.Module()
    first = gpu_model(10)
    for name, tensor in first.items():
        module.register_buffer(name.replace(".", "_"), torch.empty_like(tensor))
    name_map = {n: n.replace(".", "_") for n in first}
    with WeightSyncClient(cuda_server.address, timeout=120) as client:
        client.push(first, version="v1", transport="inline", allow_new_tensors=True)
        torch.cuda.synchronize()
        with EngineClient(server=cuda_server.address, name="module", device="cuda:0") as engine:
            follower = ModuleFollower(engine, module, name_map=name_map)
            torch.cuda._sleep(SLEEP_CYCLES)  # the follower's copies queue behind this
            assert follower.update()
            client.push(gpu_model(11), version="v2", mode="in_place", transport="inline")  # writes the live bytes
            torch.cuda.synchronize()
            assert_same_bytes({n: getattr(module, name_map[n]) for n in first}, first)  # v1 whole, never torn
            assert follower.update()
            torch.cuda.synchronize()
            assert_same_bytes({n: getattr(module, name_map[n]) for n in first}, gpu_model(11))


def test_a_restarted_cuda_worker_gives_fresh_handles(cuda_server):
    with WeightSyncClient(cuda_server.address, timeout=120) as client:
        client.push(gpu_model(20), version="v1", transport="inline", allow_new_tensors=True)
        assert_same_bytes(mapped_copy(cuda_server, "cuda:0"), gpu_model(20))
        pid = info(cuda_server).workers[0].pid
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: info(cuda_server).workers[0].state == pb.WORKER_STATE_RUNNING
                 and info(cuda_server).workers[0].pid != pid, timeout=120)
        assert info(cuda_server).store_state == pb.STORE_STATE_LOST  # device memory died with the process
        client.push(gpu_model(21), version="v2", transport="inline", allow_new_tensors=True)
        # Handles exported by the dead process would open freed memory: these must be the new arenas.
        assert_same_bytes(mapped_copy(cuda_server, "cuda:0"), gpu_model(21))


def test_staged_in_place_and_abort_on_a_cuda_store(cuda_server):
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


def test_admission_after_an_aborted_staged_update(cuda_server):
    """A STAGED update needs a shadow as large as the model; after an abort the shadow's memory
    sits in torch's cache of the worker: the retry must be admitted (it is this worker's own)."""
    from weightsync.client import UpdateFailed

    free, _total = torch.cuda.mem_get_info(0)
    elements = int(free * 0.30) // 4 // 2  # two float32 tensors: 30% of free memory, a shadow doubles it
    model = {"a": torch.ones(elements, device="cuda"), "b": torch.full((elements,), 2.0, device="cuda")}
    with WeightSyncClient(cuda_server.address, timeout=600) as client:
        client.push(model, version="v1", transport="inline", allow_new_tensors=True, bucket_size_bytes=256 << 20)
        del model
        torch.cuda.empty_cache()

        def abort_after_first(report) -> None:
            if report.bucket == 1:
                raise RuntimeError("trainer gives up")

        bigger = {"a": torch.full((elements,), 3.0, device="cuda"), "b": torch.full((elements,), 4.0, device="cuda")}
        with pytest.raises((UpdateFailed, RuntimeError)):
            client.push(bigger, version="aborted", mode="staged", transport="inline", bucket_size_bytes=256 << 20,
                        progress=abort_after_first)
        result = client.push(bigger, version="v2", mode="staged", transport="inline", bucket_size_bytes=256 << 20)
        assert result.version == "v2"
        assert client.verify(bigger).ok


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
    from weightsync.client.delta import DeltaBase

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
