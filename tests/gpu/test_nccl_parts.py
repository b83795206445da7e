"""Parts over COLLECTIVE with CUDA (issue 35): two trainer processes (this file run as a script, one Gloo
group of their own for Part.group) call create_group() on both ranks and push their halves, CUDA tensors
written behind a long kernel, over one transfer group of both parts' ranks and the server's worker.

(a) One GPU: the parts and the server's CUDA worker share cuda:0, which NCCL refuses (two ranks of one
    communicator on one device: tests/gpu/test_nccl_one_gpu.py), so backend "auto" builds a Gloo group: each
    part packs its CUDA tensors into host buckets (every read after the copies into them) and sends each
    point-to-point to the CUDA worker, which takes them on its host lane in the one global order. Two steps,
    one generation each for both parts, each rank's verify clean, and the store bit for bit through a CUDA
    engine's mapping.
(b) Three GPUs (skipped with a reason on fewer): part r on cuda:r, the worker on cuda:2, backend "nccl", the
    trainers running an NCCL all_reduce of their own first (so torch keeps its own TORCH_NCCL_NONBLOCKING_TIMEOUT,
    as in a real trainer). Over NCCL with several trainer ranks a part sends each bucket point-to-point (not a
    broadcast) from its device pack buffer, a bucket's owners in one batch on the group's own communicator after
    the pack copies, the worker receiving into its device staging in the one global order, every wait polled
    against the group's timeout; every (part, worker) pair connected in create_group. Same checks, and recorded:
    each GPU's free memory before the group, after it, after each push (C2: one communicator per group, its
    peers' buffers, per peer: review H3, F5), and the first push against the second (L6).
(c) Three GPUs: part 1 SIGKILLed after its bucket 0 of the first push: part 0 learns PART_FAILED naming it well
    within the group timeout (C1: no send of it waits past the server's word), and its group is broken (it sent
    over NCCL: a send may have completed into a receive never posted, P1): the next push on it is refused.
(d) Three GPUs: part 1's bucket 0 sent late, part 0 SIGKILLed after announcing its bucket 1, whose receive the
    worker held for part 1's turn: the worker reports a timed-out transfer within the server's bound, and is not
    restarted (P3: a held receive's deadline runs from when its command arrived).
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
    """A rank's whole CUDA tensors (the same bytes in every process, whatever its GPU); ranks past 1 (eight GPUs)
    hold rank 1's shapes under names of their own."""
    g = torch.Generator().manual_seed(seed * 10 + rank)
    if rank == 0:
        tensors = {"n.embed": torch.randn(512, 256, generator=g).to(torch.bfloat16),
                   "n.w": torch.randn(1000, 33, generator=g)}
    else:
        tensors = {"n.b": torch.randn(333, generator=g).half(),
                   "n.steps": torch.arange(77, dtype=torch.int64) + seed,
                   "n.v": torch.randn(40000, generator=g)}
        if rank > 1:
            tensors = {f"r{rank}.{name}": tensor for name, tensor in tensors.items()}
    return {name: tensor.to(device) for name, tensor in tensors.items()}


def expected(rank: int, version: str) -> dict[str, torch.Tensor]:
    tensors = half(rank, dict(STEPS)[version], torch.device("cuda", 0))
    if version == "v2":
        for tensor in tensors.values():
            tensor.add_(1)
    return tensors


