"""Delta per part (client/parts/push.py): each part compares its own whole tensors and boxes (DTensor shards: a
row box, a box in dimension 1) with its own kept copy and sends patches of them; every part names the update's
base; a refused base makes every part
send the whole version dense, under a key each derives alone (parts.dense_key); a failed push makes every
part forget its bases, so parts whose records diverged agree again.

Real processes: two trainer ranks (tests/sdk_parts_delta_trainer.py, one Gloo group) push five steps of one
model into two servers over INLINE, with the SDK's default delta, a store that moves on between two
steps, and a rank whose record of a server is lost. Then the rules' tables, and the patched plan
of a part (never compared while the bytes travel)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from sdk_parts_delta_trainer import BOXED, OWNS, full

from weightsync.client.channels.server_set import Server
from weightsync.client.delta.base import DeltaBase
from weightsync.client.parts.part import (
    KEY_PATTERN,
    Box,
    Declared,
    base_refused,
    check_key,
    dense_key,
)
from weightsync.client.parts.push import _boxed, _compared
from weightsync.client.push.patched import plan_patches
from weightsync.client.servers.records import ServerState
from weightsync.client.types import StoreGeneration
from weightsync.common.checksum import ws64
from weightsync.common.patches import is_patch
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import (
    free_port,
    local_checksums,
    run_ranks,
    server_checksums,
    start_servers,
)

pytestmark = pytest.mark.timeout(420)

TRAINER = Path(__file__).resolve().parents[1] / "sdk_parts_delta_trainer.py"
TRAINERS_TIMEOUT = 300


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    started = start_servers([tmp_path_factory.mktemp(f"sdk-parts-delta-{k}") for k in range(2)], workers=2)
    yield started
    for server in started:
        assert server.stop() == 0, server.log()[-3000:]



def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_two_parts_send_patches_of_their_whole_tensors_and_boxes_and_a_refused_base_goes_dense_from_both(
        servers, tmp_path):
    addresses = [s.address for s in servers]
    records = run_ranks([str(TRAINER), "{rank}", "2", str(free_port()), ",".join(addresses), str(tmp_path)], 2,
                        tmp_path, TRAINERS_TIMEOUT)
    model = full(8)
    box_bytes = sum(nbytes(model[name]) for name in BOXED) // 2  # each rank's half of the rows and of the columns
    dense = [sum(nbytes(model[n]) for n in OWNS[rank]) + box_bytes for rank in (0, 1)]
    (tmp_path / "records.json").write_text(json.dumps(records))  # for the report's table

    for step in (1, 2, 3, 4, 5, 7, 8):
        zero, one = (r[f"step{step}"] for r in records)
        # One generation per server for both parts; every tensor on every server bit for bit (verify, from
        # each rank, of the whole model); each server received what the two parts sent, no more.
        assert zero["generations"] == one["generations"] and sorted(zero["generations"]) == sorted(addresses)
        assert zero["mismatches"] == one["mismatches"] == [], step
        assert [r["dense_bytes"] for r in (zero, one)] == dense
        for address in addresses:
            assert zero["received"][address] == one["received"][address] == zero["bytes_sent"] + one["bytes_sent"]
        if step in (1, 4, 7):  # the first push, the one whose base the second server refused, the one after a
            # failed push (no base named): dense, whole
            assert [r["bytes_sent"] for r in (zero, one)] == dense, step
        else:  # 0.5% changed: patches of the whole tensors and of the boxes, under 2% of the part's dense bytes
            # (each box alone is over 2% of it: a box sent dense fails this)
            assert box_bytes // 2 > 0.02 * max(dense)
            for rank, record in enumerate((zero, one)):
                assert 0 < record["bytes_sent"] < 0.02 * dense[rank], (step, rank, record["bytes_sent"])

    generations = [records[0][f"step{s}"]["generations"] for s in (1, 2, 3, 4, 5, 7, 8)]
    first, second = addresses
    assert [g[first] for g in generations] == [1, 2, 3, 4, 5, 6, 7]
    assert records[0]["intruder"] == {second: 4}  # its store moved on: the base the parts name there is gone
    assert [g[second] for g in generations] == [1, 2, 3, 5, 6, 7, 8]  # the dense retry committed there
    # Step 6: rank 1 names no base to the first server, rank 0 its step-5 generation. The part that joins
    # there second is refused (PART_MISMATCH), and the first hears the same reason at once (not PARTS_MISSING at
    # the join deadline); nothing commits, both forget every base, and step 7 (dense, no base) commits on both.
    assert [r["step6"]["reason"] for r in records] == ["PART_MISMATCH", "PART_MISMATCH"]
    assert [r["step6"]["server"] for r in records] == [first, first]
    assert records[0]["after6"] == records[1]["after6"] == [5, 6]
    # The second server refused the parts' base (once: the retry names none); the first took it.
    assert servers[1].log().count('"part_reason": "BASE_MISMATCH"') == 1
    assert "BASE_MISMATCH" not in servers[0].log()
    for server in servers:
        assert server_checksums(server, names=sorted(model)) == [local_checksums(model)]


@pytest.mark.parametrize(("key", "derived"), [
    ("step-1-0a1b2c", "step-1-0a1b2c.dense"),
    ("k", "k.dense"),
    ("k.dense", "k.dense.dense"),  # a retry's retry key stays new
    ("x" * 122, "x" * 122 + ".dense"),  # just fits
    ("x" * 128, "x" * 122 + ".dense"),  # the end cut to stay within 128
    ("x" * 122 + ".dense", "x" * 122 + ".DENSE"),  # cutting would give the key back
    ("x" * 123 + ".dense"[:5], "x" * 122 + ".dense"),
])
def test_dense_key_is_a_new_valid_key_derived_from_the_key(key, derived):
    assert dense_key(check_key(key)) == derived
    assert derived != key and KEY_PATTERN.fullmatch(derived) and len(derived) <= 128


@pytest.mark.parametrize(("reason", "metadata", "refused"), [
    ("BASE_MISMATCH", {}, True),  # this part's own begin refused
    ("PART_FAILED", {"part": "0", "part_reason": "BASE_MISMATCH"}, True),  # another part's (or a late part's)
    ("PART_FAILED", {"part": "1", "part_reason": "STREAM_CLOSED"}, False),
    ("PART_FAILED", {}, False),
    ("PARTS_MISSING", {"missing": "1"}, False),
    ("PART_MISMATCH", {"field": "base_generation"}, False),  # parts that disagree: a failure, not a retry
    ("BASE_GENERATION_MISSING", {}, False),
    ("TENSOR_SHAPE_MISMATCH", {"part_reason": "BASE_MISMATCH"}, False),
])
def test_base_refused_reads_a_refusal_as_every_part_hears_it(reason, metadata, refused):
    assert base_refused(reason, metadata) is refused


def _server(address: str, *, workers: int, generation: StoreGeneration | None) -> ServerState:
    info = pb.GetServerInfoResponse(deferred_buckets=True, workers=[pb.WorkerInfo() for _ in range(workers)])
    return ServerState(Server(address, None, None, None), info=info, generation=generation)  # type: ignore[arg-type]


def test_a_parts_patched_plan_patches_its_boxes_as_their_local_shards_and_defers_nothing():
    """What push_part plans (its items: the whole tensors and each box's local shard; boxes=[]): a box's patch
    has the local shard's positions and checksum, and goes with the whole tensor's shape and its box."""
    g = torch.Generator().manual_seed(3)
    whole = torch.randn(64, 256, generator=g)
    local = whole[:, 128:].contiguous()  # the box [0:64, 128:256]: a box in dimension 1
    items = [("w", torch.randn(4096, generator=g)), ("v", torch.randn(2048, generator=g)), ("cols", local)]
    declared = [Declared("w", items[0][1], (4096,), None), Declared("v", items[1][1], (2048,), None),
                Declared("cols", local, (64, 256), Box((0, 128), (64, 128)))]
    delta = DeltaBase()
    delta.committed(items, None)
    changed = [(name, t.clone()) for name, t in items]
    changed[0][1][::512] += 1  # 8 of 4096 changed; v unchanged
    changed[2][1].view(-1)[::512] += 1  # 16 of the box's 8192 elements
    servers = [_server("s:1", workers=2, generation=StoreGeneration(5, 3))]
    slow = 1e6  # a link slow enough that a whole update compares while its bytes travel (deferred buckets)
    sizes = dict(bucket_size_bytes=1 << 20, zero_copy_min_bytes=1 << 20)

    whole_update = plan_patches(delta, changed, True, servers=servers, link=slow, collective=False, **sizes)
    assert whole_update is not None and whole_update.compare is not None  # the rule a part's plan sets aside
    whole_update.stop()

    delta = DeltaBase()
    delta.committed(items, None)
    context = SimpleNamespace(delta=delta, links=SimpleNamespace(cannot_pay=lambda items, transport: False))
    now = [Declared(d.name, t, d.shape, d.box) for d, (_, t) in zip(declared, changed, strict=True)]
    compared = _compared(context, dict(changed), now, True, "inline")  # type: ignore[arg-type]
    assert [name for name, _ in compared or []] == ["w", "v", "cols"]  # the box compared as its local shard
    patched = plan_patches(delta, compared, True, servers=servers, link=slow, collective=True, boxes=[], **sizes)
    assert patched is not None and patched.compare is None
    assert set(patched.delta.patches) == {"w", "cols"} and patched.delta.unchanged == {"v"}
    plan = _boxed(patched.choice.planned, patched.choice.source, declared).cached.plan
    specs = {s.name: s for b in plan.buckets for s in b.tensors}
    assert sorted(specs) == ["cols", "w"]  # v left out, w and the box as their patches
    cols = specs["cols"]
    assert is_patch(cols.encoding) and cols.patch_count == 16 and list(cols.shape) == [64, 256]
    assert (list(cols.box.offsets), list(cols.box.sizes)) == ([0, 128], [64, 128])
    assert cols.checksum.value == ws64(changed[2][1])  # the box's WS64 once patched
    assert specs["w"].patch_count == 8 and not specs["w"].HasField("box")
    assert patched.bases == {"s:1": StoreGeneration(5, 3)}
