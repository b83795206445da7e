"""Parts that fail, over real processes (issue 35): two trainer ranks (tests/sdk_parts_fault_trainer.py, each
its own process in one Gloo group) push their halves of each version with WeightSyncClient(part=...) over
INLINE, STAGED, to two real servers.

  - rank 1 SIGKILLed mid-push (by itself, from the progress callback after its bucket 1): rank 0's push
    fails within a bound with PART_FAILED naming part 1 (its stream closed), every server keeps its
    version and every tensor bit for bit; the next push, from two fresh processes, commits and verifies;
  - a node holding a subset (--tensors) beside a whole one: each stores exactly its tensors, bit for bit,
    over two pushes;
  - rank 1 announces a bucket whose checksum is not its bytes': both parts fail (rank 1 with its own
    BUCKET_CHECKSUM_MISMATCH, rank 0 PART_FAILED naming part 1), nothing changes; again with rank 1 holding
    its streams open until rank 0's push ended (rank 0 learns it from the servers' abort fan-out alone);
    then the next push commits.
"""

from __future__ import annotations

import json
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sdk_parts_fault_trainer import CORRUPT, KILL_AFTER, model

from weightsync.client import WeightSyncClient
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import (
    free_port,
    local_checksums,
    ranks_exit_codes,
    run_ranks,
    server_checksums,
    start_server,
)

pytestmark = pytest.mark.timeout(420)

TRAINER = Path(__file__).resolve().parents[1] / "sdk_parts_fault_trainer.py"
TRAINERS_TIMEOUT = 300
"""Every scenario's ranks, a hold of up to HOLD_TIMEOUT (90 s) included."""
FAILED_WITHIN = 30.0
"""Seconds from rank 1's death to rank 0's PartUpdateFailed: the server learns it from the stream's end,
well before any idle bound (--transfer-timeout-seconds, 60 s by default)."""
SUBSET = r"^(emb|l1\.)"
"""The subset node's tensors: emb of rank 0's part, l1.w and l1.b of rank 1's (not l0.*, not head)."""


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """Two whole servers and one holding SUBSET, started together (each start is mostly importing torch)."""
    extras = ((), (), ("--tensors", SUBSET))
    with ThreadPoolExecutor(len(extras)) as pool:
        starting = [pool.submit(start_server, tmp_path_factory.mktemp(f"sdk-parts-faults-{k}"), *extra, workers=2)
                    for k, extra in enumerate(extras)]
        started = [s.result() for s in starting if s.exception() is None]
    try:
        assert len(started) == len(extras), [str(s.exception()) for s in starting]
        yield started
    finally:
        for server in started:
            assert server.stop() == 0, server.log()[-3000:]


@pytest.fixture
def servers(nodes):
    return nodes[:2]



def argv(servers, out: Path, scenario: str, seeds: list[int]) -> list[str]:
    return [str(TRAINER), "{rank}", "2", str(free_port()), ",".join(s.address for s in servers), str(out),
            scenario, ",".join(map(str, seeds))]


def state(servers) -> list[tuple[int, str, dict[str, int]]]:
    """Each server's committed generation, version and every stored tensor's checksum."""
    out = []
    for server in servers:
        info = server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
        out.append((info.current_version.generation, info.current_version.version, server_checksums(server)[0]))
    return out


def run_killed(servers, out: Path, seeds: list[int]) -> tuple[dict, int]:
    """Both ranks of "kill", bounded: rank 0's record, and rank 1's exit status (it kills itself)."""
    zero, one = ranks_exit_codes(argv(servers, out, "kill", seeds), 2, out, TRAINERS_TIMEOUT)  # one port for both
    assert zero == 0, (out / "rank0.log").read_text()[-4000:]
    return json.loads((out / "rank0.json").read_text()), one


def test_a_part_killed_mid_push_fails_the_other_naming_it_and_nothing_changes(servers, tmp_path):
    addresses = [s.address for s in servers]
    (tmp_path / "killed").mkdir()
    zero, one_status = run_killed(servers, tmp_path / "killed", [21, 22])
    assert one_status == -signal.SIGKILL, (tmp_path / "killed" / "rank1.log").read_text()[-4000:]
    killed = json.loads((tmp_path / "killed" / "killed.json").read_text())
    assert killed["bucket"] == KILL_AFTER < killed["buckets"] - 1  # mid-way: buckets of rank 1 still to come
    v1 = zero["v1"]
    assert sorted(v1) == sorted(addresses) and zero["v1_mismatches"] == []

    # Rank 0 hears, from a server, that part 1 failed: its stream closed. Soon, not at an idle bound.
    failed = zero["killed"]
    assert failed["type"] == "PartUpdateFailed", failed
    assert (failed["reason"], failed["code"], failed["failed_part"], failed["rank"], failed["part_reason"]) == (
        "PART_FAILED", "ABORTED", 1, 0, "STREAM_CLOSED"), failed
    assert failed["server"] in addresses
    assert 0 <= failed["at"] - killed["at"] < FAILED_WITHIN, (failed["at"], killed["at"])

    # Every server: the version before, and every tensor bit for bit (STAGED: the committed store untouched).
    assert zero["after"] == [v1[a] for a in addresses] and zero["after_mismatches"] == []
    before = model(21)
    for (generation, version, checksums), address in zip(state(servers), addresses, strict=True):
        assert (generation, version) == (v1[address], "v21")
        assert {n: checksums[n] for n in before} == local_checksums(before)

    # The next push, from two fresh processes (a new key): one generation per server, bit for bit.
    (tmp_path / "next").mkdir()
    zero, one = run_ranks(argv(servers, tmp_path / "next", "push", [23]), 2, tmp_path / "next", TRAINERS_TIMEOUT)
    assert zero["v23"] == one["v23"] == {a: v1[a] + 1 for a in addresses}
    assert zero["v23_mismatches"] == one["v23_mismatches"] == []
    for server in servers:
        assert server_checksums(server, names=sorted(model(23))) == [local_checksums(model(23))]


