"""What a trainer can hand the SDK: bad values, gapped views, threads,
iterators, and failures that must still carry a status (defects 8, 11, 12, 14, 15)."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
import torch

from weightsync.client import UpdateFailed, WeightSyncClient
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import local_checksums, server_checksums
from models import mixed_model

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def client(server):
    with WeightSyncClient(server.address) as client:
        client.create_group(timeout=30)
        client.push(mixed_model(51), version="base", bucket_size_bytes=1 << 20, allow_new_tensors=True)
        yield client


def generation(client) -> int:
    return client.server_info()[0].current_version.generation


# -- defect 14: a clear TypeError/ValueError naming the tensor, before anything is sent --------------
BAD = [
    ("a float", {"x": 1.5}, TypeError, "tensor 'x' is a float, not a torch.Tensor"),
    ("a list", {"x": [1, 2]}, TypeError, "tensor 'x' is a list"),
    ("None", {"x": None}, TypeError, "tensor 'x' is a NoneType"),
    ("numpy", {"x": np.zeros(3)}, TypeError, "torch.from_numpy"),
    ("an int key", {3: torch.zeros(2)}, TypeError, "tensor names must be str, got int 3"),
    ("sparse", {"x": torch.zeros(3, 3).to_sparse()}, ValueError, "tensor 'x' has layout torch.sparse_coo"),
    ("meta", {"x": torch.empty(3, device="meta")}, ValueError, "tensor 'x' is on the meta device"),
    ("complex", {"x": torch.zeros(2, dtype=torch.complex64)}, ValueError, "tensor 'x': dtype torch.complex64"),
]


@pytest.mark.parametrize(("what", "named", "kind", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_values_are_refused_before_anything_is_sent(client, what, named, kind, message):
    before = generation(client)
    with pytest.raises(kind, match=message.replace("(", r"\(").replace(")", r"\)")):
        client.push(named, version="bad", mode="in_place")
    with pytest.raises(kind):
        client.push(iter(named.items()), version="bad-iter", mode="in_place")
    assert generation(client) == before
    assert client.server_info()[0].store_state == pb.STORE_STATE_CONSISTENT
    model = mixed_model(52)
    client.push(model, version="after-bad", bucket_size_bytes=1 << 20)  # the next normal push
    assert client.verify(model).ok


# -- defect 15: views with gaps send only their own bytes ---------------------------------------------
def test_views_far_apart_in_one_storage_send_only_their_bytes(client):
    storage = torch.zeros(2 << 20, dtype=torch.float32)  # 8 MiB
    named = {"near": storage[:16], "far": storage[-16:]}
    named["near"].fill_(1.0)
    named["far"].fill_(2.0)
    before = client.server_info()[0].workers[0].store_bytes
    result = client.push(named, version="gapped", allow_new_tensors=True)
    assert result.size_bytes <= 4096, f"{result.size_bytes} bytes sent for 128 bytes of tensors"
    assert client.verify(named).ok
    assert client.server_info()[0].workers[0].store_bytes - before <= 4096


# -- defect 8: one client, two threads ------------------------------------------------------------------
def test_one_client_pushed_from_two_threads(client, server):
    models = {i: mixed_model(60 + i) for i in range(2)}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def run(i: int) -> None:
        try:
            barrier.wait()
            for k in range(3):
                client.push(models[i], version=f"thread-{i}-{k}", bucket_size_bytes=1 << 18)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    last = client.server_info()[0].current_version.version
    assert last.startswith("thread-") and last.endswith("-2")
    assert client.verify(models[int(last.split("-")[1])]).ok
    model = mixed_model(63)  # then single-threaded pushes with other layouts still work
    client.push(model, version="single", bucket_size_bytes=1 << 20)
    assert server_checksums(server, sorted(model)) == [local_checksums(model)]


# -- defect 12: iterators do what the docstring says ----------------------------------------------------
def test_iterators_are_checked_before_bytes_move_or_streamed_staged(client, server):
    committed = mixed_model(70)
    client.push(committed, version="it-base", bucket_size_bytes=1 << 20)
    names = list(committed)
    # Matches the plan for 11 names, then diverges: IN_PLACE materialises and refuses before a byte moves.
    diverging = [(n, committed[n]) for n in names[:11]] + [(names[11], torch.zeros(5, dtype=committed[names[11]].dtype))]
    with pytest.raises(UpdateFailed) as caught:
        client.push(iter(diverging), version="diverge")
    assert (caught.value.code, caught.value.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "TENSOR_SHAPE_MISMATCH")
    assert client.server_info()[0].store_state == pb.STORE_STATE_CONSISTENT  # nothing was overwritten
    assert client.verify(committed).ok
    # A partial iterator: a subset update, as with a dict.
    subset = [(n, committed[n] + 1) for n in names[:3] if committed[n].is_floating_point()]
    client.push(iter(subset), version="subset")
    assert client.verify(dict(subset)).ok
    # STAGED streams against the committed plan; a divergence aborts with nothing changed.
    client.push(committed, version="it-base-2", bucket_size_bytes=1 << 20)
    with pytest.raises(UpdateFailed) as caught:
        client.push(iter(diverging), version="diverge-staged", mode="staged")
    assert (caught.value.code, caught.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "PLAN_MISMATCH")
    assert client.verify(committed).ok
    streamed = mixed_model(71)
    client.push(iter(streamed.items()), version="streamed", mode="staged")
    assert client.verify(streamed).ok


# -- a name streamed twice is a duplicate, not a stranger ------------------------------------------------
@pytest.mark.parametrize("where", ["mid-plan", "after the plan"])
def test_a_name_streamed_twice_is_reported_as_a_duplicate(client, server, where):
    committed = mixed_model(80)
    client.push(committed, version="dup-base", bucket_size_bytes=1 << 20)
    names = list(committed)
    twice = names[1]
    items = list(committed.items())
    doubled = items[:3] + [(twice, committed[twice])] + items[3:] if where == "mid-plan" else items + [items[1]]
    with pytest.raises(UpdateFailed) as caught:
        client.push(iter(doubled), version="dup", mode="staged")  # streamed against the committed plan
    assert (caught.value.code, caught.value.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "TENSOR_NAME_DUPLICATE")
    assert f"tensor {twice!r} appears twice in the streamed tensors" in str(caught.value)
    assert client.server_info()[0].store_state == pb.STORE_STATE_CONSISTENT
    assert client.verify(committed).ok  # STAGED: nothing changed
    streamed = mixed_model(81)
    client.push(iter(streamed.items()), version="after-dup", mode="staged")
    assert client.verify(streamed).ok


# -- push leaves torch's thread count alone ---------------------------------------------------------------
def test_push_leaves_the_torch_thread_count_of_every_thread_alone(client, server):
    """The client is shared between threads: a push must not change what torch gives other threads, the
    threads they start, or the caller's own code (its progress callback), during the push or after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # more than one, so that a change to one shows
    try:
        in_push, checked = threading.Event(), threading.Event()
        seen: dict[str, int] = {}

        def fresh_thread_count() -> int:
            box: list[int] = []
            thread = threading.Thread(target=lambda: box.append(torch.get_num_threads()))
            thread.start()
            thread.join()
            return box[0]

        def progress(p) -> None:
            if p.bucket == 0:
                seen["pushing thread, in its callback"] = torch.get_num_threads()
                seen["thread started by the pushing thread"] = fresh_thread_count()
                in_push.set()
                checked.wait(30)

        model = mixed_model(82)
        errors: list[BaseException] = []

        def push() -> None:
            try:
                client.push(model, version="threads", bucket_size_bytes=1 << 18, progress=progress)
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)

        pushing = threading.Thread(target=push)
        pushing.start()
        assert in_push.wait(60)
        seen["main thread, during the push"] = torch.get_num_threads()
        seen["thread started during the push"] = fresh_thread_count()
        checked.set()
        pushing.join(60)
        assert errors == []
        seen["main thread, after"] = torch.get_num_threads()
        seen["thread started after"] = fresh_thread_count()
        assert seen == dict.fromkeys(seen, 2)
        assert client.verify(model).ok
    finally:
        torch.set_num_threads(previous)
