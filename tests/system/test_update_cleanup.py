"""What an update leaves behind when it ends badly.

- A second cancel while an abort runs must not cut the clean-up short (defect 5): engines get
  leases again at once, and a trainer that dies afterwards is noticed (its group goes BROKEN).
- A worker stalled for less than the group timeout costs the stall, not the stall plus a
  timeout: an announcement after it resumes is taken, not refused undrained (defect 2).
- A refused bucket leaves no asyncio traceback in the JSON logs (defect 8).
Each is followed by the next normal push and a verify.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch

from weightsync.client import PushProgress, WeightSyncClient
from weightsync.engine import EngineClient
from weightsync.v1 import tensor_pb2
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import (
    PlainTrainer,
    UpdateStream,
    local_checksums,
    plan_buckets,
    server_checksums,
    start_server,
    wait_for,
)
from models import mixed_model

pytestmark = pytest.mark.timeout(240)
GROUP_TIMEOUT = 20.0
LEASE_TIMEOUT = 3.0


def info(server) -> pb.GetServerInfoResponse:
    return server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


def group_state(server, group_id: str) -> int | None:
    groups = server.stub().ListTransferGroups(pb.ListTransferGroupsRequest(), timeout=10).groups
    return next((g.state for g in groups if g.group_id == group_id), None)


@pytest.fixture
def node(tmp_path):
    server = start_server(tmp_path, "--local-socket", "auto", "--engine-lease-timeout-seconds", str(LEASE_TIMEOUT))
    yield server
    for worker in info(server).workers:
        if worker.pid:
            os.kill(worker.pid, signal.SIGCONT)
    assert server.stop() == 0, server.log()[-3000:]


def logged(server, event: str, **fields: str) -> bool:
    """Whether the server logged `event` with these fields (its log is one JSON object a line)."""
    for line in server.log().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line still being written
            continue
        if isinstance(record, dict) and record.get("event") == event and all(
                record.get(k) == v for k, v in fields.items()):
            return True
    return False


def json_lines(text: str) -> list[str]:
    """Every line that is not one JSON object."""
    bad = []
    for line in text.splitlines():
        try:
            if not isinstance(json.loads(line), dict):
                bad.append(line)
        except ValueError:
            bad.append(line)
    return bad


def test_abort_then_cancel_leaves_no_lock_and_a_dead_trainer_is_still_noticed(node):
    model = mixed_model(1)
    trainer = PlainTrainer([node], timeout=GROUP_TIMEOUT)
    trainer.create_group()
    assert trainer.push(model, "v1", mode=pb.UPDATE_MODE_STAGED) is not None

    plan = plan_buckets(list(mixed_model(2).items()), 1 << 20)
    stream, _ = trainer.begin(node.stub(), plan, "aborted", mode=pb.UPDATE_MODE_IN_PLACE)
    slow = info(node).workers[1].pid
    os.kill(slow, signal.SIGSTOP)  # the abort now waits for this worker
    stream.send(abort=pb.AbortUpdate(reason="first the abort"))
    # The server took the abort: the step that logs it goes on into the clean-up, held by the stopped worker.
    wait_for(lambda: logged(node, "update_failing", reason="ABORTED_BY_CLIENT"), timeout=30)
    stream.cancel()  # ... then the cancel, while the abort runs
    # The cancel reached the handler mid-clean-up (not after it): only then is the worker let go.
    wait_for(lambda: logged(node, "cleanup_continues_despite_cancel"), timeout=30)
    os.kill(slow, signal.SIGCONT)
    wait_for(lambda: info(node).store_state == pb.STORE_STATE_CONSISTENT, timeout=30)

    # Engines read at once: the IN_PLACE write mark was cleared (before: STORE_UPDATING after the lease timeout).
    with EngineClient(server=node.address, name="reader") as engine:
        with engine.acquire(wait=LEASE_TIMEOUT) as snapshot:
            assert snapshot.version.version == "v1"
            assert {n: t.clone() for n, t in snapshot.tensors.items()}.keys() == model.keys()

    # The group is idle again: the dead-trainer watch sees it (before: `updating` stayed True, READY forever).
    trainer.pg = None
    trainer.store = None  # the rendezvous store closes: the trainer is gone
    wait_for(lambda: group_state(node, trainer.group_id) == pb.GROUP_STATE_BROKEN, timeout=30)

    # The next normal push, and a verify.
    with WeightSyncClient(node.address, timeout=60) as client:
        client.create_group(timeout=GROUP_TIMEOUT)
        client.push(mixed_model(3), version="v2", mode="in_place")
        assert server_checksums(node) == [local_checksums(mixed_model(3))]
        client.delete_group()


def test_a_stall_shorter_than_the_timeout_costs_only_the_stall(node):
    """The worker stops mid-push for longer than the heartbeat limit, then resumes: the buckets
    announced after it resumed are taken (before: refused WORKER_UNAVAILABLE and never drained,
    so the push failed only at the group timeout)."""
    stall = 5.0  # over the 3 s after which a silent worker is UNRESPONSIVE
    with WeightSyncClient(node.address, timeout=120) as client:
        client.create_group(timeout=GROUP_TIMEOUT)
        client.push(mixed_model(10), version="before", mode="staged", bucket_size_bytes=1 << 18)
        victim = info(node).workers[1].pid
        stopped: dict[str, float] = {}

        def stop_worker(report: PushProgress) -> None:
            if report.bucket == 1 and "at" not in stopped:
                os.kill(victim, signal.SIGSTOP)
                stopped["at"] = time.monotonic()
                threading.Timer(stall, os.kill, (victim, signal.SIGCONT)).start()

        model = mixed_model(11)
        result = client.push(model, version="after-stall", mode="staged", bucket_size_bytes=1 << 18,
                             progress=stop_worker)
        assert result.version == "after-stall"
        assert "at" in stopped
        assert [w.pid for w in info(node).workers][1] == victim  # not killed: it was only slow
        assert server_checksums(node) == [local_checksums(model)]
        client.push(mixed_model(12), version="next", mode="in_place", bucket_size_bytes=1 << 18)
        assert server_checksums(node) == [local_checksums(mixed_model(12))]
        client.delete_group()


def test_refused_buckets_leave_every_log_line_one_json_object(tmp_path):
    """The driver waits on bucket 0 (its owner, worker 0, is stopped) when the reader refuses bucket 1
    (BUCKET_INCOMPLETE): the wait it drops must not surface as asyncio's 'exception was never
    retrieved' traceback. A wrong checksum (BUCKET_CHECKSUM_MISMATCH) is refused by bucket 1's owner
    itself, answered in bucket order, so nothing is stopped for it. Every log line is one JSON object."""
    server = start_server(tmp_path, "--local-socket", "auto")
    try:
        model = {"a": torch.arange(100_000, dtype=torch.float32), "b": torch.arange(100_000, dtype=torch.float32)}
        plan = plan_buckets(list(model.items()), 400_000)
        assert len(plan.buckets) == 2
        for refusal in ("incomplete", "checksum"):
            # Two equal buckets: owners 0 and 1 (docs/data-plane.md); bucket 0 waits on worker 0.
            slow = info(server).workers[0].pid if refusal == "incomplete" else None
            stream = UpdateStream(server.stub())
            stream.send(begin=pb.BeginUpdate(version="bad", plan=plan, mode=pb.UPDATE_MODE_STAGED,
                                             transport=pb.TRANSPORT_INLINE, allow_new_tensors=True))
            assert stream.recv().WhichOneof("message") == "ready"
            if slow:
                os.kill(slow, signal.SIGSTOP)
            try:
                first = bytes(plan.buckets[0].size_bytes)
                stream.send(bucket_start=pb.BucketStart(sequence=0, size_bytes=len(first)))
                stream.send(bucket_chunk=pb.BucketChunk(sequence=0, offset_bytes=0, data=first))
                second = bytes(plan.buckets[1].size_bytes)
                checksum = tensor_pb2.Checksum(algorithm=tensor_pb2.CHECKSUM_ALGORITHM_WS64, value=12345)
                stream.send(bucket_start=pb.BucketStart(sequence=1, size_bytes=len(second),
                                                        checksum=checksum if refusal == "checksum" else None))
                if refusal == "incomplete":
                    stream.send(bucket_chunk=pb.BucketChunk(sequence=1, offset_bytes=0, data=second[:1000]))
                    stream.send(commit=pb.CommitUpdate())  # before bucket 1 is complete
                    # Refused while bucket 0 still waits on the stopped worker: the wait the driver drops.
                    wait_for(lambda: logged(server, "update_failing", reason="BUCKET_INCOMPLETE"), timeout=30)
                else:
                    stream.send(bucket_chunk=pb.BucketChunk(sequence=1, offset_bytes=0, data=second))
            finally:
                if slow:
                    os.kill(slow, signal.SIGCONT)
            messages = []
            try:
                while True:
                    messages.append(stream.recv().WhichOneof("message"))
            except Exception:  # noqa: BLE001 - the status ends the stream
                pass
            assert "committed" not in messages
            if refusal == "incomplete":  # said at once: bucket 0 was never applied
                assert messages == ["aborting"], messages
            else:
                assert "aborting" in messages, messages
            stream.close()
            wait_for(lambda: info(server).store_state != pb.STORE_STATE_UPDATING, timeout=30)
        with WeightSyncClient(server.address, timeout=60) as client:
            client.push(model, version="good", transport="inline", allow_new_tensors=True)
        assert server_checksums(server) == [local_checksums(model)]
    finally:
        assert server.stop() == 0
    log = server.log()
    assert "never retrieved" not in log
    assert json_lines(log) == []
