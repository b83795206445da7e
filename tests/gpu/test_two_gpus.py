"""What needs two GPUs: NCCL groups (NCCL refuses two ranks on one GPU), that torch's watchdog and
heartbeat monitor never terminate a process after a failed broadcast of ours, engine ranks on
different GPUs reading the one store, a communicator that never forms.

The trainer is on cuda:0, the server's worker on cuda:1; engine ranks on both GPUs read the host store,
whatever GPU the workers are on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from weightsync.client import UpdateFailed, WeightSyncClient
from weightsync.v1 import weight_sync_service_pb2 as pb

from gpukit import gpu_model, info
from helpers import start_server, wait_for

pytestmark = [pytest.mark.two_gpus, pytest.mark.timeout(600)]
GROUP_TIMEOUT = 20.0


@pytest.fixture
def server_on_gpu1(tmp_path):
    server = start_server(tmp_path, "--local-socket", "auto", devices="cuda:1")
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def test_nccl_push_staged_in_place_and_verify(server_on_gpu1):
    with WeightSyncClient(server_on_gpu1.address, timeout=120) as client:
        client.create_group(backend="nccl", timeout=GROUP_TIMEOUT)
        for step, mode in enumerate(("in_place", "staged", "in_place")):
            model = gpu_model(step)
            client.push(model, version=f"v{step}", mode=mode, allow_new_tensors=True, bucket_size_bytes=1 << 20)
            assert client.verify(model).ok
    worker = info(server_on_gpu1).workers[0]
    assert worker.staging_on_device and worker.staging_bytes == 2 << 20  # two buffers of the largest bucket


def test_patches_over_nccl_land_exactly_from_the_workers_staging(server_on_gpu1):
    """Patched buckets received by NCCL into a CUDA worker's staging buffer: copied to the host,
    checked as they are applied to the store, next to the dense copies the copy stream makes."""
    with WeightSyncClient(server_on_gpu1.address, timeout=120) as client:
        client.create_group(backend="nccl", timeout=GROUP_TIMEOUT)
        model = gpu_model(60)
        client.push(model, version="v0", allow_new_tensors=True, delta=True)
        for step in range(1, 4):
            for tensor in model.values():
                tensor.view(-1)[step::97] += 1
            mode = "staged" if step % 2 else "in_place"
            result = client.push(model, version=f"v{step}", mode=mode, delta=True)
            assert result.bytes_sent < 0.1 * result.dense_bytes, f"step {step} did not go as patches"
            assert client.verify(model).ok, f"step {step}"


def test_a_worker_killed_mid_broadcast_fails_the_push_and_the_trainer_lives_on(server_on_gpu1):
    """torch's watchdog would terminate the trainer about a minute after the failed broadcast:
    weightsync's groups must not let it. The trainer waits past that and pushes again."""
    with WeightSyncClient(server_on_gpu1.address, timeout=120) as client:
        client.create_group(backend="nccl", timeout=GROUP_TIMEOUT)
        client.push(gpu_model(1), version="v1", allow_new_tensors=True)
        victim = info(server_on_gpu1).workers[0].pid

        def kill_worker(report) -> None:
            if report.bucket == 0:
                os.kill(victim, signal.SIGKILL)

        started = time.monotonic()
        with pytest.raises(UpdateFailed):
            client.push(gpu_model(2, scale=64), version="v2", bucket_size_bytes=1 << 20, progress=kill_worker)
        assert time.monotonic() - started < GROUP_TIMEOUT + 30
        time.sleep(90)  # past torch's watchdog abort (60 s): with it the trainer would be gone by now
        wait_for(lambda: info(server_on_gpu1).workers[0].state == pb.WORKER_STATE_RUNNING, timeout=120)
        client.delete_group()
        client.create_group(backend="nccl", timeout=GROUP_TIMEOUT)
        client.push(gpu_model(3), version="v3", allow_new_tensors=True)
        assert client.verify(gpu_model(3)).ok


TRAINER = textwrap.dedent("""
    import sys, torch
    from weightsync.client import WeightSyncClient
    g = torch.Generator(device="cuda").manual_seed(5)
    model = {"w": torch.randn(64 << 20, device="cuda", generator=g)}
    client = WeightSyncClient(sys.argv[1], timeout=120)
    client.create_group(backend="nccl", timeout=float(sys.argv[2]))
    print("joined", flush=True)
    for step in range(1000):
        model["w"].add_(1)
        client.push(model, version=f"s{step}", bucket_size_bytes=1 << 20)
""")


