"""Parts over COLLECTIVE with CUDA (issue 35): two trainer processes (this file run as a script, one Gloo
group of their own for Part.group) call create_group() on both ranks and push their halves, CUDA tensors
written behind a long kernel, over one transfer group of both parts' ranks and the server's worker.

(a) One GPU: the parts and the server's CUDA worker share cuda:0, which NCCL refuses (two ranks of one
    communicator on one device: tests/gpu/test_nccl_one_gpu.py), so backend "auto" builds a Gloo group: each
    part packs its CUDA tensors into host buckets (every read after the copies into them) and sends each
    point-to-point to the CUDA worker, which takes them on its host lane in the one global order. Two steps,
    one generation each for both parts, each rank's verify clean, and the store bit for bit through a CUDA
    engine's mapping.
(b) Three GPUs (skipped with a reason on fewer): part r on cuda:r, the worker on cuda:2, backend "nccl". Over
    NCCL with several trainer ranks a part sends each bucket point-to-point (not a broadcast) from its device
    pack buffer, each send on its stream after the pack copies, the worker receiving into its device staging
    in the one global order, every wait polled against the group's timeout. Same checks.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import pytest
import torch

STEPS = (("v1", 1), ("v2", 2))
"""(version, seed) of the parts' pushes; v2's tensors are written behind a long kernel."""
BUCKET_BYTES = 65536
"""Several buckets per part: more than the two a sink keeps in flight."""
GROUP_TIMEOUT = 60.0
TRAINER_TIMEOUT_S = 200


def half(rank: int, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A rank's whole CUDA tensors (the same bytes in every process, whatever its GPU)."""
    g = torch.Generator().manual_seed(seed * 10 + rank)
    if rank == 0:
        tensors = {"n.embed": torch.randn(512, 256, generator=g).to(torch.bfloat16),
                   "n.w": torch.randn(1000, 33, generator=g)}
    else:
        tensors = {"n.b": torch.randn(333, generator=g).half(),
                   "n.steps": torch.arange(77, dtype=torch.int64) + seed,
                   "n.v": torch.randn(40000, generator=g)}
    return {name: tensor.to(device) for name, tensor in tensors.items()}


def expected(rank: int, version: str) -> dict[str, torch.Tensor]:
    tensors = half(rank, dict(STEPS)[version], torch.device("cuda", 0))
    if version == "v2":
        for tensor in tensors.values():
            tensor.add_(1)
    return tensors


# -- the trainer: this file as a script -------------------------------------------------------------------
def trainer_main() -> None:
    """python test_nccl_parts.py RANK WORLD PORT SERVER OUT_DIR BACKEND GPU_OF_RANK0."""
    import torch.distributed as dist

    from weightsync.client import Part, WeightSyncClient

    from gpukit import written_behind_a_sleep

    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    server, out_dir, backend, first_gpu = sys.argv[4], Path(sys.argv[5]), sys.argv[6], int(sys.argv[7])
    device = torch.device("cuda", first_gpu + rank if backend == "nccl" else first_gpu)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))
    out: dict = {}
    part = Part(rank=rank, world=world, group=dist.group.WORLD, join_timeout=90)
    with WeightSyncClient(server, part=part) as client:
        torch.zeros(1, device=device)  # this process uses CUDA: its GPU counts for the backend's choice
        client.create_group(backend=backend, timeout=GROUP_TIMEOUT)
        group = client._group
        out["group"] = {"backend": group.backend, "rank": group.rank, "trainer_ranks": group.trainer_ranks,
                        "device": str(group.device)}
        for version, seed in STEPS:
            tensors = half(rank, seed, device)
            torch.cuda.synchronize()
            if version == "v2":
                tensors = written_behind_a_sleep(tensors)  # pushed at once: the sends must wait for the writes
            result = client.push(tensors, version=version, mode="staged", transport="collective",
                                 allow_new_tensors=True, bucket_size_bytes=BUCKET_BYTES)
            out[version] = {o.server: o.generation for o in result.servers}
            out[f"{version}_buckets"] = result.bucket_count
            out[f"{version}_mismatches"] = [m.name for m in client.verify(tensors).mismatches]
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpukit
    trainer_main()
    sys.exit(0)


# -- the tests --------------------------------------------------------------------------------------------
from weightsync.v1 import weight_sync_service_pb2 as pb  # noqa: E402

from gpukit import assert_same_bytes, mapped_copy  # noqa: E402
from helpers import free_port, run_ranks, start_server  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def run_parts(server, tmp_path: Path, backend: str) -> tuple[dict, dict]:
    before = server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=30).current_version.generation
    zero, one = run_ranks([__file__, "{rank}", "2", str(free_port()), server.address, str(tmp_path), backend, "0"],
                          2, tmp_path, TRAINER_TIMEOUT_S)
    for k, (version, _) in enumerate(STEPS):
        assert zero[version] == one[version] == {server.address: before + 1 + k}
        assert zero[f"{version}_buckets"] > 2 and one[f"{version}_buckets"] > 2
        assert zero[f"{version}_mismatches"] == one[f"{version}_mismatches"] == []
    assert (zero["group"]["rank"], one["group"]["rank"]) == (0, 1)
    assert zero["group"]["trainer_ranks"] == one["group"]["trainer_ranks"] == 2
    copied = mapped_copy(server, "cuda")
    wanted = {**expected(0, "v2"), **expected(1, "v2")}
    assert_same_bytes({n: copied[n] for n in wanted}, wanted)
    return zero, one


def test_two_parts_on_the_workers_gpu_push_over_one_gloo_group(cuda_server, tmp_path):
    zero, one = run_parts(cuda_server, tmp_path, "auto")
    # The parts share cuda:0 with the worker: NCCL is ruled out, Gloo carries host buckets.
    assert zero["group"]["backend"] == one["group"]["backend"] == pb.BACKEND_GLOO
    assert zero["group"]["device"] == one["group"]["device"] == "cpu"


@pytest.mark.skipif(torch.cuda.device_count() < 3,
                    reason="needs 3 GPUs (two parts and a worker, one GPU each: NCCL refuses two ranks on one GPU)")
def test_two_parts_push_point_to_point_over_nccl(tmp_path):
    server = start_server(tmp_path, "--local-socket", "auto", workers=0, devices="cuda:2")
    try:
        zero, one = run_parts(server, tmp_path, "nccl")
        assert zero["group"]["backend"] == one["group"]["backend"] == pb.BACKEND_NCCL
        assert (zero["group"]["device"], one["group"]["device"]) == ("cuda:0", "cuda:1")
    finally:
        assert server.stop() == 0, server.log()[-3000:]
