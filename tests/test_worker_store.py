"""The worker's store, its update lifecycle and its plan cache, in process (no collectives)."""

from __future__ import annotations

import os

import pytest
import torch

from weightsync.client.planning import build_plan, plan_proto
from weightsync.common.errors import FailedPrecondition, InvalidArgument, NotFound
from weightsync.common.plan_id import plan_id_of
from weightsync.gpu_worker.store import WeightStore
from weightsync.gpu_worker.update_plan import PlanCache, derive_update_plan
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

IN_PLACE, STAGED = pb.UPDATE_MODE_IN_PLACE, pb.UPDATE_MODE_STAGED


def derive(store: WeightStore, plan, mode=IN_PLACE, allow_new=False):
    return derive_update_plan(
        plan=plan, plan_id=plan_id_of(plan), mode=mode, allow_new_tensors=allow_new, tensors=store.tensors,
        segment_signatures=[s.signature for s in store.segments],
        segment_sizes=[s.size_bytes for s in store.segments], layout_version=store.layout_version,
    )


def buckets_of(plan, named):
    out = []
    for spec in plan.buckets:
        buf = torch.zeros(spec.size_bytes, dtype=torch.uint8)
        for t in spec.tensors:
            buf[t.offset_bytes : t.offset_bytes + t.size_bytes].copy_(named[t.name].reshape(-1).view(torch.uint8))
        out.append(buf)
    return out


def push(store: WeightStore, plan, named, mode=IN_PLACE, allow_new=False, update_id="u", *, through=None):
    """Begin, receive every bucket (or the first `through`), and commit when all arrived."""
    derived = derive(store, plan, mode, allow_new)
    store.begin_update(derived, update_id, "g")
    for sequence, data in enumerate(buckets_of(plan, named)):
        if through is not None and sequence == through:
            return derived
        target = store.receive_buffer(sequence)
        store.mark_started(sequence)
        target.copy_(data)
        store.apply_bucket(sequence, target, tensor_pb2.Checksum())
    return store.commit_update()


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(300, generator=g) for i in range(6)}


@pytest.fixture
def plan():
    return plan_proto(build_plan(list(model(0).items()), bucket_size_bytes=2048, zero_copy_min_bytes=0))


def test_staged_updates_write_the_shadow_and_flip_it_live(plan):
    store = WeightStore(torch.device("cpu"))
    push(store, plan, model(0), allow_new=True)
    for step in range(1, 4):
        derived = derive(store, plan, STAGED)
        store.begin_update(derived, f"s{step}", "g")
        live = [store.segment_bytes(i).data_ptr() for i in range(len(store.segments))]
        assert all(store.receive_buffer(k).data_ptr() not in live for k in range(len(plan.buckets)))
        store.abort_update()
        push(store, plan, model(step), STAGED, update_id=f"t{step}")
        assert all(torch.equal(store.view(k), v) for k, v in model(step).items())
        assert store.state == pb.STORE_STATE_CONSISTENT


def test_staged_abort_leaves_live_bytes_untouched_and_in_place_abort_marks_dirty(plan):
    store = WeightStore(torch.device("cpu"))
    push(store, plan, model(0), allow_new=True)
    push(store, plan, model(1), STAGED, through=2)
    store.abort_update()
    assert store.state == pb.STORE_STATE_CONSISTENT
    assert all(torch.equal(store.view(k), v) for k, v in model(0).items())

    push(store, plan, model(1), IN_PLACE, through=1)  # bucket 0 landed in the live bytes
    store.abort_update()
    assert store.state == pb.STORE_STATE_INCONSISTENT
    assert store.dirty == {t.name for t in plan.buckets[0].tensors}
    push(store, plan, model(2), IN_PLACE)  # a full update rewrites what was dirty
    assert store.state == pb.STORE_STATE_CONSISTENT and not store.dirty


def test_plan_cache_is_keyed_by_layout_and_filled_on_commit_only(plan):
    store = WeightStore(torch.device("cpu"))
    cache = PlanCache()
    push(store, plan, model(0), allow_new=True)
    derived = derive(store, plan, STAGED)
    store.begin_update(derived, "x", "g")
    store.abort_update()  # an aborted update leaves the cache as it was
    assert cache.get(derived.plan_id, store.layout_version, True) is None
    cache.remember(push(store, plan, model(1), STAGED), store.layout_version)
    assert cache.get(derived.plan_id, store.layout_version, True) is not None
    assert cache.get(derived.plan_id, store.layout_version, False) is None  # the mode is part of the key

    extra = {"c": torch.randn(4)}
    more = plan_proto(build_plan(list(extra.items()), bucket_size_bytes=1 << 20))
    push(store, more, extra, allow_new=True, update_id="grow")
    assert cache.get(derived.plan_id, store.layout_version, True) is None  # new tensors: the layout changed


