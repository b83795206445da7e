"""Parts over COLLECTIVE, from real trainer processes (tests/sdk_parts_collective_trainer.py, one Gloo group of
two ranks) into two real servers of two CPU workers each.

create_group() on both ranks builds one transfer group: the parts' ranks 0 and 1 (group rank = part rank,
CreateTransferGroupRequest.trainer_ranks = 2), then each server's workers (rank_offset >= 2). Each part sends
its bucket k point-to-point to each server's owner of it (tag k), and each worker receives its buckets in one
global order (bucket index, then part rank: common/receive_order.py).

  - whole tensors and DTensor row boxes, twice: one generation per version on each server for both parts, and
    every tensor bit for bit against the full tensors;
  - rank 1 SIGKILLed mid-push: rank 0 fails within a bound with PART_FAILED naming part 1, each server keeps
    its version (STAGED) bit for bit, and the next push, from two fresh processes, commits and verifies;
  - a group whose workers' ranks would overlap the trainer's ranks is refused (RANKS_DO_NOT_FIT).
"""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from sdk_parts_collective_trainer import GROUP_TIMEOUT, KILL_AFTER, OWNS, PATCHED, SHARDED, model

from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import (
    error_info,
    free_port,
    local_checksums,
    ranks_exit_codes,
    run_ranks,
    server_checksums,
    start_server,
)

pytestmark = pytest.mark.timeout(420)

TRAINER = Path(__file__).resolve().parents[1] / "sdk_parts_collective_trainer.py"
TRAINERS_TIMEOUT = 200
FAILED_WITHIN = GROUP_TIMEOUT / 2
"""Seconds from rank 1's death to rank 0's PartUpdateFailed, well before the group's timeout (30 s). The servers
learn it at once (a worker's receive from the dead rank fails, or its stream ends) and tell rank 0 (aborting);
rank 0 stops waiting for its Gloo send to a worker that will never receive it (CollectiveSink._wait) rather than
wait for the send's deadline, the group's timeout (it did: 30.0 s)."""
NAMES = sorted({*OWNS[0], *OWNS[1], *SHARDED})


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with ThreadPoolExecutor(2) as pool:
        starting = [pool.submit(start_server, tmp_path_factory.mktemp(f"sdk-parts-collective-{k}"), workers=2)
                    for k in range(2)]
        started = [s.result() for s in starting if s.exception() is None]
    try:
        assert len(started) == 2, [str(s.exception()) for s in starting]
        yield started
    finally:
        for server in started:
            assert server.stop() == 0, server.log()[-3000:]


def argv(servers, out: Path, scenario: str, seeds: list[int]) -> list[str]:
    return [str(TRAINER), "{rank}", "2", str(free_port()), ",".join(s.address for s in servers), str(out),
            scenario, ",".join(map(str, seeds))]


def generation(server) -> tuple[int, str]:
    version = server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=30).current_version
    return version.generation, version.version


def test_two_parts_push_over_one_group_of_both_ranks_and_the_workers_bit_for_bit(servers, tmp_path):
    addresses = [s.address for s in servers]
    before = {s.address: generation(s)[0] for s in servers}
    zero, one = run_ranks(argv(servers, tmp_path, "push", [1, 2]), 2, tmp_path, TRAINERS_TIMEOUT)
    # One group: both parts' ranks, then 2 workers on each server.
    assert zero["group_id"] == one["group_id"]
    assert zero["group"] == {"rank": 0, "world_size": 6, "trainer_ranks": 2}
    assert one["group"] == {"rank": 1, "world_size": 6, "trainer_ranks": 2}
    # Several buckets per part (more than the two a sink keeps in flight), one generation per version.
    assert zero["v1_buckets"] > 2 and one["v1_buckets"] > 2
    assert zero["v1"] == one["v1"] == {a: before[a] + 1 for a in addresses}
    assert zero["v2"] == one["v2"] == {a: before[a] + 2 for a in addresses}
    for record in (zero, one):
        assert record["v1_mismatches"] == record["v2_mismatches"] == []
        assert "close" not in record, record["close"]
    for server in servers:
        assert server_checksums(server, names=NAMES) == [local_checksums({n: model(2)[n] for n in NAMES})]
        assert generation(server)[1] == "v2"
        # Part 0 deleted the group on every server when its client closed.
        assert server.stub().ListTransferGroups(pb.ListTransferGroupsRequest(), timeout=10).groups == []


