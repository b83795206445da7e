"""verify() per part on a subset node (--tensors): a node answers for exactly what it should hold.

- The rule (store_checksums.not_its_to_hold), as a literal table: which asked names a server's answer leaves
  out (not its to hold), for a whole process's verify and for a part rank's share, and part_mismatches on
  literal answers (a rank wholly outside a node's subset, a wrong and an absent tensor inside it, an empty
  node that vouches for nothing).
- Two real trainer ranks (tests/sdk_part_verify_subset_trainer.py, Gloo) push a two-stage model as parts to
  a whole node and a node holding stage 0 only: rank 1's share lies wholly outside the subset node, and
  verify()s clean there (with DTensors and with its plain tensor alone); one element changed inside the
  subset is reported on both nodes, one outside it on the whole node only; an absent tensor likewise; the
  empty nodes before the first push vouch for nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from sdk_part_verify_subset_trainer import SUBSET, full_model

from weightsync.client.parts.part import Box
from weightsync.client.parts.verify import Checked, part_mismatches
from weightsync.client.servers.checksums import not_its_to_hold
from weightsync.client.types import TensorMismatch
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import free_port, local_checksums, run_ranks, server_checksums, start_server

pytestmark = pytest.mark.timeout(420)

TRAINER = Path(__file__).resolve().parents[1] / "sdk_part_verify_subset_trainer.py"
EMPTY, CONSISTENT = pb.STORE_STATE_EMPTY, pb.STORE_STATE_CONSISTENT


def answer(not_stored: list[str], state: int = CONSISTENT, wholes: dict[str, int] | None = None,
           boxes: list[tuple[str, tuple[int, ...], tuple[int, ...], int]] = ()) -> pb.GetTensorChecksumsResponse:
    def checksum(value: int) -> tensor_pb2.Checksum:
        return tensor_pb2.Checksum(algorithm=tensor_pb2.CHECKSUM_ALGORITHM_WS64, value=value)

    return pb.GetTensorChecksumsResponse(
        store_state=state, not_stored=not_stored,
        tensors=[pb.TensorChecksum(name=n, checksum=checksum(v)) for n, v in (wholes or {}).items()],
        boxes=[pb.BoxChecksum(name=n, box=tensor_pb2.TensorBox(offsets=o, sizes=s), checksum=checksum(v))
               for n, o, s, v in boxes])


# -- the rule, as a table ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("asked", "not_stored", "state", "share", "outside"), [
    # Some asked names inside the subset: the others are not its to hold, whoever asks.
    ({"a", "b", "c"}, ["b", "c"], CONSISTENT, False, {"b", "c"}),
    ({"a", "b", "c"}, ["b", "c"], CONSISTENT, True, {"b", "c"}),
    ({"a", "b"}, ["b"], EMPTY, True, {"b"}),
    # Not a subset node, or none outside: everything is checked.
    ({"a", "b"}, [], CONSISTENT, True, set()),
    ({"a", "b"}, [], CONSISTENT, False, set()),
    # Every asked name outside: a part rank's share (a pipeline stage against another stage's node) is not
    # its to hold, while a whole process's model matching none of its pattern is (it vouches for nothing).
    ({"a", "b"}, ["a", "b"], CONSISTENT, True, {"a", "b"}),
    ({"a", "b"}, ["a", "b"], CONSISTENT, False, set()),
    # A node that holds nothing at all vouches for nothing, part or not.
    ({"a", "b"}, ["a", "b"], EMPTY, True, set()),
    ({"a", "b"}, ["a", "b"], EMPTY, False, set()),
    # Names the server listed beyond those asked do not count.
    ({"a"}, ["a", "z"], CONSISTENT, True, {"a"}),
    ({"a"}, ["a", "z"], CONSISTENT, False, set()),
    # Nothing asked: nothing to leave out.
    (set(), [], EMPTY, True, set()),
])
def test_not_its_to_hold(asked, not_stored, state, share, outside):
    assert not_its_to_hold(answer(not_stored, state), asked, share=share) == frozenset(outside)


ROWS = Checked("rows", Box((5, 0), (4, 5)), 11)
NORM = Checked("norm", None, 12)
STAGE1 = Checked("stage1.w", None, 13)
STAGE0 = Checked("stage0.w", None, 14)
ABSENT = Checked("stage0.absent", None, 15)


@pytest.mark.parametrize(("checked", "server_answer", "missing", "found"), [
    # A rank wholly outside the node's subset: nothing reported there.
    ([ROWS, NORM, STAGE1], answer(["norm", "rows", "stage1.w"]), set(), []),
    # ... unless the node holds nothing at all: every check missing there, boxes named by their box.
    ([ROWS, NORM, STAGE1], answer(["norm", "rows", "stage1.w"], EMPTY), set(),
     [("rows[5:9, 0:5]", 11, None), ("norm", 12, None), ("stage1.w", 13, None)]),
    # Inside the subset: a wrong tensor and an absent one (TENSOR_NOT_FOUND named it) are reported, the
    # names outside are not.
    ([ROWS, NORM, STAGE0, ABSENT], answer(["norm", "rows"], wholes={"stage0.w": 99}), {"stage0.absent"},
     [("stage0.w", 14, 99), ("stage0.absent", 15, None)]),
    ([ROWS, NORM, STAGE0], answer(["norm", "rows"], wholes={"stage0.w": 14}), set(), []),
    # A whole node: every check compared, a box by its box.
    ([ROWS, NORM], answer([], wholes={"norm": 12}, boxes=[("rows", (5, 0), (4, 5), 10)]), set(),
     [("rows[5:9, 0:5]", 11, 10)]),
])
def test_part_mismatches_report_what_the_node_should_hold(checked, server_answer, missing, found):
    assert part_mismatches("s:1", server_answer, checked, frozenset(missing), share=True) == [
        TensorMismatch("s:1", label, local, remote) for label, local, remote in found]


# -- two real trainer ranks, a whole node and a subset node -----------------------------------------------------
@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    started = [start_server(tmp_path_factory.mktemp("part-verify-whole"), workers=1)]
    started.append(start_server(tmp_path_factory.mktemp("part-verify-subset"), "--tensors", SUBSET, workers=1))
    yield started
    for s in started:
        assert s.stop() == 0, s.log()[-3000:]


def test_each_rank_verifies_what_each_node_should_hold(nodes, tmp_path):
    whole, subset = (s.address for s in nodes)
    zero, one = run_ranks([str(TRAINER), "{rank}", "2", str(free_port()), f"{whole},{subset}", str(tmp_path)],
                          2, tmp_path, 300)

    def on(*entries: tuple[str, str, bool]) -> dict:
        return sorted(f"{server}|{name}|{none}" for server, name, none in entries)

    rank0 = ("rows[0:5, 0:5]", "norm", "stage0.w", "stage0.b")
    rank1 = ("rows[5:9, 0:5]", "norm", "stage1.w")
    # Before any push: the whole node lacks everything; the subset node lacks rank 0's stage 0 tensors, and
    # holds nothing at all, so it vouches for nothing of rank 1's share either.
    assert zero["fresh"] == {"checked": 4, "mismatches": on(*((whole, n, True) for n in rank0),
                                                           (subset, "stage0.w", True), (subset, "stage0.b", True))}
    assert one["fresh"] == {"checked": 3, "mismatches": on(*((a, n, True) for a in (whole, subset) for n in rank1))}
    # Rank 1's share lies wholly outside the subset node: clean there, with its DTensors and its plain tensor.
    assert zero["v1"] == {"checked": 4, "mismatches": []}
    assert one["v1"] == {"checked": 3, "mismatches": []}
    assert one["v1_plain"] == {"checked": 1, "mismatches": []}
    # One element changed inside the subset (stage0.w): both nodes; one outside it (stage1.w): the whole one.
    assert zero["tampered"] == {"checked": 4, "mismatches": on((whole, "stage0.w", False),
                                                              (subset, "stage0.w", False))}
    assert one["tampered"] == {"checked": 3, "mismatches": on((whole, "stage1.w", False))}
    # The next normal push verifies clean; an absent tensor inside the subset is missing on both nodes, one
    # outside it on the whole node only.
    assert zero["v2"] == {"checked": 4, "mismatches": []}
    assert one["v2"] == {"checked": 3, "mismatches": []}
    assert zero["absent"] == {"checked": 5, "mismatches": on((whole, "stage0.absent", True),
                                                            (subset, "stage0.absent", True))}
    assert one["absent"] == {"checked": 4, "mismatches": on((whole, "stage1.absent", True))}
    # The nodes hold v2, each exactly its tensors, bit for bit.
    v2 = full_model(32)
    assert server_checksums(nodes[0]) == [local_checksums(v2)]
    assert server_checksums(nodes[1]) == [local_checksums({n: t for n, t in v2.items() if re.search(SUBSET, n)})]