# -- the trainer: this file as a script -------------------------------------------------------------------
def trainer_main() -> None:
    """python test_nccl_parts.py RANK WORLD PORT SERVER OUT_DIR BACKEND GPU_OF_RANK0 [MODE]; MODE: push (the default),
    dies (c), late (d)."""
    import time

    import torch.distributed as dist

    from weightsync.client import Part, WeightSyncClient

    from gpukit import written_behind_a_sleep

    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    server, out_dir, backend, first_gpu = sys.argv[4], Path(sys.argv[5]), sys.argv[6], int(sys.argv[7])
    mode = sys.argv[8] if len(sys.argv) > 8 else "push"
    device = torch.device("cuda", first_gpu + rank if backend == "nccl" else first_gpu)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))
    own = own_nccl_first(device) if backend == "nccl" else None  # noqa: F841 - held for the trainer's life
    if mode != "push":
        arm_fault(mode, rank, out_dir)
    out: dict = {"free": {}, "seconds": {}}
    part = Part(rank=rank, world=world, group=dist.group.WORLD, join_timeout=90)
    with WeightSyncClient(server, part=part) as client:
        torch.zeros(1, device=device)  # this process uses CUDA: its GPU counts for the backend's choice
        out["free"]["before_group"] = torch.cuda.mem_get_info(device)[0]
        client.create_group(backend=backend, timeout=GROUP_TIMEOUT)
        out["free"]["after_group"] = torch.cuda.mem_get_info(device)[0]
        group = client._group
        # NCCL's communicator and per-peer buffers, all spent in create_group (every pair connected there).
        out["peers"] = sorted(group.collective.peers)
        out["group_device_bytes_after_create"] = group.collective.nccl_device_bytes
        out["group"] = {"backend": group.backend, "rank": group.rank, "trainer_ranks": group.trainer_ranks,
                        "device": str(group.device)}
        for version, seed in STEPS:
            tensors = half(rank, seed, device)
            torch.cuda.synchronize()
            if version == "v2":
                tensors = written_behind_a_sleep(tensors)  # pushed at once: the sends must wait for the writes
            started = time.monotonic()
            try:
                result = client.push(tensors, version=version, mode="staged", transport="collective",
                                     allow_new_tensors=True, bucket_size_bytes=BUCKET_BYTES)
            except Exception as error:  # noqa: BLE001 - (c), (d): recorded for the test
                out["failed"] = {"at": time.monotonic(), "reason": getattr(error, "reason", type(error).__name__),
                                 "message": str(error)[:500]}
                out["group_broken"] = client._group.broken  # P1: closed and refused for any later push
                break
            out["seconds"][version] = time.monotonic() - started
            out["free"][f"after_{version}"] = torch.cuda.mem_get_info(device)[0]
            out["group_device_bytes"] = group.collective.nccl_device_bytes
            out[version] = {o.server: o.generation for o in result.servers}
            out[f"{version}_buckets"] = result.bucket_count
            out[f"{version}_mismatches"] = [m.name for m in client.verify(tensors).mismatches]
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def own_nccl_first(device: torch.device) -> object:
    """The trainer's own NCCL collective before weightsync's group (FSDP's, in a real trainer): torch reads
    TORCH_NCCL_NONBLOCKING_TIMEOUT then, and keeps it. Returns the group (kept for the trainer's life)."""
    from torch._C._distributed_c10d import ProcessGroupNCCL
    from torch.distributed import PrefixStore, TCPStore

    store = TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    own = ProcessGroupNCCL(PrefixStore("own", store), 0, 1, ProcessGroupNCCL.Options())
    own.allreduce([torch.ones(1, device=device)]).wait()
    torch.cuda.synchronize()
    return own, store


def arm_fault(mode: str, rank: int, out_dir: Path) -> None:
    """(c) dies: part 1 SIGKILLed once its bucket 0 was sent. (d) late: part 1's bucket 0 sent 5 s late, part 0
    SIGKILLed right after announcing its bucket 1 (its bytes never sent)."""
    import os
    import signal
    import time

    from weightsync.client.transports import collective as collective_sink

    if mode == "dies" and rank == 1:
        send = collective_sink.CollectiveSink.send

        def send_then_die(self, index, payload, checksum, streams):
            failure = send(self, index, payload, checksum, streams)
            self.finish()
            (out_dir / "killed.json").write_text(json.dumps({"at": time.monotonic(), "bucket": index}))
            os.kill(os.getpid(), signal.SIGKILL)
            return failure

        collective_sink.CollectiveSink.send = send_then_die
    elif mode == "late":
        announce = collective_sink.announce

        def late_or_dead(loop, streams, index, *args):
            if rank == 1 and index == 0:
                time.sleep(5.0)
            announce(loop, streams, index, *args)
            if rank == 0 and index == 1:
                (out_dir / "killed.json").write_text(json.dumps({"at": time.monotonic(), "bucket": index}))
                os.kill(os.getpid(), signal.SIGKILL)

        collective_sink.announce = late_or_dead


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpukit
    trainer_main()
    sys.exit(0)


# -- the tests --------------------------------------------------------------------------------------------
from weightsync.v1 import weight_sync_service_pb2 as pb  # noqa: E402

from gpukit import assert_same_bytes, mapped_copy, record  # noqa: E402
from helpers import free_port, ranks_exit_codes, run_ranks, start_server  # noqa: E402

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


THREE_GPUS = pytest.mark.skipif(
    torch.cuda.device_count() < 3,
    reason="needs 3 GPUs (two parts and a worker, one GPU each: NCCL refuses two ranks on one GPU)")
WORKER_GROWTH_BYTES = 1 << 30
"""The most the worker's GPU may lose to a parts' group over two pushes: its staging (2 x 64 KiB) and NCCL's one
communicator with its two peers. Measured values are recorded; the bound only catches growth per pair or push."""


@pytest.fixture
def worker_on_gpu2(tmp_path):
    server = start_server(tmp_path, "--local-socket", "auto", workers=0, devices="cuda:2")
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def free_on(index: int) -> int:
    return torch.cuda.mem_get_info(index)[0]


