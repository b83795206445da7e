"""Parts over COLLECTIVE: the group's backend answers for every part's GPU (part_group.parts_backend), not
part 0's alone: a part on a worker's GPU, a part without CUDA, or two parts on one GPU make 'auto' Gloo and
'nccl' refused naming them (before, part 0 chose NCCL from its own GPU and the other part failed at its first
send, or at create_group after part 0 had gone on to the rendezvous)."""

from __future__ import annotations

import re

import pytest

from weightsync.client.errors import WeightSyncClientError
from weightsync.client.parts.group import parts_backend
from weightsync.client.transports.transfer_group import ServerDevices
from weightsync.v1 import weight_sync_service_pb2 as pb

GLOO, NCCL = pb.BACKEND_GLOO, pb.BACKEND_NCCL
P0, P1, W0, W1 = "GPU-00000000-0000-0000-0000-000000000001", "GPU-00000000-0000-0000-0000-000000000002", \
    "GPU-00000000-0000-0000-0000-000000000003", "GPU-00000000-0000-0000-0000-000000000004"


def server(*uuids: str) -> ServerDevices:
    return ServerDevices("a:1", frozenset({GLOO, NCCL}), uuids)


CHOICES = [
    # name, requested, parts' GPUs, workers' GPUs, chosen
    ("auto, every part on a GPU of its own", "auto", [P0, P1], [W0, W1], NCCL),
    ("auto, part 1 on a worker's GPU", "auto", [P0, P1], [W0, P1], GLOO),
    ("auto, part 1 without CUDA", "auto", [P0, ""], [W0, W1], GLOO),
    ("auto, two parts on one GPU", "auto", [P0, P0], [W0, W1], GLOO),
    ("gloo", "gloo", [P0, P1], [W0, P1], GLOO),
    ("nccl, GPUs of their own", "nccl", [P0, P1], [W0, W1], NCCL),
]


@pytest.mark.parametrize(("requested", "parts", "workers", "chosen"), [c[1:] for c in CHOICES],
                         ids=[c[0] for c in CHOICES])
def test_parts_backend(requested, parts, workers, chosen):
    assert parts_backend(requested, part_gpu_uuids=parts, servers=[server(*workers)]) == chosen


@pytest.mark.parametrize(("parts", "workers", "says"), [
    ([P0, P1], [W0, P1], "worker 1 of a:1 runs on this process's GPU"),
    ([P0, ""], [W0, W1], "part(s) [1] use no CUDA device"),
    ([P0, P0], [W0, W1], "parts [0, 1] run on one GPU"),
], ids=["part 1 on a worker's GPU", "part 1 without CUDA", "two parts on one GPU"])
def test_nccl_refused_naming_the_part(parts, workers, says):
    with pytest.raises(WeightSyncClientError, match=re.escape(says)):
        parts_backend("nccl", part_gpu_uuids=parts, servers=[server(*workers)])