def test_an_aborted_update_that_added_tensors_restores_the_layout_exactly(plan):
    store = WeightStore(torch.device("cpu"))
    push(store, plan, model(0), allow_new=True)
    before = (store.layout_version, len(store.segments), set(store.arenas))
    extra = {"new": torch.randn(8), "new2": torch.randn(300)}
    more = plan_proto(build_plan(list(extra.items()), bucket_size_bytes=64, zero_copy_min_bytes=0))
    assert len(more.buckets) == 2
    push(store, more, extra, allow_new=True, through=1)
    store.abort_update()
    assert (store.layout_version, len(store.segments), set(store.arenas)) == before
    assert "new" not in store.tensors


def test_validation_against_the_store_moves_nothing(plan):
    store = WeightStore(torch.device("cpu"))
    push(store, plan, model(0), allow_new=True)
    wrong = {**model(1), "w3": torch.randn(299)}
    bad = plan_proto(build_plan(list(wrong.items()), bucket_size_bytes=2048, zero_copy_min_bytes=0))
    with pytest.raises(InvalidArgument) as caught:
        derive(store, bad)
    assert caught.value.reason == "TENSOR_SHAPE_MISMATCH" and caught.value.metadata["tensor"] == "w3"
    unknown = plan_proto(build_plan([("nope", torch.zeros(2))], bucket_size_bytes=2048))
    with pytest.raises(InvalidArgument) as caught:
        derive(store, unknown)
    assert caught.value.reason == "TENSOR_UNKNOWN"
    with pytest.raises(NotFound) as caught:
        store.checksums(["w0", "nope"])
    assert caught.value.reason == "TENSOR_NOT_FOUND" and caught.value.metadata["tensors"] == "nope"
    with pytest.raises(FailedPrecondition):
        store.current("no-such-update")
    assert all(torch.equal(store.view(k), v) for k, v in model(0).items())


def test_a_store_maps_again_from_its_manifest_and_arenas(plan):
    """What a restarted worker does: the same bytes, the same tensors, no copy."""
    store = WeightStore(torch.device("cpu"))
    push(store, plan, model(0), allow_new=True)
    push(store, plan, model(1), STAGED)  # live and shadow flipped once
    manifest = store.manifest()
    assert manifest.tensors_included and len(manifest.tensors) == 6
    fds = {a.arena_id: os.dup(a.fd) for a in store.arenas.values()}
    again = WeightStore(torch.device("cpu"))
    again.restore(manifest, fds, dirty=["w0"])
    assert all(torch.equal(again.view(k), v) for k, v in model(1).items())
    assert again.state == pb.STORE_STATE_INCONSISTENT and again.dirty == {"w0"}
    assert store.manifest().tensors_included is False  # sent once per layout
    store.view("w1").add_(1)  # one memory: a write through one mapping shows in the other
    assert torch.equal(again.view("w1"), store.view("w1"))


# -- SHM: checks run on the worker's own copy ------------------------------------------------
def test_an_ingress_bucket_is_checked_and_applied_from_the_workers_own_copy(plan, monkeypatch):
    """An SHM trainer writes its slot again right after the worker checked it: what commits is
    exactly what the checksum covered (before: the general path checked the shared slot, then
    copied each tensor out of it, and committed the rewritten bytes as CONSISTENT)."""
    import weightsync.gpu_worker.store as store_module
    from weightsync.common.checksum import tensor_checksum
    from weightsync.worker.v1 import worker_pb2 as wpb

    store = WeightStore(torch.device("cpu"))
    push(store, plan, model(0), allow_new=True)
    regrouped = plan_proto(build_plan(list(model(1).items()), bucket_size_bytes=4096, zero_copy_min_bytes=0))
    derived = derive(store, regrouped, STAGED)
    assert all(r.receive_into is None for r in derived.routes)  # the general path: staging + copies
    store.begin_update(derived, "shm", "")
    buckets = buckets_of(regrouped, model(1))
    ingress = torch.zeros(max(b.numel() for b in buckets), dtype=torch.uint8)
    checked = store_module.verify_bucket

    def check_then_trainer_writes(*args, **kwargs):
        checked(*args, **kwargs)
        ingress.fill_(0x5A)  # the trainer's next write lands in the slot after the check

    monkeypatch.setattr(store_module, "verify_bucket", check_then_trainer_writes)
    for sequence, data in enumerate(buckets):
        ingress[: data.numel()].copy_(data)
        receive = wpb.ReceiveBucketCommand(update_id="shm", sequence=sequence, checksum=tensor_checksum(data),
                                           size_bytes=data.numel(), from_ingress=True, ingress_offset_bytes=0)
        assert store.receive_from_ingress(receive, ingress).size_bytes == data.numel()
    store.commit_update()
    assert store.state == pb.STORE_STATE_CONSISTENT
    assert all(torch.equal(store.view(k), v) for k, v in model(1).items())
