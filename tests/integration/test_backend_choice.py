"""Which backend a transfer group gets: never NCCL with two ranks on one GPU (decided on CPU, by UUID)."""

from __future__ import annotations

import pytest

from weightsync.client.errors import WeightSyncClientError
from weightsync.client.transports.transfer_group import (
    ServerDevices,
    choose_backend,
    normalize_uuid,
)
from weightsync.v1 import weight_sync_service_pb2 as pb

GLOO, NCCL = pb.BACKEND_GLOO, pb.BACKEND_NCCL
MINE = "GPU-5b2c1e0a-8f3d-4c1b-9a7e-0d4f6a1b2c3d"
OTHER = "GPU-11111111-2222-3333-4444-555555555555"
THIRD = "GPU-99999999-8888-7777-6666-555555555555"


def gpu_server(address: str, *uuids: str) -> ServerDevices:
    return ServerDevices(address, frozenset({GLOO, NCCL}), uuids)


CHOICES = [
    # name, requested, trainer uuid, servers, chosen
    ("auto, no CUDA here", "auto", None, [gpu_server("a:1", OTHER)], GLOO),
    ("auto, other GPUs", "auto", MINE, [gpu_server("a:1", OTHER), gpu_server("b:1", THIRD)], NCCL),
    ("auto, a worker on my GPU", "auto", MINE, [gpu_server("a:1", OTHER), gpu_server("b:1", THIRD, MINE)], GLOO),
    ("auto, same GPU spelled by torch", "auto", MINE.removeprefix("GPU-"), [gpu_server("a:1", MINE.upper())], GLOO),
    ("auto, a CPU server", "auto", MINE, [ServerDevices("a:1", frozenset({GLOO}), ("",))], GLOO),
    ("auto, UUIDs not reported yet", "auto", MINE, [gpu_server("a:1", "", "")], NCCL),
    ("gloo on my GPU", "gloo", MINE, [gpu_server("a:1", MINE)], GLOO),
    ("nccl, other GPUs", "nccl", MINE, [gpu_server("a:1", OTHER)], NCCL),
]


@pytest.mark.parametrize(("requested", "trainer", "servers", "chosen"), [c[1:] for c in CHOICES],
                         ids=[c[0] for c in CHOICES])
def test_backend_choice(requested, trainer, servers, chosen):
    assert choose_backend(requested, trainer_gpu_uuid=trainer, servers=servers) == chosen


def test_nccl_forced_on_a_shared_gpu_is_refused_naming_the_worker():
    servers = [gpu_server("a:1", OTHER), gpu_server("b:1", THIRD, MINE)]
    with pytest.raises(WeightSyncClientError) as caught:
        choose_backend("nccl", trainer_gpu_uuid=MINE, servers=servers)
    message = str(caught.value)
    assert "worker 1 of b:1 runs on this process's GPU" in message
    assert normalize_uuid(MINE) in message and "backend='gloo'" in message


def test_a_backend_a_server_lacks_is_refused_naming_it():
    with pytest.raises(WeightSyncClientError, match="a:1 does not offer BACKEND_NCCL"):
        choose_backend("nccl", trainer_gpu_uuid=MINE, servers=[ServerDevices("a:1", frozenset({GLOO}), ("",))])
    with pytest.raises(ValueError, match="backend must be"):
        choose_backend("mpi", trainer_gpu_uuid=None, servers=[])


def test_uuid_spellings():
    assert normalize_uuid("GPU-ABC-def") == normalize_uuid("abc-DEF") == "abc-def"


def test_a_server_with_cuda_workers_offers_gloo_so_auto_on_a_shared_gpu_works(monkeypatch):
    """Every worker receives a Gloo transfer into host memory (the node's store), whatever its device: a
    trainer on a worker's GPU gets Gloo from "auto", and the server offers it (it used to offer NCCL alone,
    so auto picked Gloo and then failed with "does not offer BACKEND_GLOO")."""
    from types import SimpleNamespace

    from weightsync.server.workers import backends

    monkeypatch.setattr(backends, "available_backends", lambda: [GLOO, NCCL])  # a CUDA build
    workers = [SimpleNamespace(device="cuda:0"), SimpleNamespace(device="cuda:1")]
    offered = backends.available_backends_for(workers)
    assert offered == [GLOO, NCCL]
    server = ServerDevices("a:1", frozenset(offered), (OTHER, MINE))
    assert choose_backend("auto", trainer_gpu_uuid=MINE, servers=[server]) == GLOO
    assert choose_backend("auto", trainer_gpu_uuid=THIRD, servers=[server]) == NCCL


def test_a_real_servers_offer_is_what_backend_choice_sees(server):
    import grpc

    from weightsync.v1 import weight_sync_service_pb2_grpc as pb_grpc

    info = pb_grpc.WeightSyncServiceStub(grpc.insecure_channel(server.address)).GetServerInfo(
        pb.GetServerInfoRequest(), timeout=10)
    devices = ServerDevices.of(server.address, info)
    assert devices.backends == frozenset({GLOO})  # CPU workers, no NCCL in this build
    assert choose_backend("auto", trainer_gpu_uuid=MINE, servers=[devices]) == GLOO


# -- two servers' workers on one GPU: never one NCCL group --------------------------------------------------
CROWDED = [
    # name, requested, trainer uuid, servers, chosen (None: refused)
    ("auto, two servers' workers on one GPU", "auto", MINE, [gpu_server("a:1", OTHER), gpu_server("b:1", OTHER)], GLOO),
    ("auto, one server's two workers on one GPU", "auto", MINE, [gpu_server("a:1", THIRD, THIRD.lower())], GLOO),
    ("auto, every worker on its own GPU", "auto", MINE, [gpu_server("a:1", OTHER), gpu_server("b:1", THIRD)], NCCL),
    ("auto, UUIDs not reported", "auto", MINE, [gpu_server("a:1", ""), gpu_server("b:1", "")], NCCL),
    ("gloo, two servers on one GPU", "gloo", MINE, [gpu_server("a:1", OTHER), gpu_server("b:1", OTHER)], GLOO),
    ("nccl, two servers on one GPU", "nccl", MINE, [gpu_server("a:1", OTHER), gpu_server("b:1", OTHER)], None),
]


@pytest.mark.parametrize(("requested", "trainer", "servers", "chosen"), [c[1:] for c in CROWDED],
                         ids=[c[0] for c in CROWDED])
def test_workers_sharing_a_gpu_never_get_nccl(requested, trainer, servers, chosen):
    if chosen is None:
        with pytest.raises(WeightSyncClientError) as caught:
            choose_backend(requested, trainer_gpu_uuid=trainer, servers=servers)
        assert str(caught.value).startswith(
            f"backend 'nccl': worker 0 of a:1 and worker 0 of b:1 run on one GPU ({normalize_uuid(OTHER)})")
    else:
        assert choose_backend(requested, trainer_gpu_uuid=trainer, servers=servers) == chosen


# -- a CPU-only trainer on a GPU host never makes a CUDA context -----------------------------------------
def test_the_trainers_gpu_is_asked_for_only_when_this_process_already_uses_cuda(monkeypatch):
    import torch

    from weightsync.client.transports.transfer_group import trainer_cuda_device

    asked = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: asked.append(1) or 3)
    table = [  # available, initialized -> device (current_device() asked)
        (False, False, None),
        (True, False, None),  # a GPU host, CUDA never touched here: no context on GPU 0
        (True, True, torch.device("cuda", 3)),
    ]
    for available, initialized, device in table:
        asked.clear()
        assert trainer_cuda_device(available=available, initialized=initialized) == device
        assert asked == ([1] if device is not None else [])
