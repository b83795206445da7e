"""The SDK's parts over real processes: two trainer ranks (tests/sdk_parts_trainer.py, each its own process in
one Gloo group) push their halves of each version with WeightSyncClient(part=...) to two real servers over
INLINE. Both ranks get the same generation from each server, and every tensor reads back bit for bit
(GetTensorChecksums). A rank with a bad input fails both ranks before Begin (the servers untouched); a rank
failing mid-way fails the other with PART_FAILED naming it (STAGED: the store untouched); each failure is
followed by a push that commits and verifies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sdk_parts_trainer import dtensor_model, model

from weightsync.client import (
    Part,
    PartsUnavailable,
    PartUpdateFailed,
    WeightSyncClient,
    WeightSyncClientError,
)

from helpers import (
    free_port,
    local_checksums,
    run_ranks,
    server_checksums,
    start_servers,
)

pytestmark = pytest.mark.timeout(420)

TRAINER = Path(__file__).resolve().parents[1] / "sdk_parts_trainer.py"
TRAINERS_TIMEOUT = 300


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    started = start_servers([tmp_path_factory.mktemp(f"sdk-parts-{k}") for k in range(2)], workers=2)
    yield started
    for server in started:
        assert server.stop() == 0, server.log()[-3000:]



def run_trainers(servers, out: Path, scenario: str) -> list[dict]:
    """Both ranks to their end (bounded), each one's record."""
    port = free_port()
    addresses = ",".join(s.address for s in servers)
    return run_ranks([str(TRAINER), "{rank}", "2", str(port), addresses, str(out), scenario], 2, out, TRAINERS_TIMEOUT)


def test_two_ranks_push_their_halves_and_a_failing_rank_fails_both(servers, tmp_path):
    zero, one = run_trainers(servers, tmp_path, "whole")
    addresses = [s.address for s in servers]

    # One generation per server for both parts, and each rank's half bit for bit.
    assert zero["v1"] == one["v1"] and sorted(zero["v1"]) == sorted(addresses)
    v1 = zero["v1"]
    assert zero["v1_mismatches"] == one["v1_mismatches"] == []

    # Rank 1's TypeError fails both ranks before Begin, naming rank 1; nothing moved.
    for record in (zero, one):
        assert record["bad"]["ranks"] == [1]
        assert record["bad"]["messages"]["1"] == "TypeError: tensor 'b' is a str, not a torch.Tensor"
        assert record["after_bad"] == [v1[a] for a in addresses]
        assert record["after_bad_mismatches"] == []
    assert (zero["bad"]["cause"], one["bad"]["cause"]) == (None, "TypeError")

    # Rank 1 stops after its first bucket: rank 0 hears PART_FAILED naming it, from each server; STAGED
    # keeps the committed weights.
    assert one["midway"] == {"type": "RuntimeError", "message": "rank 1 stops after its first bucket"}
    assert zero["midway"]["type"] == "PartUpdateFailed", zero["midway"]
    assert (zero["midway"]["reason"], zero["midway"]["code"], zero["midway"]["failed_part"], zero["midway"]["rank"]) \
        == ("PART_FAILED", "ABORTED", 1, 0)
    for record in (zero, one):
        assert record["after_midway"] == [v1[a] for a in addresses]
        assert record["after_midway_mismatches"] == []

    # The next push (a new key) commits once more, with one generation, and reads back bit for bit.
    assert zero["v2"] == one["v2"] == {a: v1[a] + 1 for a in addresses}
    assert zero["v2_mismatches"] == one["v2_mismatches"] == []
    for server in servers:
        assert server_checksums(server, names=sorted(model(4))) == [local_checksums(model(4))]


def test_a_part_over_another_transport_or_to_a_server_without_parts_is_refused_before_a_byte(servers):
    from weightsync.v1 import weight_sync_service_pb2 as pb

    before = [s.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).current_version for s in servers]
    tensors = {"a": torch.ones(4)}
    with WeightSyncClient([s.address for s in servers], part=Part(rank=0, world=2)) as client:
        with pytest.raises(PartsUnavailable, match="not 'broadcast'"):
            client.push(tensors, version="x", transport="broadcast", part_key="k-broadcast")
        with pytest.raises(WeightSyncClientError, match="no transfer group: call create_group"):
            client.push(tensors, version="x", transport="collective", part_key="k-collective")
        with pytest.raises(WeightSyncClientError, match="SHM pushes to one server"):
            client.push(tensors, version="x", transport="shm", part_key="k-shm")
        with pytest.raises(ValueError, match="needs Part.group"):  # the parts agree on the group through it
            client.create_group()
        assert client.list_groups() == {s.address: [] for s in servers}
        with pytest.raises(ValueError, match="needs push\\(part_key=...\\)"):
            client.push(tensors, version="x")
        with pytest.raises(ValueError, match="part_key must be"):
            client.push(tensors, version="x", part_key="a key")
        # A server that says it runs no parts (an older one, or one without INLINE parts): its answer as read.
        without = pb.GetServerInfoResponse()
        without.CopyFrom(client._fleet.infos()[1])
        without.parts = False
        client._fleet.states[1].answered(without)
        with pytest.raises(PartsUnavailable, match=f"{servers[1].address} does not run updates sent in parts"):
            client.push(tensors, version="x", part_key="k-no-flag")
    with WeightSyncClient(servers[0].address) as client, pytest.raises(ValueError, match="client with a part"):
        client.push(tensors, version="x", transport="inline", part_key="k")
    assert [s.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).current_version for s in servers] == before


