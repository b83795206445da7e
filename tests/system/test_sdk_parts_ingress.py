"""Parts through a server's ingress slots, from real trainer processes (tests/sdk_parts_ingress_trainer.py,
one Gloo group).

SHM: two trainer processes on the server's host each write their buckets into the server's ingress themselves. The server gives each part a run of its own of
the ingress slots (UpdateReady.ingress_slot_first/_count: 4 slots, 2 each), and each writes only there: with
several buckets per part, every slot is reused within a push, so a part writing outside its run would hand
the server the other part's bytes (a checksum refusal), or the server would read a slot the part never wrote.
Both parts get one generation, whole tensors and a DTensor's row boxes read back bit for bit, twice.

INLINE with more parts than slots: three parts, two slots. The parts take turns (update_streams.SlotPool:
a free slot to the part that waited longest, one at a time each); before, such a world was refused
(PARTS_UNAVAILABLE) once joined."""

from __future__ import annotations

from pathlib import Path

import pytest
from sdk_parts_ingress_trainer import OWNS, model

from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import free_port, local_checksums, run_ranks, server_checksums, start_server

pytestmark = pytest.mark.timeout(300)

TRAINER = Path(__file__).resolve().parents[1] / "sdk_parts_ingress_trainer.py"
SLOT_BYTES, SLOT_COUNT = 8192, 4



def test_two_parts_on_the_servers_host_write_their_own_slots_and_commit_one_version(tmp_path):
    server = start_server(tmp_path, "--local-socket", "auto", "--ingress-slot-bytes", str(SLOT_BYTES),
                          "--ingress-slot-count", str(SLOT_COUNT), workers=2)
    try:
        zero, one = run_ranks([str(TRAINER), "{rank}", "2", str(free_port()), server.address, str(tmp_path), "shm"],
                              2, tmp_path, 240)
        # Rank 0 writes slots 0 and 1, rank 1 slots 2 and 3: the even split, in rank order.
        assert zero["v1_run"] == zero["v2_run"] == [0, 2]
        assert one["v1_run"] == one["v2_run"] == [2, 2]
        # More buckets than slots on each rank: each slot was written again within the push.
        assert zero["v1_buckets"] > 2 and one["v1_buckets"] > 2
        # One generation per version for both parts, the second one more.
        assert zero["v1"] == one["v1"] and zero["v2"] == one["v2"] == [zero["v1"][0] + 1]
        assert zero["v1_mismatches"] == one["v1_mismatches"] == []
        assert zero["v2_mismatches"] == one["v2_mismatches"] == []
        names = sorted({*OWNS[0], *OWNS[1], "rows"})
        assert server_checksums(server, names=names) == [local_checksums({n: model(2)[n] for n in names})]
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_three_inline_parts_take_turns_at_two_ingress_slots_and_commit_one_version(tmp_path):
    server = start_server(tmp_path, "--ingress-slot-bytes", str(SLOT_BYTES), workers=2)  # 2 slots, the default
    try:
        assert server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).limits.ingress_slot_count == 2
        records = run_ranks([str(TRAINER), "{rank}", "3", str(free_port()), server.address, str(tmp_path), "inline"],
                            3, tmp_path, 240)
        # More buckets than slots on every rank: each one waited its turn for a slot several times.
        assert all(r["v1_buckets"] > 2 for r in records)
        first = records[0]["v1"][0]
        for record in records:
            assert record["v1"] == [first] and record["v2"] == [first + 1]
            assert record["v1_mismatches"] == record["v2_mismatches"] == []
        assert server_checksums(server, names=sorted(model(2))) == [local_checksums(model(2))]
    finally:
        assert server.stop() == 0, server.log()[-3000:]
