"""verify per part: GetTensorChecksumsRequest.boxes (server/store/box_checksums.py) and verify() of DTensors
(client/parts/verify.py).

- The box checksum rule against tensors built by hand (ws64 of a literal tensor, and ws64_reference of its
  bytes), and checked_boxes' refusals as a table.
- A real server: good boxes answer what the hand-built boxes give; bad ones (unknown name, a box past the
  shape, a wrong rank, a size 0) get their exact code and reason, and a normal call still answers after
  each; a --tensors subset node lists a box's name in not_stored.
- Two real trainer processes (tests/sdk_part_verify_trainer.py, Gloo) push DTensors (Shard(0) uneven,
  Shard(1) uneven, Replicate) as parts and verify() them as they are: no mismatches; then one element changed
  on the servers is reported by exactly the ranks whose box holds it (the replicated one by both); the next
  push verifies clean, and a DTensor no server holds is reported missing box by box.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from sdk_part_verify_trainer import full_model

from weightsync.client import WeightSyncClient
from weightsync.common.checksum import ws64, ws64_reference
from weightsync.common.errors import WeightSyncError
from weightsync.server.store.box_checksums import AskedBox, box_checksum, checked_boxes
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import error_info, free_port, run_ranks, start_server, start_servers

pytestmark = pytest.mark.timeout(420)

TRAINER = Path(__file__).resolve().parents[1] / "sdk_part_verify_trainer.py"
GRID = torch.arange(24, dtype=torch.float32).view(4, 6)
"""0 1 2 3 4 5 / 6 7 8 9 10 11 / 12 ... / 18 ... 23."""


def ref(name: str, offsets: list[int], sizes: list[int]) -> pb.TensorBoxRef:
    return pb.TensorBoxRef(name=name, box=tensor_pb2.TensorBox(offsets=offsets, sizes=sizes))


# -- the rule, against literal boxes --------------------------------------------------------------------------
@pytest.mark.parametrize(("offsets", "sizes", "by_hand"), [
    ((0, 0), (4, 6), GRID.clone()),                                               # the whole tensor
    ((1, 0), (2, 6), torch.tensor([[6., 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17]])),  # a row range
    ((0, 4), (4, 2), torch.tensor([[4., 5], [10, 11], [16, 17], [22, 23]])),      # a column range
    ((1, 2), (2, 3), torch.tensor([[8., 9, 10], [14, 15, 16]])),                  # an inner box
    ((3, 5), (1, 1), torch.tensor([[23.]])),                                      # one element
])
def test_a_box_checksum_is_the_ws64_of_its_elements_row_major(offsets, sizes, by_hand):
    expected = ws64(by_hand)
    assert expected == ws64_reference(by_hand.numpy().tobytes())
    assert box_checksum(GRID, offsets, sizes) == expected


def test_a_box_checksum_reads_the_box_of_a_bf16_3d_tensor_and_a_scalar():
    cube = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4).to(torch.bfloat16)
    by_hand = torch.tensor([[[5.0, 6.0], [9.0, 10.0]], [[17.0, 18.0], [21.0, 22.0]]], dtype=torch.bfloat16)
    assert box_checksum(cube, (0, 1, 1), (2, 2, 2)) == ws64(by_hand)
    assert box_checksum(torch.tensor(7.5), (), ()) == ws64(torch.tensor(7.5))


SHAPES = {"w": (4, 6), "s": (), "v": (5,)}


@pytest.mark.parametrize(("offsets", "sizes", "shape_text", "box_text"), [
    ([0], [4], "[4, 6]", "[0:4]"),                       # one dimension short
    ([0, 0, 0], [4, 6, 1], "[4, 6]", "[0:4, 0:6, 0:1]"),  # one too many
    ([0, 0], [4, 0], "[4, 6]", "[0:4, 0:0]"),            # a size below 1
    ([-1, 0], [2, 6], "[4, 6]", "[-1:1, 0:6]"),          # before the start
    ([3, 0], [2, 6], "[4, 6]", "[3:5, 0:6]"),            # past the end
    ([0, 0], [4, 7], "[4, 6]", "[0:4, 0:7]"),
])
def test_checked_boxes_refuses_a_box_outside_its_tensor(offsets, sizes, shape_text, box_text):
    with pytest.raises(WeightSyncError) as caught:
        checked_boxes([ref("v", [0], [5]), ref("w", offsets, sizes)], SHAPES, lambda name: True)
    assert (caught.value.code, caught.value.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "BOX_OUT_OF_SHAPE")
    assert caught.value.metadata == {"tensor": "w", "box": box_text, "shape": shape_text}


def test_checked_boxes_keeps_order_and_repeats_and_leaves_out_what_the_node_does_not_store():
    asked = [ref("w", [2, 0], [2, 6]), ref("s", [], []), ref("x", [0], [1]), ref("w", [2, 0], [2, 6])]
    assert checked_boxes(asked, SHAPES, lambda name: name != "x") == [
        AskedBox("w", (2, 0), (2, 6)), AskedBox("s", (), ()), AskedBox("w", (2, 0), (2, 6))]


# -- a real server ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = start_server(tmp_path_factory.mktemp("part-verify"), workers=2)
    yield started
    assert started.stop() == 0, started.log()[-3000:]


STORED = {"grid": GRID, "cube": torch.arange(60, dtype=torch.int64).view(3, 4, 5), "b": torch.randn(9)}


def test_the_server_answers_boxes_and_refuses_bad_ones_exactly(server):
    with WeightSyncClient(server.address) as client:
        client.push(STORED, version="v1", mode="staged", transport="inline", allow_new_tensors=True)
    stub = server.stub()

    def good_call() -> pb.GetTensorChecksumsResponse:
        return stub.GetTensorChecksums(pb.GetTensorChecksumsRequest(
            names=["b"], boxes=[ref("grid", [1, 2], [2, 3]), ref("cube", [1, 0, 3], [2, 4, 2]),
                                ref("grid", [1, 2], [2, 3])]), timeout=30)

    answer = good_call()
    assert [t.name for t in answer.tensors] == ["b"] and answer.tensors[0].checksum.value == ws64(STORED["b"])
    assert [(b.name, list(b.box.offsets), list(b.box.sizes), b.checksum.value) for b in answer.boxes] == [
        ("grid", [1, 2], [2, 3], ws64(torch.tensor([[8., 9, 10], [14, 15, 16]]))),
        ("cube", [1, 0, 3], [2, 4, 2], ws64(torch.tensor([[[23, 24], [28, 29], [33, 34], [38, 39]],
                                                          [[43, 44], [48, 49], [53, 54], [58, 59]]]))),
        ("grid", [1, 2], [2, 3], ws64(torch.tensor([[8., 9, 10], [14, 15, 16]]))),
    ]
    assert all(b.checksum.algorithm == tensor_pb2.CHECKSUM_ALGORITHM_WS64 for b in answer.boxes)
    # Boxes alone: no whole tensor (empty names means none here, not every tensor).
    alone = stub.GetTensorChecksums(pb.GetTensorChecksumsRequest(boxes=[ref("grid", [0, 0], [4, 6])]), timeout=30)
    assert list(alone.tensors) == [] and [b.checksum.value for b in alone.boxes] == [ws64(GRID)]

    bad = [
        (ref("nope", [0], [1]), grpc.StatusCode.NOT_FOUND, "TENSOR_NOT_FOUND", {"count": "1", "tensors": "nope"}),
        (ref("grid", [3, 0], [2, 6]), grpc.StatusCode.INVALID_ARGUMENT, "BOX_OUT_OF_SHAPE",
         {"tensor": "grid", "box": "[3:5, 0:6]", "shape": "[4, 6]"}),
        (ref("grid", [0], [4]), grpc.StatusCode.INVALID_ARGUMENT, "BOX_OUT_OF_SHAPE",
         {"tensor": "grid", "box": "[0:4]", "shape": "[4, 6]"}),
        (ref("b", [0], [0]), grpc.StatusCode.INVALID_ARGUMENT, "BOX_OUT_OF_SHAPE",
         {"tensor": "b", "box": "[0:0]", "shape": "[9]"}),
    ]
    for box, code, reason, metadata in bad:
        with pytest.raises(grpc.RpcError) as caught:
            stub.GetTensorChecksums(pb.GetTensorChecksumsRequest(names=["b"], boxes=[ref("grid", [0, 0], [1, 1]), box]),
                                    timeout=30)
        info = error_info(caught.value)
        assert (caught.value.code(), info.reason, dict(info.metadata)) == (code, reason, metadata), box
        assert good_call() == answer  # a normal call answers the same after each refusal

    # The next normal push, then a verify of the whole and a box of what it wrote.
    with WeightSyncClient(server.address) as client:
        grid2 = GRID * 2
        client.push({"grid": grid2}, version="v2", mode="staged", transport="inline")
        assert client.verify({"grid": grid2}).ok
    again = stub.GetTensorChecksums(pb.GetTensorChecksumsRequest(boxes=[ref("grid", [1, 2], [2, 3])]), timeout=30)
    assert [b.checksum.value for b in again.boxes] == [ws64(torch.tensor([[16., 18, 20], [28, 30, 32]]))]


def test_a_subset_node_lists_a_box_of_a_tensor_it_does_not_store_in_not_stored(tmp_path):
    subset = start_server(tmp_path, "--tensors", "^grid$", workers=1)
    try:
        with WeightSyncClient(subset.address) as client:
            client.push({"grid": GRID, "b": STORED["b"]}, version="v1", mode="staged", transport="inline",
                        allow_new_tensors=True)
        answer = subset.stub().GetTensorChecksums(pb.GetTensorChecksumsRequest(
            boxes=[ref("b", [0], [3]), ref("grid", [0, 0], [2, 6])]), timeout=30)
        assert list(answer.not_stored) == ["b"]
        assert [(b.name, b.checksum.value) for b in answer.boxes] == [("grid", ws64(GRID[:2]))]
    finally:
        assert subset.stop() == 0, subset.log()[-3000:]


# -- two real trainer ranks ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    started = start_servers([tmp_path_factory.mktemp(f"part-verify-{k}") for k in range(2)], workers=1)
    yield started
    for s in started:
        assert s.stop() == 0, s.log()[-3000:]



def test_each_rank_verifies_its_own_dtensor_boxes_and_only_the_holders_see_a_changed_element(servers, tmp_path):
    addresses = [s.address for s in servers]
    zero, one = run_ranks([str(TRAINER), "{rank}", "2", str(free_port()), ",".join(addresses), str(tmp_path)],
                          2, tmp_path, 300)
    # Rank 0 holds rows 0:5, columns 0:5, the replica and plain0; rank 1 rows 5:9 and columns 5:9.
    assert zero["v1_boxes"] == {"rows": [5, 5], "cols": [6, 5], "norm": [5], "plain0": [33]}
    assert one["v1_boxes"] == {"rows": [4, 5], "cols": [6, 4], "norm": [5]}
    for step in ("v1", "v2"):
        assert zero[step] == {"checked": 4, "mismatches": []}
        assert one[step] == {"checked": 3, "mismatches": []}

    def on_both(label: str) -> list[str]:
        return sorted(f"{a}|{label}|False" for a in addresses)

    assert zero["tamper_rows"] == {"checked": 4, "mismatches": []}
    assert one["tamper_rows"] == {"checked": 3, "mismatches": on_both("rows[5:9, 0:5]")}
    assert zero["tamper_cols"] == {"checked": 4, "mismatches": on_both("cols[0:6, 0:5]")}
    assert one["tamper_cols"] == {"checked": 3, "mismatches": []}
    assert zero["tamper_norm"] == {"checked": 4, "mismatches": on_both("norm")}
    assert one["tamper_norm"] == {"checked": 3, "mismatches": on_both("norm")}
    assert zero["absent"] == {"checked": 5, "mismatches": sorted(f"{a}|absent[0:5, 0:2]|True" for a in addresses)}
    assert one["absent"] == {"checked": 4, "mismatches": sorted(f"{a}|absent[5:9, 0:2]|True" for a in addresses)}
    # The servers hold v2 whole, bit for bit.
    for s in servers:
        answer = s.stub().GetTensorChecksums(pb.GetTensorChecksumsRequest(names=["cols", "norm", "rows"]), timeout=30)
        assert {t.name: t.checksum.value for t in answer.tensors} == {
            n: ws64(t) for n, t in full_model(22).items() if n != "plain0"}