def test_a_trainer_killed_mid_broadcast_leaves_the_worker_and_its_store(server_on_gpu1):
    with WeightSyncClient(server_on_gpu1.address, timeout=120) as client:
        client.push(gpu_model(4), version="kept", transport="inline", allow_new_tensors=True)
    worker_pid = info(server_on_gpu1).workers[0].pid
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, server_on_gpu1.address, str(GROUP_TIMEOUT)],
                               stdout=subprocess.PIPE, text=True)
    assert trainer.stdout.readline().strip() == "joined"
    time.sleep(3)  # mid-push
    trainer.kill()
    trainer.wait()
    time.sleep(GROUP_TIMEOUT + 90)  # the group's timeout, then past the watchdog's
    state = info(server_on_gpu1)
    assert state.workers[0].pid == worker_pid, "the worker was terminated (torch's NCCL watchdog?)"
    assert all(g.state == pb.GROUP_STATE_BROKEN for g in
               server_on_gpu1.stub().ListTransferGroups(pb.ListTransferGroupsRequest()).groups)
    with WeightSyncClient(server_on_gpu1.address, timeout=120) as client:
        client.push(gpu_model(6), version="after", transport="inline", mode="in_place")
        assert client.verify(gpu_model(6)).ok


def test_engine_ranks_on_two_gpus_read_the_one_store(server_on_gpu1):
    """Each rank sees its GPU as cuda:0 (as Ray arranges it), maps the node's one host store and reports
    under its own name, as vLLM's ranks do (NAME, NAME:tp1); the rank on GPU 0 has no worker on its GPU."""
    with WeightSyncClient(server_on_gpu1.address, timeout=120) as client:
        client.push(gpu_model(7), version="v1", transport="inline", allow_new_tensors=True)
    reader = textwrap.dedent("""
        import sys, torch
        from weightsync.engine import EngineClient
        with EngineClient(server=sys.argv[1], name=sys.argv[2], device="cuda:0") as engine:
            with engine.acquire() as snapshot:
                print(int(snapshot.tensors["steps"].to("cuda:0").sum().item()), flush=True)
                snapshot.applied = True
    """)
    for gpu, name in ((0, "rank"), (1, "rank:tp1")):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
        out = subprocess.run([sys.executable, "-c", reader, server_on_gpu1.address, name], env=env,
                             capture_output=True, text=True, timeout=120, check=True).stdout.split()
        assert int(out[0]) == int(gpu_model(7)["steps"].sum().item()), f"the rank on GPU {gpu}"
    engines = {e.name: e for e in info(server_on_gpu1).engines}
    assert {n: e.applied_version.version for n, e in engines.items()} == {"rank": "v1", "rank:tp1": "v1"}


MONITOR_TRAINER = textwrap.dedent("""
    # The trainer's own NCCL group comes first (the process's first group: its heartbeat monitor is the
    # one that kills on a dump signal), with a short heartbeat; then weightsync's group, whose push fails.
    import datetime, os, sys, time, torch, torch.distributed as dist
    os.environ["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] = "20"
    store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=30))
    own = dist.ProcessGroupNCCL(dist.PrefixStore("own", store), 0, 1)
    own.allreduce([torch.ones(1, device="cuda:0")]).wait()
    from weightsync.client import WeightSyncClient
    client = WeightSyncClient(sys.argv[1], timeout=120)
    client.create_group(backend="nccl", timeout=float(sys.argv[2]))
    print("joined", flush=True)
    try:
        client.push({"w": torch.randn(64 << 20, device="cuda:0")}, version="v", allow_new_tensors=True,
                    bucket_size_bytes=1 << 20)
    except Exception as error:
        print("failed", type(error).__name__, flush=True)
    time.sleep(float(sys.argv[3]))
    print("alive", flush=True)
""")


def test_the_trainers_own_groups_monitor_does_not_kill_it_after_our_failed_broadcast(server_on_gpu1):
    """Without TORCH_NCCL_BLOCKING_WAIT on our group, its watchdog would raise the process-wide dump flag and
    the trainer's own (first) group's monitor would kill the process a heartbeat timeout later (20 s here)."""
    trainer = subprocess.Popen([sys.executable, "-c", MONITOR_TRAINER, server_on_gpu1.address, str(GROUP_TIMEOUT),
                                "60"], stdout=subprocess.PIPE, text=True)
    assert trainer.stdout.readline().strip() == "joined"
    victim = info(server_on_gpu1).workers[0].pid
    time.sleep(1)
    os.kill(victim, signal.SIGKILL)  # the push in flight fails
    out = trainer.communicate(timeout=GROUP_TIMEOUT + 120)[0]
    assert trainer.returncode == 0 and out.strip().endswith("alive"), out


def test_a_communicator_that_never_forms_fails_at_the_deadline_and_leaves_nothing(server_on_gpu1):
    """A group whose world size counts a rank that never comes: DEADLINE_EXCEEDED at the group
    timeout, then the server takes the next group at once."""
    import datetime

    import grpc
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    request = pb.CreateTransferGroupRequest(group_id="never", store_host="127.0.0.1", store_port=store.port,
                                            world_size=3, rank_offset=1, backend=pb.BACKEND_NCCL)
    request.timeout.FromTimedelta(datetime.timedelta(seconds=10))
    with pytest.raises(grpc.RpcError) as caught:
        server_on_gpu1.stub().CreateTransferGroup(request, timeout=60)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    with WeightSyncClient(server_on_gpu1.address, timeout=120) as client:
        client.create_group(backend="nccl", timeout=GROUP_TIMEOUT)
        client.push(gpu_model(8), version="v1", allow_new_tensors=True)
        assert client.verify(gpu_model(8)).ok
