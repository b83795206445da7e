"""The rules of what one part sends (client/parts/part.py) and how the parts agree (client/parts/agreement.py), by
table: placements, mesh coordinates and the global shape -> the box this rank sends; the key rules; the
agreement records -> rank 0's key or every failing rank named; a backend's error -> the peer it names and the
typed PartGroupFailed."""

from __future__ import annotations

import datetime

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from weightsync.client.errors import PartGroupFailed, PartInputsRefused, WeightSyncClientError
from weightsync.client.parts.agreement import decide, encode, group_failed, named_peer
from weightsync.client.parts.part import (
    KEY_PATTERN,
    WHOLE,
    Box,
    Declared,
    Part,
    check_key,
    declare,
    draw_key,
    local_box,
)
from weightsync.v1 import tensor_pb2

B = Box
BOXES = [
    # placements, coordinate, mesh shape, global shape -> what this rank sends
    ((Shard(0),), (0,), (2,), (8, 4), B((0, 0), (4, 4))),
    ((Shard(0),), (1,), (2,), (8, 4), B((4, 0), (4, 4))),
    ((Shard(1),), (0,), (2,), (8, 4), B((0, 0), (8, 2))),
    ((Shard(1),), (1,), (2,), (8, 4), B((0, 2), (8, 2))),
    ((Shard(-1),), (1,), (2,), (8, 4), B((0, 2), (8, 2))),  # a negative dim counts from the end
    # uneven: torch.chunk's split, ceil(5 / 2) = 3 rows then 2
    ((Shard(0),), (0,), (2,), (5, 3), B((0, 0), (3, 3))),
    ((Shard(0),), (1,), (2,), (5, 3), B((3, 0), (2, 3))),
    # 5 rows over 4 ranks: chunks of 2, 2, 1 and an empty one, which declares nothing
    ((Shard(0),), (2,), (4,), (5, 3), B((4, 0), (1, 3))),
    ((Shard(0),), (3,), (4,), (5, 3), None),
    # one row over 2 ranks: rank 0 holds all of it (whole), rank 1 nothing
    ((Shard(0),), (0,), (2,), (1, 6), WHOLE),
    ((Shard(0),), (1,), (2,), (1, 6), None),
    # replicated: mesh coordinate 0 sends it whole, the others nothing
    ((Replicate(),), (0,), (2,), (8, 4), WHOLE),
    ((Replicate(),), (1,), (2,), (8, 4), None),
    ((Replicate(),), (0,), (2,), (), WHOLE),  # a 0-d tensor
    ((Replicate(),), (1,), (2,), (), None),
    # a 2-D mesh: sharded on mesh dim 0, replicated on mesh dim 1 (HSDP): only column 0 of the mesh sends
    ((Shard(0), Replicate()), (1, 0), (2, 2), (8, 4), B((4, 0), (4, 4))),
    ((Shard(0), Replicate()), (1, 1), (2, 2), (8, 4), None),
    # two tensor dims over a 2-D mesh
    ((Shard(0), Shard(1)), (1, 0), (2, 2), (8, 4), B((4, 0), (4, 2))),
    ((Shard(0), Shard(1)), (0, 1), (2, 2), (8, 4), B((0, 2), (4, 2))),
    # one tensor dim over both mesh dims: mesh dim 0 first, then mesh dim 1 within its chunk
    ((Shard(0), Shard(0)), (1, 1), (2, 2), (8, 4), B((6, 0), (2, 4))),
    ((Shard(0), Shard(0)), (0, 1), (2, 2), (7, 4), B((2, 0), (2, 4))),
    ((Shard(0), Shard(0)), (1, 1), (2, 2), (7, 4), B((6, 0), (1, 4))),
    # a mesh dim of size 1 shards nothing: the whole tensor
    ((Shard(0),), (0,), (1,), (8, 4), WHOLE),
    # an empty tensor is owned whole by the rank at coordinate 0, by no other
    ((Shard(0),), (0,), (2,), (0, 4), WHOLE),
    ((Shard(0),), (1,), (2,), (0, 4), None),
]


@pytest.mark.parametrize(("placements", "coordinate", "mesh", "shape", "expected"), BOXES)
def test_local_box(placements, coordinate, mesh, shape, expected):
    assert local_box(placements, coordinate, mesh, shape) == expected


@pytest.mark.parametrize(("placements", "says"), [
    ((Partial(),), "pending sums"),
    ((Shard(0), Partial("sum")), "pending sums"),
    ((_StridedShard(0, split_factor=2),), "strided shard"),
])
def test_placements_that_cannot_be_sent_are_refused(placements, says):
    with pytest.raises(ValueError, match=says):
        local_box(placements, (0,) * len(placements), (2,) * len(placements), (8, 4))


def test_plain_tensors_are_declared_whole():
    w, b = torch.ones(4, 2), torch.zeros(3)
    assert declare([("w", w), ("b", b)]) == [Declared("w", w, (4, 2), None), Declared("b", b, (3,), None)]


