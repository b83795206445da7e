"""Updates sent in parts, with CUDA on both sides (issue 35's parts had run on CPU workers and CPU tensors only).

(a) Two parts, raw INLINE UpdateWeights streams (tests/integration/test_box_parts.py's helpers), into a server whose one
    worker is a CUDA worker: boxes on dim 0 (row ranges), on dim 1 (column boxes), a rank-3 box, a box larger
    than a bucket (pieces that end mid-row) and a whole tensor, STAGED. Over INLINE a CUDA worker takes its
    buckets on the host lane: staging, checks, then one strided copy per sub-box into the pinned store. The
    store is read back bit for bit through a CUDA engine's mapping and with the SDK's verify. A box that
    fails its checksum aborts both parts, the store stays bit for bit, and the next push commits.
(b) Two trainer processes (this file run as a script), one Gloo group, whose tensors are CUDA tensors,
    written on their current stream behind a long kernel: each pushes its half with
    WeightSyncClient(part=Part(...)) over INLINE, STAGED, two steps; both get the same generation, each
    rank's verify finds nothing, and the store holds both halves bit for bit.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import pytest
import torch

TRAINER_STEPS = (("v1", 1), ("v2", 2))
"""(version, seed) of the trainers' pushes; v2's tensors are written behind a long kernel."""
BUCKETS = (1 << 20, 32768)
"""Rank 0's half is one bucket (~387 KiB), rank 1's ~81 KiB in pieces of 32 KiB: owners by bytes give rank 0's
bucket to worker 0 (the CUDA worker) and all of rank 1's to worker 1, so each part's bytes go through one
kind of worker (a worker owning buckets of both parts takes each part's in its own lane: tests/system/test_sdk_parts.py)."""
TRAINER_TIMEOUT_S = 150


def trainer_half(rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A rank's whole CUDA tensors (the same bytes in every process on the same GPU)."""
    g = torch.Generator(device="cuda").manual_seed(seed * 10 + rank)
    if rank == 0:
        return {"p.embed": torch.randn(512, 256, device="cuda", generator=g).to(torch.bfloat16),
                "p.w": torch.randn(1000, 33, device="cuda", generator=g)}
    return {"p.b": torch.randn(333, device="cuda", generator=g).half(),
            "p.steps": torch.arange(77, device="cuda", dtype=torch.int64) + seed,
            "p.v": torch.randn(20000, device="cuda", generator=g)}


def trainer_expected(rank: int, version: str) -> dict[str, torch.Tensor]:
    seed = dict(TRAINER_STEPS)[version]
    tensors = trainer_half(rank, seed)
    if version == "v2":
        for tensor in tensors.values():
            tensor.add_(1)
    return tensors


# -- (b)'s trainer: this file as a script ---------------------------------------------------------------
def trainer_main() -> None:
    """python test_gpu_parts.py RANK WORLD PORT SERVER OUT_DIR: push this rank's half of each step."""
    import torch.distributed as dist

    from weightsync.client import Part, WeightSyncClient

    from gpukit import written_behind_a_sleep

    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    server, out_dir = sys.argv[4], Path(sys.argv[5])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))
    out: dict = {}
    with WeightSyncClient(server, part=Part(rank=rank, world=world, group=dist.group.WORLD,
                                            join_timeout=60)) as client:
        for version, seed in TRAINER_STEPS:
            tensors = trainer_half(rank, seed)
            torch.cuda.synchronize()
            if version == "v2":
                tensors = written_behind_a_sleep(tensors)  # pushed at once: the push must wait for the writes
            result = client.push(tensors, version=version, mode="staged", transport="inline",
                                 allow_new_tensors=True, bucket_size_bytes=BUCKETS[rank])
            out[version] = {o.server: o.generation for o in result.servers}
            out[f"{version}_mismatches"] = [m.name for m in client.verify(tensors).mismatches]
            out[f"{version}_device"] = sorted({t.device.type for t in tensors.values()})
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpukit
    trainer_main()
    sys.exit(0)