def test_a_node_holding_a_subset_stores_exactly_its_tensors_from_both_parts(nodes, tmp_path):
    whole, subset = nodes[1:]
    pair = [subset, whole]
    addresses = [s.address for s in pair]
    before = {s.address: s.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=30).current_version.generation
              for s in pair}
    zero, one = run_ranks(argv(pair, tmp_path, "push", [31, 32]), 2, tmp_path, TRAINERS_TIMEOUT)
    assert zero["v31"] == one["v31"] == {a: before[a] + 1 for a in addresses}
    assert zero["v32"] == one["v32"] == {a: before[a] + 2 for a in addresses}
    for record in (zero, one):  # each rank's tensors, on each node that holds them
        assert record["v31_mismatches"] == record["v32_mismatches"] == []
    last = model(32)
    mine = {n: t for n, t in last.items() if re.search(SUBSET, n)}
    assert sorted(mine) == ["emb", "l1.b", "l1.w"]
    assert server_checksums(subset) == [local_checksums(mine)]  # exactly its tensors, bit for bit
    answer = subset.stub().GetTensorChecksums(pb.GetTensorChecksumsRequest(names=sorted(last)), timeout=60)
    assert sorted(answer.not_stored) == ["head", "l0.b", "l0.w"]
    info = subset.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
    assert (info.store.tensor_filter, info.store.tensor_count, info.current_version.version) == (SUBSET, 3, "v32")
    assert server_checksums(whole, names=sorted(last)) == [local_checksums(last)]
    with WeightSyncClient(addresses) as client:  # the whole model, from one process: each node its own
        assert client.verify(last).mismatches == ()
        assert {m.name for m in client.verify(model(31)).mismatches} == set(last)


def test_a_corrupt_bucket_in_one_part_fails_both_and_the_next_push_commits(servers, tmp_path):
    addresses = [s.address for s in servers]
    zero, one = run_ranks(argv(servers, tmp_path, "corrupt", [41, 42, 43]), 2, tmp_path, TRAINERS_TIMEOUT)
    v1 = zero["v1"]
    assert one["v1"] == v1 and sorted(v1) == sorted(addresses)
    for step in ("corrupt", "held"):
        assert one[f"{step}_calls"] > CORRUPT and zero[f"{step}_calls"] == 0  # rank 1 got to its bad bucket

        # Rank 1: its own bucket's checksum refused; rank 0: PART_FAILED (and, below, naming part 1 and why).
        own, told = one[step], zero[step]
        assert (own["type"], own["reason"], own["code"], own["rank"], own["failed_part"]) == (
            "PartUpdateFailed", "BUCKET_CHECKSUM_MISMATCH", "DATA_LOSS", 1, None), (step, own)
        assert (told["type"], told["reason"], told["code"], told["rank"]) == (
            "PartUpdateFailed", "PART_FAILED", "ABORTED", 0), (step, told)

        # Nothing changed on either server (each rank read it back: its version's tensors).
        for record in (zero, one):
            assert record[f"{step}_after"] == [v1[a] for a in addresses], step
            assert record[f"{step}_after_mismatches"] == [], step
    # The next push commits with one generation per server, and reads back bit for bit.
    assert zero["v2"] == one["v2"] == {a: v1[a] + 1 for a in addresses}
    assert zero["v2_mismatches"] == one["v2_mismatches"] == []
    for server in servers:
        assert server_checksums(server, names=sorted(model(43))) == [local_checksums(model(43))]

    # Which part failed, and why: from the status that ends rank 0's streams (its ErrorInfo).
    told = zero["corrupt"]
    assert (told["failed_part"], told["part_reason"], told["part_code"]) == (1, "BUCKET_CHECKSUM_MISMATCH", "DATA_LOSS")
    # While rank 1 holds its streams open, rank 0 hears PART_FAILED from the fan-out (UpdateAborting) before its
    # stream's status (which comes once every part's stream ended, after the client's abort grace): the
    # message carries the ErrorInfo metadata itself (UpdateAborting.metadata), so the part is named.
    told = zero["held"]
    assert (told["failed_part"], told["part_reason"], told["part_code"]) == (1, "BUCKET_CHECKSUM_MISMATCH", "DATA_LOSS")