@THREE_GPUS
def test_two_parts_push_point_to_point_over_nccl(worker_on_gpu2, tmp_path):
    worker_free = free_on(2)
    zero, one = run_parts(worker_on_gpu2, tmp_path, "nccl")
    assert zero["group"]["backend"] == one["group"]["backend"] == pb.BACKEND_NCCL
    assert (zero["group"]["device"], one["group"]["device"]) == ("cuda:0", "cuda:1")
    worker_grown = worker_free - free_on(2)
    record("nccl_parts_memory", worker_grown=worker_grown, parts=[zero["free"], one["free"]],
           group_device_bytes=[zero["group_device_bytes"], one["group_device_bytes"]],
           device_bytes_per_peer=[r["group_device_bytes_after_create"] // max(1, len(r["peers"])) for r in (zero, one)],
           push_seconds=[zero["seconds"], one["seconds"]])
    assert worker_grown <= WORKER_GROWTH_BYTES
    assert zero["peers"] == one["peers"] == [2]  # each part's pair with the worker, connected in create_group
    for ranks in (zero, one):  # nothing more connected by the pushes
        assert ranks["group_device_bytes"] == ranks["group_device_bytes_after_create"]
    for ranks in (zero, one):  # the second push costs a part's GPU nothing more (no pair made per push)
        assert ranks["free"]["after_v1"] - ranks["free"]["after_v2"] < 64 << 20
        assert ranks["seconds"]["v1"] - ranks["seconds"]["v2"] < 10.0  # L6: the first push's connects are cheap


def run_faulty(server, tmp_path: Path, mode: str) -> tuple[dict | None, dict | None, dict]:
    codes = ranks_exit_codes([__file__, "{rank}", "2", str(free_port()), server.address, str(tmp_path), "nccl", "0",
                              mode], 2, tmp_path, TRAINER_TIMEOUT_S)
    outs = [json.loads((tmp_path / f"rank{r}.json").read_text()) if code == 0 else None
            for r, code in enumerate(codes)]
    return outs[0], outs[1], json.loads((tmp_path / "killed.json").read_text())


@THREE_GPUS
def test_a_part_killed_in_the_first_push_fails_the_other_at_once_and_breaks_the_group(worker_on_gpu2, tmp_path):
    zero, one, killed = run_faulty(worker_on_gpu2, tmp_path, "dies")
    assert one is None and zero is not None
    record("nccl_part_killed", zero=zero, killed=killed)
    assert zero["failed"]["reason"] == "PART_FAILED" and "1" in zero["failed"]["message"]
    assert zero["failed"]["at"] - killed["at"] < GROUP_TIMEOUT / 2
    assert zero["group_broken"]  # P1: a part that sent over NCCL does not push on that group again


@THREE_GPUS
def test_a_held_receive_whose_sender_died_times_out_within_the_servers_bound(worker_on_gpu2, tmp_path):
    before = worker_on_gpu2.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=30).workers[0]
    zero, one, killed = run_faulty(worker_on_gpu2, tmp_path, "late")
    assert zero is None and one is not None
    after = worker_on_gpu2.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=30).workers[0]
    record("nccl_held_receive_sender_died", one=one, killed=killed, restarts=after.restart_count)
    assert one["failed"]["reason"] == "PART_FAILED"
    assert (after.pid, after.restart_count) == (before.pid, before.restart_count)  # not killed: WORKER_TIMEOUT


@pytest.mark.skipif(torch.cuda.device_count() < 8, reason="needs 8 GPUs (4 parts and 4 workers, one GPU each)")
def test_four_parts_push_to_four_workers_over_nccl(tmp_path):
    """At 8 GPUs (docs/gpus.md): 4 parts x 4 workers, every part sending to every worker on one communicator per
    group; two pushes bit for bit, each GPU's memory recorded."""
    server = start_server(tmp_path, "--local-socket", "auto", workers=0, devices="cuda:4,cuda:5,cuda:6,cuda:7")
    try:
        before = server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=30).current_version.generation
        ranks = run_ranks([__file__, "{rank}", "4", str(free_port()), server.address, str(tmp_path), "nccl", "0"],
                          4, tmp_path, TRAINER_TIMEOUT_S)
        record("nccl_four_parts", free=[r["free"] for r in ranks], seconds=[r["seconds"] for r in ranks],
               group_device_bytes=[r["group_device_bytes"] for r in ranks],
               device_bytes_per_peer=[r["group_device_bytes_after_create"] // max(1, len(r["peers"])) for r in ranks])
        assert all(r["peers"] == [4, 5, 6, 7] for r in ranks)  # every part connected to every worker
        for k, (version, _) in enumerate(STEPS):
            assert all(r[version] == {server.address: before + 1 + k} for r in ranks)
            assert all(r[f"{version}_mismatches"] == [] for r in ranks)
    finally:
        assert server.stop() == 0, server.log()[-3000:]
