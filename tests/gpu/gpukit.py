"""Shared by the GPU suite: a model on the GPU, writes queued behind a long kernel, byte checks."""

from __future__ import annotations

import torch

from weightsync.engine import EngineClient
from weightsync.v1 import weight_sync_service_pb2 as pb

SLEEP_CYCLES = 2_000_000_000
"""About a second of GPU time queued before the writes a push must wait for."""


def gpu_model(seed: int, scale: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "embed.weight": torch.randn(512 * scale, 256, device="cuda", generator=g).to(torch.bfloat16),
        "layer.0.w": torch.randn(1000, 333, device="cuda", generator=g),
        "layer.0.b": torch.randn(333, device="cuda", generator=g).half(),
        "steps": torch.arange(77, device="cuda", dtype=torch.int64) + seed,
    }


def written_behind_a_sleep(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Queue a long kernel, then change every tensor in place on the same (current) stream."""
    torch.cuda._sleep(SLEEP_CYCLES)
    for tensor in model.values():
        tensor.add_(1)
    return model  # nothing synchronized: the new values exist only once the queue drains


def info(server) -> pb.GetServerInfoResponse:
    return server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


def mapped_copy(server, device: str) -> dict[str, torch.Tensor]:
    with EngineClient(server=server.address, name="reader", device=device) as engine:
        with engine.acquire() as snapshot:
            copied = {n: t.clone() for n, t in snapshot.tensors.items()}
            torch.cuda.synchronize()
    return copied


def assert_same_bytes(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    for name in left:
        a = left[name].detach().cpu().contiguous().view(-1).view(torch.uint8)
        b = right[name].detach().cpu().contiguous().view(-1).view(torch.uint8)
        assert torch.equal(a, b), name
