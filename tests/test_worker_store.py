"""The worker's store and prepare logic, in process (no collectives)."""

from __future__ import annotations

import torch

from weightsync.client.planning import build_plan, plan_proto
from weightsync.gpu_worker.store import WeightStore
from weightsync.gpu_worker.update import (
    abort_update,
    commit_update,
    prepare_from_fast_plan,
    prepare_update,
    remember_fast_plan,
)
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.worker.v1 import worker_pb2 as wpb


def command(plan, mode=pb.UPDATE_MODE_IN_PLACE, update_id="u", plan_id="p1", allow_new=False):
    return wpb.PrepareUpdateCommand(update_id=update_id, group_id="g", plan=plan, mode=mode,
                                    allow_new_tensors=allow_new, plan_id=plan_id)


def receive_all(update, source: torch.Tensor) -> None:
    """Stand-in for the broadcasts: write the trainer's bucket bytes where the worker would receive them."""
    for target, spec_bytes in zip(update.targets, source, strict=True):
        assert target.direct is not None
        target.direct.copy_(spec_bytes)
    update.next_sequence = len(update.targets)


def buckets_of(planned, named):
    out = []
    for p in planned:
        buf = torch.zeros(p.spec.size_bytes, dtype=torch.uint8)
        for t in p.spec.tensors:
            buf[t.offset_bytes : t.offset_bytes + t.size_bytes].copy_(named[t.name].reshape(-1).view(torch.uint8))
        out.append(buf)
    return out


def test_fast_plan_is_reused_and_follows_staged_flips():
    named = {f"w{i}": torch.randn(300) for i in range(6)}
    planned = build_plan(list(named.items()), bucket_size_bytes=2048, zero_copy_min_bytes=0)
    plan = plan_proto(planned)
    store = WeightStore(torch.device("cpu"))
    first = prepare_update(store, command(plan, allow_new=True), None, 0)
    assert remember_fast_plan(store, "p1", first) is None  # it created the store
    receive_all(first, buckets_of(planned, named))
    commit_update(store, first)

    full = prepare_update(store, command(plan, mode=pb.UPDATE_MODE_STAGED), None, 0)
    fast = remember_fast_plan(store, "p1", full)
    assert fast is not None and len(fast.buckets) == len(plan.buckets)
    abort_update(store, full)

    for step in range(3):  # STAGED flips live and shadow every commit: the cache must follow
        values = {k: v + step + 1 for k, v in named.items()}
        update = prepare_from_fast_plan(store, command(plan, mode=pb.UPDATE_MODE_STAGED, update_id=f"s{step}"), fast)
        assert update is not None
        assert all(t.direct.data_ptr() != store.segments[i].live.data_ptr()
                   for i, t in enumerate(update.targets))  # writes go to the shadow
        store.updating = True
        receive_all(update, buckets_of(planned, values))
        commit_update(store, update)
        assert all(torch.equal(store.view(k), v) for k, v in values.items())

    # In place, cached: straight into the live segments.
    update = prepare_from_fast_plan(store, command(plan, update_id="ip"), fast)
    assert all(t.direct.data_ptr() == store.segments[i].live.data_ptr() for i, t in enumerate(update.targets))
    abort_update(store, update)


def test_fast_plan_is_dropped_when_the_layout_changes():
    named = {"a": torch.randn(10), "b": torch.randn(10)}
    planned = build_plan(list(named.items()), bucket_size_bytes=1 << 20)
    plan = plan_proto(planned)
    store = WeightStore(torch.device("cpu"))
    first = prepare_update(store, command(plan, allow_new=True), None, 0)
    receive_all(first, buckets_of(planned, named))
    commit_update(store, first)
    second = prepare_update(store, command(plan), None, 0)
    fast = remember_fast_plan(store, "p1", second)
    abort_update(store, second)
    assert fast is not None
    assert prepare_from_fast_plan(store, command(plan, plan_id="other"), fast) is None
    extra = {"c": torch.randn(4)}
    more = plan_proto(build_plan(list(extra.items()), bucket_size_bytes=1 << 20))
    grow = prepare_update(store, command(more, allow_new=True, update_id="g"), None, 0)
    receive_all(grow, buckets_of(build_plan(list(extra.items()), 1 << 20), extra))
    commit_update(store, grow)
    assert prepare_from_fast_plan(store, command(plan), fast) is None  # new tensors: layout changed