def test_a_part_whose_peer_never_comes_fails_parts_missing_naming_it(servers):
    from weightsync.v1 import weight_sync_service_pb2 as pb

    addresses = [s.address for s in servers]
    before = [s.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).current_version for s in servers]
    with WeightSyncClient(addresses, part=Part(rank=0, world=2, join_timeout=1)) as client:
        with pytest.raises(PartUpdateFailed) as caught:
            client.push({"a": torch.ones(4)}, version="alone", part_key="k-alone", allow_new_tensors=True)
    error = caught.value
    assert (error.code.name, error.reason, error.missing, error.rank, error.update_key) == (
        "DEADLINE_EXCEEDED", "PARTS_MISSING", (1,), 0, "k-alone")
    assert error.server in addresses and "ranks [1] never joined" in str(error)
    assert [s.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).current_version for s in servers] == before
    # The next push, one whole update from one process, commits and reads back.
    tensors = {"solo": torch.arange(10, dtype=torch.float32)}
    with WeightSyncClient(addresses) as client:
        result = client.push(tensors, version="solo", transport="inline", allow_new_tensors=True)
        assert [o.generation for o in result.servers] == [b.generation + 1 for b in before]
        assert client.verify(tensors).mismatches == ()


def test_two_ranks_push_dtensor_shards_as_boxes(servers, tmp_path):
    zero, one = run_trainers(servers, tmp_path, "dtensors")
    addresses = [s.address for s in servers]
    for step in ("v1", "v2"):
        assert zero[step] == one[step] and sorted(zero[step]) == sorted(addresses)
        assert zero[f"{step}_full_equal"] and one[f"{step}_full_equal"]
        assert zero[f"{step}_mismatches"] == one[f"{step}_mismatches"] == []
    assert zero["v2"] == {a: zero["v1"][a] + 1 for a in addresses}
    for server in servers:
        assert server_checksums(server, names=sorted(dtensor_model(12))) == [local_checksums(dtensor_model(12))]


def test_two_ranks_push_an_fsdp2_model_as_it_is_sharded(servers, tmp_path):
    zero, one = run_trainers(servers, tmp_path, "fsdp")
    addresses = [s.address for s in servers]
    assert zero["v1_placements"] == ["(Shard(dim=0),)"]  # FSDP2's state dict: every parameter a DTensor shard
    for step in ("v1", "v2"):
        assert zero[step] == one[step] and sorted(zero[step]) == sorted(addresses)
        assert zero[f"{step}_mismatches"] == one[f"{step}_mismatches"] == []
        assert zero[f"{step}_full"] == one[f"{step}_full"]
    assert zero["v2"] == {a: zero["v1"][a] + 1 for a in addresses}
    assert zero["v1_full"] != zero["v2_full"]
    full = {name: torch.tensor(values).view(FSDP_SHAPES[name]) for name, values in zero["v2_full"].items()}
    for server in servers:  # the stored tensors, whole, bit for bit
        assert server_checksums(server, names=sorted(full)) == [local_checksums(full)]


FSDP_SHAPES = {"0.weight": (7, 5), "0.bias": (7,), "2.weight": (3, 7), "2.bias": (3,)}


def test_a_part_waits_for_committed_as_a_whole_push_does(servers, monkeypatch):
    """Committed's bound (a quiet stretch after the server's last message, client/streams.committed_within) is the
    client's timeout + 30 s for a part as for a whole push: the parts' join is over once Ready came (before, the
    part added Ready's own bound, the client's timeout + join_timeout, counting the client's timeout twice)."""
    from weightsync.client.push import job as push_job

    bounds: list[tuple[float, float]] = []
    real = push_job.PushRun

    def recording(*args, **kwargs):
        bounds.append((kwargs["ready_timeout"], kwargs["commit_timeout"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(push_job, "PushRun", recording)
    tensors = {"alone": torch.arange(32, dtype=torch.float32)}
    with WeightSyncClient([s.address for s in servers], timeout=50, part=Part(rank=0, world=1, join_timeout=45)) as c:
        c.push(tensors, version="alone", transport="inline", part_key="k-commit-bound", allow_new_tensors=True)
        assert c.verify(tensors).ok
    assert bounds == [(50 + 45, 50 + push_job.COMMIT_GRACE_SECONDS)]