def test_two_parts_patch_their_whole_tensors_and_boxes_over_the_group_bit_for_bit(servers, tmp_path):
    """Box patches over COLLECTIVE (9dc596f placed them, tested over INLINE only): a dense step, then the same model
    with every 97th element changed pushed with delta on. Each part sends patches of its whole tensors and of its
    DTensor row boxes (one of them larger than a bucket) point-to-point; every server holds the patched model bit
    for bit, one generation per step."""
    addresses = [s.address for s in servers]
    before = {s.address: generation(s)[0] for s in servers}
    zero, one = run_ranks(argv(servers, tmp_path, "push", [3, PATCHED + 3]), 2, tmp_path, TRAINERS_TIMEOUT)
    assert zero[f"v{PATCHED + 3}"] == one[f"v{PATCHED + 3}"] == {a: before[a] + 2 for a in addresses}
    for record in (zero, one):
        sent, dense = record[f"v{PATCHED + 3}_sent"]
        assert 0 < sent < dense / 10, record  # patches, not the dense boxes (those alone are over 20%)
        assert record["v3_mismatches"] == record[f"v{PATCHED + 3}_mismatches"] == []
        assert "close" not in record, record["close"]
    for server in servers:
        assert server_checksums(server, names=NAMES) == [local_checksums({n: model(PATCHED + 3)[n] for n in NAMES})]
        assert generation(server)[1] == f"v{PATCHED + 3}"


def test_a_part_killed_mid_push_over_the_group_fails_the_other_naming_it_and_nothing_changes(servers, tmp_path):
    addresses = [s.address for s in servers]
    out = tmp_path / "killed"
    out.mkdir()
    zero_status, one_status = ranks_exit_codes(argv(servers, out, "kill", [21, 22]), 2, out, TRAINERS_TIMEOUT)
    assert zero_status == 0, (out / "rank0.log").read_text()[-4000:]
    assert one_status == -signal.SIGKILL, (out / "rank1.log").read_text()[-4000:]
    zero = json.loads((out / "rank0.json").read_text())
    killed = json.loads((out / "killed.json").read_text())
    assert killed["bucket"] == KILL_AFTER < killed["buckets"] - 1  # mid-way: buckets of rank 1 still to come
    v1 = zero["v21"]
    assert sorted(v1) == sorted(addresses) and zero["v21_mismatches"] == []

    # Rank 0 hears, from a server, that part 1 failed; within a bound.
    failed = zero["killed"]
    assert failed["type"] == "PartUpdateFailed", failed
    assert (failed["reason"], failed["code"], failed["failed_part"], failed["rank"]) == (
        "PART_FAILED", "ABORTED", 1, 0), failed
    assert failed["server"] in addresses
    assert 0 <= failed["at"] - killed["at"] < FAILED_WITHIN, (failed["at"], killed["at"])

    # Every server: the version before, every tensor bit for bit (STAGED: the committed store untouched).
    assert zero["after"] == [v1[a] for a in addresses] and zero["after_mismatches"] == []
    for server in servers:
        assert generation(server) == (v1[server.address], "v21")
        assert server_checksums(server, names=NAMES) == [local_checksums({n: model(21)[n] for n in NAMES})]

    # The next push, from two fresh processes in a new group: one generation per server, bit for bit.
    out = tmp_path / "next"
    out.mkdir()
    zero, one = run_ranks(argv(servers, out, "push", [23]), 2, out, TRAINERS_TIMEOUT)
    assert zero["group_id"] == one["group_id"]
    assert zero["v23"] == one["v23"] == {a: v1[a] + 1 for a in addresses}
    assert zero["v23_mismatches"] == one["v23_mismatches"] == []
    for server in servers:
        assert server_checksums(server, names=NAMES) == [local_checksums({n: model(23)[n] for n in NAMES})]


@pytest.mark.parametrize(("trainer_ranks", "rank_offset"), [(2, 1), (3, 2), (-1, 1)])
def test_workers_ranks_overlapping_the_trainers_are_refused(servers, trainer_ranks, rank_offset):
    server = servers[0]
    listed = server.stub().ListTransferGroups(pb.ListTransferGroupsRequest(), timeout=10).groups
    request = pb.CreateTransferGroupRequest(group_id="g-overlap", store_host="127.0.0.1", store_port=1,
                                            world_size=8, rank_offset=rank_offset, backend=pb.BACKEND_GLOO,
                                            trainer_ranks=trainer_ranks)
    with pytest.raises(grpc.RpcError) as caught:
        server.stub().CreateTransferGroup(request, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(caught.value)
    assert info.reason == "RANKS_DO_NOT_FIT"
    assert (info.metadata["trainer_ranks"], info.metadata["rank_offset"]) == (str(trainer_ranks), str(rank_offset))
    assert server.stub().ListTransferGroups(pb.ListTransferGroupsRequest(), timeout=10).groups == listed