def test_the_part_message_lists_whole_tensors_and_boxes():
    box = Box((4, 0), (4, 4))
    declared = [Declared("w", torch.ones(2), (2,), None), Declared("x", torch.ones(4, 4), (8, 4), box)]
    proto = Part(rank=1, world=2, join_timeout=12.5).proto("step-3-ab12", declared)
    assert (proto.update_key, proto.rank, proto.world, list(proto.whole_tensors)) == ("step-3-ab12", 1, 2, ["w"])
    assert [(p.name, [(list(b.offsets), list(b.sizes)) for b in p.boxes]) for p in proto.boxed_tensors] == [
        ("x", [([4, 0], [4, 4])])]
    assert proto.join_timeout.ToTimedelta() == datetime.timedelta(seconds=12.5)
    assert box.proto() == tensor_pb2.TensorBox(offsets=[4, 0], sizes=[4, 4])


@pytest.mark.parametrize(("kwargs", "says"), [
    (dict(rank=2, world=2), "rank"),
    (dict(rank=-1, world=2), "rank"),
    (dict(rank=0, world=0), "world"),
    (dict(rank=True, world=2), "rank"),
    (dict(rank=0, world=2, join_timeout=0), "join_timeout"),
    (dict(rank=0, world=2, join_timeout=3601), "join_timeout"),
])
def test_a_bad_part_is_refused(kwargs, says):
    with pytest.raises(ValueError, match=says):
        Part(**kwargs)


@pytest.mark.parametrize(("key", "ok"), [
    ("step-1.a_b", True), ("x" * 128, True), ("", False), ("x" * 129, False), ("step 1", False),
    ("step/1", False), (7, False),
])
def test_keys(key, ok):
    if ok:
        assert check_key(key) == key
    else:
        with pytest.raises(ValueError, match="part_key"):
            check_key(key)


@pytest.mark.parametrize("version", ["step-1", "a/b c:d", "", "v" * 500, "é"])
def test_drawn_keys_are_valid_and_fresh(version):
    first, second = draw_key(version), draw_key(version)
    assert KEY_PATTERN.fullmatch(first) and KEY_PATTERN.fullmatch(second) and first != second


def test_every_rank_learns_rank_0s_key():
    records = [encode("step-7-0abc", None), encode("", None), encode("ignored", None)]
    assert decide(records, 2) == "step-7-0abc"


def test_every_failing_rank_is_named_with_what_it_said():
    records = [encode("k", None), encode("", TypeError("tensor 'w' is a str")), encode("", None),
               encode("", ValueError("é" * 600))]
    with pytest.raises(PartInputsRefused) as caught:
        decide(records, 0)
    assert caught.value.ranks == (1, 3)
    assert caught.value.messages[1] == "TypeError: tensor 'w' is a str"
    assert caught.value.messages[3].startswith("ValueError: éé")  # shortened to the record, still decodable
    assert "ranks [1, 3]" in str(caught.value)


def test_a_record_that_never_came_counts_as_a_failure():
    with pytest.raises(PartInputsRefused) as caught:
        decide([encode("k", None), torch.zeros(512, dtype=torch.uint8)], 0)
    assert caught.value.ranks == (1,)


GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:11137. This is typically caused by a remote worker crashing.")
GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:14041: "
              "Connection reset by peer. This is typically caused by a remote worker hanging.")
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "5000ms for recv operation to complete")


@pytest.mark.parametrize(("message", "peer"), [
    (GLOO_CLOSED, "[127.0.0.1]:11137"),  # Gloo names the peer's address, never its rank
    (GLOO_RESET, "[10.0.0.2]:14041"),
    ("Connection closed by peer [fe80::1%eth0]:41234", "[fe80::1%eth0]:41234"),
    (GLOO_TIMEOUT, None),  # a timeout names nobody; the source location is no address
    ("NCCL error: remote process exited (peer rank 3)", "rank 3"),
    ("[Rank 0] Watchdog caught collective operation timeout", None),  # this rank's own, not a peer
    ("", None),
])
def test_the_peer_a_backend_error_names(message, peer):
    assert named_peer(message) == peer


@pytest.mark.parametrize(("message", "during", "timed_out", "says"), [
    (GLOO_CLOSED, "push", False, "part 1 of 3: push failed before anything was sent: a part of the parts' group "
     "(Part.group) is gone (the connection to [127.0.0.1]:11137 closed); the backend said: " + GLOO_CLOSED),
    (GLOO_TIMEOUT, "create_group", True, "part 1 of 3: create_group failed before anything was sent: a part of the "
     "parts' group (Part.group) did not answer within the group's timeout; the backend said: " + GLOO_TIMEOUT),
    ("", "push", False, "part 1 of 3: push failed before anything was sent: a part of the parts' group (Part.group) "
     "is gone; the backend said: no message"),
])
def test_a_failed_group_is_typed(message, during, timed_out, says):
    failed = group_failed(message, rank=1, world=3, during=during)
    assert isinstance(failed, PartGroupFailed) and isinstance(failed, WeightSyncClientError)
    assert (str(failed), failed.rank, failed.world, failed.during, failed.timed_out) == (says, 1, 3, during, timed_out)