# -- the tests --------------------------------------------------------------------------------------------
import grpc  # noqa: E402
from raw_updates import generation, refused  # noqa: E402
from test_box_parts import OWNS, begin, items_of, model, named, part_plan, push_boxes, send  # noqa: E402
from test_part_updates import past_keepalives  # noqa: E402

from weightsync.client import WeightSyncClient  # noqa: E402
from weightsync.v1 import weight_sync_service_pb2 as pb  # noqa: E402

from gpukit import assert_same_bytes, info, mapped_copy  # noqa: E402
from helpers import ServerProcess, free_port, run_ranks, start_server  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def read_back(server: ServerProcess, expected: dict[str, torch.Tensor]) -> None:
    """The store, as a CUDA engine maps it, holds exactly `expected` (bit for bit), and the SDK's verify agrees."""
    copied = mapped_copy(server, "cuda")
    assert_same_bytes({n: copied[n] for n in expected}, expected)
    with WeightSyncClient(server.address) as client:
        assert client.verify(expected).mismatches == ()


def test_boxes_from_two_parts_land_in_a_cuda_workers_store_and_a_bad_box_changes_nothing(cuda_server):
    server = cuda_server
    assert info(server).parts is True
    first = model(1)
    push_boxes(server, first, "v1", "k-cuda-first", "a.")  # every tensor new to the store
    read_back(server, named(first, "a."))
    second = model(2)
    before = push_boxes(server, second, "v2", "k-cuda-staged", "a.")  # STAGED into tensors the store holds
    read_back(server, named(second, "a."))

    # Part 1's box of c fails its checksum after part 0's boxes are in: both abort, the store keeps v2.
    plan0, datas0 = part_plan(items_of(OWNS[0], model(3), "a."))
    plan1, datas1 = part_plan(items_of(OWNS[1], model(3), "a."), corrupt="a.c")
    (zero, _), (one, _) = begin(server, "k-cuda-corrupt", "v3", pb.UPDATE_MODE_STAGED, [plan0, plan1], "a.")
    assert send(zero, datas0) == ["bucket_applied"] * len(datas0)
    assert send(one, datas1) == ["aborting"]
    told = past_keepalives(zero)
    assert told.WhichOneof("message") == "aborting" and told.aborting.reason == "PART_FAILED", told
    one.send(abort=pb.AbortUpdate(reason="bucket refused"))
    zero.send(commit=pb.CommitUpdate())
    code, reason, metadata = refused(one)
    assert (code, reason, metadata["tensor"]) == (grpc.StatusCode.DATA_LOSS, "TENSOR_CHECKSUM_MISMATCH", "a.c")
    assert refused(zero)[:2] == (grpc.StatusCode.ABORTED, "PART_FAILED")
    assert generation(server) == before
    read_back(server, named(second, "a."))

    after = model(4)
    assert push_boxes(server, after, "v4", "k-cuda-after", "a.") == before + 1
    read_back(server, named(after, "a."))


@pytest.fixture
def split_server(tmp_path) -> ServerProcess:
    """Worker 0 a CUDA worker on cuda:0, worker 1 a CPU worker (one worker per GPU): see BUCKETS."""
    server = start_server(tmp_path, "--local-socket", "auto", devices="cuda:0,cpu")
    yield server
    assert server.stop() == 0, server.log()[-3000:]



def test_two_trainer_processes_push_their_cuda_halves_as_parts(split_server, tmp_path):
    server = split_server
    start = generation(server)
    zero, one = run_ranks([__file__, "{rank}", "2", str(free_port()), server.address, str(tmp_path)], 2, tmp_path,
                          TRAINER_TIMEOUT_S)
    for k, (version, _) in enumerate(TRAINER_STEPS):
        assert zero[version] == one[version] == {server.address: start + 1 + k}
        assert zero[f"{version}_mismatches"] == one[f"{version}_mismatches"] == []
        assert zero[f"{version}_device"] == one[f"{version}_device"] == ["cuda"]
    read_back(server, {**trainer_expected(0, "v2"), **trainer_expected(1, "v2")})
