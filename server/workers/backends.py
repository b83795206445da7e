"""The collective backends this node's workers offer a trainer (GetServerInfo.backends)."""

from __future__ import annotations

from weightsync.common.collective import available_backends
from weightsync.server.workers.supervisor import WorkerHandle
from weightsync.v1 import weight_sync_service_pb2 as pb


def available_backends_for(workers: list[WorkerHandle]) -> list[int]:
    """Gloo always: every worker receives a Gloo transfer into host memory, the node's store, whatever its
    device (so a trainer on a worker's GPU, which NCCL cannot put in a group with it, still has a
    collective); NCCL too when the workers sit on CUDA devices and the build has it."""
    if any(w.device.startswith("cuda") for w in workers) and pb.BACKEND_NCCL in available_backends():
        return [pb.BACKEND_GLOO, pb.BACKEND_NCCL]
    return [pb.BACKEND_GLOO]
