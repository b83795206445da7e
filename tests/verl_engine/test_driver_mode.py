"""Driver mode (receive "served"): the node's weightsync server drives the engine itself after each
commit, and verl's rollout worker only waits, bounded, until that engine serves the step.

verl's lifecycle as test_verl_checkpoint_engine drives it (two actor ranks, each pushing its share
of every step over SHM with `senders: all`, one commit per step; one rollout worker; each its own
process) over a real weightsync server started with
--engine vllm-http=URL, where URL is tests/fake_vllm.py's stand-in for vLLM's weight-transfer
routes: it really attaches to the node's local socket and copies each version's changed tensors
out of the node's store, so what it serves can be compared bit for bit. Several steps served bit
for bit, the rollout yielding no tensors; a rank whose share is refused (PUSH_FAILED naming it on
every actor rank and on the waiting rollout, at once); an engine that refuses a step (ENGINE_FAILED
on the rollout, at once, while the push committed; the engine keeps serving the last step); then
the next step served bit for bit; an engine slower than a rollout worker's bound (VERSION_NOT_SERVED
on that worker, while one with a longer bound sees the step served), then the next step. The decisions over WatchWeights events (a FAILED state left
from an older version is not this one's failure) are checked on hand-built events.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("verl.checkpoint_engine", reason="verl is not installed here: run make test-verl")

import torch  # noqa: E402
from fake_vllm import FakeVllm  # noqa: E402
from test_fsdp_actors import free_port  # noqa: E402
from test_verl_checkpoint_engine import Worker, sync  # noqa: E402
from verl.checkpoint_engine import CheckpointEngineRegistry  # noqa: E402
from verl.utils.import_utils import import_external_libs  # noqa: E402
from verl_workers import weights_for  # noqa: E402

from weightsync.engine import EngineClient  # noqa: E402
from weightsync.integrations.verl import WeightSyncVerlError  # noqa: E402
from weightsync.integrations.verl.served import ServedWatch  # noqa: E402
from weightsync.v1 import weight_sync_service_pb2 as pb  # noqa: E402

from helpers import running_server  # noqa: E402

pytestmark = pytest.mark.timeout(600)

TIMEOUT_S = 150.0
"""The engine's timeout_s (the first delta push compiles the SDK's numba kernels: over a minute on a
loaded 2-core machine, while the rollout waits)."""
FAILED_WITHIN_S = 60.0
"""An engine's refusal reaches the rollout within this: at once, not at TIMEOUT_S."""


APPLY_S = 1.0
"""How long the stand-in takes to load a version: a rollout that did not wait for the engine would
find it still serving the step before."""


class SlowVllm(FakeVllm):
    apply_s = APPLY_S

    def _answer(self, path: str, body: dict) -> tuple[int, bytes]:
        if path == "/update_weights":
            time.sleep(self.apply_s)  # the engine's load time, not a synchronisation
        return super()._answer(path, body)


class InProcessRollout:
    """A rollout worker in the test process (a Worker's call/answer), with its own engine_kwargs: its
    call runs when its answer is asked for."""

    def __init__(self, kwargs: dict) -> None:
        import_external_libs("weightsync.integrations.verl")
        self.engine = CheckpointEngineRegistry.new("weightsync", bucket_size=64 << 20, **kwargs)
        self.pending: tuple[str, dict] | None = None

    def call(self, method: str, **args) -> None:
        self.pending = (method, args)

    def answer(self):
        assert self.pending is not None
        (method, args), self.pending = self.pending, None
        try:
            if method == "update_weights":
                async def receive() -> dict:
                    return {name: t async for name, t in self.engine.receive_weights(global_steps=args["step"])}
                return asyncio.run(receive())
            return getattr(self.engine, method)(**args)
        except WeightSyncVerlError as error:
            return "error", {"type": type(error).__name__, "reason": error.reason, "rank": error.rank,
                             "version": error.version, "message": str(error)}


def assert_serves(fake: FakeVllm, step: int) -> None:
    expected = weights_for(step)
    assert fake.served == str(step)
    assert sorted(fake.weights) == sorted(expected)
    for name, tensor in expected.items():
        got = fake.weights[name]
        assert (got.dtype, got.shape) == (tensor.dtype, tensor.shape), name
        assert torch.equal(got.view(-1).view(torch.uint8), tensor.contiguous().view(-1).view(torch.uint8)), name


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeVllm]:
    fake = SlowVllm()
    try:
        yield fake
    finally:
        fake.close()


def test_shm_parts_served_by_the_driven_engine_bit_for_bit_a_failing_rank_a_refusing_engine_then_next_step(
        fake, tmp_path) -> None:
    """Two actor ranks, each pushing its share of every step over SHM (its own run of the server's
    ingress slots), one commit per step; the rollout in driver mode."""
    # The workers import verl (a minute) while the server starts; they connect at init_process_group.
    port = free_port()
    kwargs = {"servers": [f"127.0.0.1:{port}"], "transport": "shm", "senders": "all", "receive": "served",
              "timeout_s": TIMEOUT_S}
    actors = [Worker("actor", True, kwargs), Worker("actor", False, kwargs)]
    rollouts = [Worker("rollout", False, kwargs)]
    try:
        with running_server(tmp_path, "--listen", f"127.0.0.1:{port}", "--engine", f"vllm-http={fake.url}",
                            workers=1) as server, EngineClient(server=server.address, name="test") as node:
            assert [w.ready() for w in actors + rollouts] == ["WeightSyncCheckpointEngine"] * 3
            generations = []
            for step in (1, 2, 3):
                actor_results, (received,) = sync(actors, rollouts, step)
                assert received == {}, received  # the rollout yields no tensors: the engine took them
                assert_serves(fake, step)
                generations.append(node.status().version.generation)
                assert actor_results[0] == actor_results[1], actor_results  # the step's totals over both parts
            assert generations == [generations[0], generations[0] + 1, generations[0] + 2]  # both parts, one commit
            dense = sum(t.numel() * t.element_size() for t in weights_for(3).values())
            assert actor_results[0]["weightsync/dense_bytes"] == dense
            # delta "auto" over SHM from host tensors sends dense (the SDK's rule: patches rarely pay there)
            assert actor_results[0]["weightsync/bytes_sent"] >= dense, actor_results

            # Step 4: rank 1's share (the norm) has the wrong shape. Both actor ranks and the rollout
            # raise PUSH_FAILED naming rank 1, at once; nothing is committed, the engine serves step 3.
            started = time.monotonic()
            actor_results, (rollout_result,) = sync(actors, rollouts, 4, bad_norm_on=1)
            assert time.monotonic() - started < FAILED_WITHIN_S
            for kind, error in [*actor_results, rollout_result]:
                assert (kind, error["type"], error["reason"], error["rank"], error["version"]) == (
                    "error", "WeightSyncVerlError", "PUSH_FAILED", 1, "4"), error
            assert node.status().version.generation == generations[-1]
            assert_serves(fake, 3)

            # Step 5: the engine refuses it (vLLM's /update_weights answers 500). The parts commit; the
            # rollout raises ENGINE_FAILED at once, naming the engine's error; the engine keeps step 3.
            fake.script["POST /update_weights"] = [(500, b'{"error": "out of memory"}')]
            started = time.monotonic()
            actor_results, (rollout_result,) = sync(actors, rollouts, 5)
            assert time.monotonic() - started < FAILED_WITHIN_S
            for metrics in actor_results:
                assert set(metrics) == {"weightsync/push_s", "weightsync/bytes_sent", "weightsync/dense_bytes"}
            kind, error = rollout_result
            assert (kind, error["type"], error["reason"], error["version"]) == (
                "error", "WeightSyncVerlError", "ENGINE_FAILED", "5"), error
            assert "ENGINE_REFUSED" in error["message"] and "out of memory" in error["message"], error
            assert fake.served in ("3", "5")  # the driver may have retried step 5 since (5 s later)
            if fake.served == "3":
                assert_serves(fake, 3)

            # The next step is served, bit for bit.
            _, (received,) = sync(actors, rollouts, 6)
            assert received == {}
            assert_serves(fake, 6)

            # Step 7: the engine takes 8 s to load it. A second rollout worker whose bound is 2 s raises
            # VERSION_NOT_SERVED (the engine still APPLYING, serving step 6) once its bound is out; the
            # first one, bounded by TIMEOUT_S, returns once the engine serves step 7.
            impatient = InProcessRollout({**kwargs, "timeout_s": 2.0})
            fake.apply_s = 8.0
            try:
                _, (short, received) = sync(actors, [impatient, *rollouts], 7)
            finally:
                fake.apply_s = APPLY_S
                impatient.engine.close()
            kind, error = short
            assert (kind, error["reason"], error["version"]) == ("error", "VERSION_NOT_SERVED", "7"), error
            assert "engine 'vllm-http' is ENGINE_STATE_APPLYING, serving '6'" in error["message"], error
            assert received == {}
            assert_serves(fake, 7)
            _, (received,) = sync(actors, rollouts, 8)
            assert received == {}
            assert_serves(fake, 8)
    finally:
        for w in actors + rollouts:
            w.stop()


# -- the decisions over WatchWeights events ---------------------------------------------------
EPOCH = 77
"""The node's store epoch in the hand-built events."""


def event(held: str, generation: int, state: int, applied: str = "", applied_generation: int = 0,
          error: str = "", epoch: int = EPOCH) -> pb.WatchWeightsResponse:
    engine = pb.EngineStatus(name="vllm-http", kind="vllm-http", endpoint="http://x", state=state, last_error=error)
    if applied:
        engine.applied_version.version, engine.applied_version.generation = applied, applied_generation
        engine.applied_version.store_epoch = epoch
    answer = pb.WatchWeightsResponse(engines=[engine])
    answer.version.version, answer.version.generation, answer.version.store_epoch = held, generation, epoch
    return answer


def watch_for(label: str, generation: int, engine: str | None = None) -> ServedWatch:
    """A rollout's watch for the sync that committed `label` as `generation` in the node's store."""
    return ServedWatch(version=label, commits={EPOCH: generation}, engine=engine, node="n:1")


def test_a_failure_left_from_an_older_version_is_not_this_ones() -> None:
    watch = watch_for("5", 5)
    # Step 4 failed; step 5 is committed but the driver has not started on it: FAILED is step 4's.
    assert watch.see(event("4", 4, pb.ENGINE_STATE_APPLYING, "3", 3)) is None  # applying step 4, not 5
    assert watch.see(event("4", 4, pb.ENGINE_STATE_FAILED, "3", 3, "refused 4")) is None
    assert watch.see(event("5", 5, pb.ENGINE_STATE_FAILED, "3", 3, "refused 4")) is None
    assert watch.see(event("5", 5, pb.ENGINE_STATE_APPLYING, "3", 3)) is None
    served = watch.see(event("5", 5, pb.ENGINE_STATE_SERVING, "5", 5))
    assert served is not None and served.applied_version.version == "5"


def test_a_failure_after_the_engine_started_on_this_version_is_engine_failed() -> None:
    watch = watch_for("5", 5)
    assert watch.see(event("5", 5, pb.ENGINE_STATE_SERVING, "4", 4)) is None
    assert watch.see(event("5", 5, pb.ENGINE_STATE_APPLYING, "4", 4)) is None
    with pytest.raises(WeightSyncVerlError) as raised:
        watch.see(event("5", 5, pb.ENGINE_STATE_FAILED, "4", 4, "ENGINE_REFUSED: HTTP 500"))
    assert (raised.value.reason, raised.value.version) == ("ENGINE_FAILED", "5")
    assert "keeps serving '4': ENGINE_REFUSED: HTTP 500" in str(raised.value)
    # still failing at the deadline (the stream broke since): ENGINE_FAILED, not a plain timeout
    watch.restart()
    assert watch.timed_out(10, "").reason == "ENGINE_FAILED"


def test_the_commit_decides_not_the_label() -> None:
    """A label the node or the engine held before (another run's, another push's) is not this sync's
    commit; a later label from a run before a resume is no reason to give up."""
    # This sync committed label "0" as generation 9, over a node that held "50" (a run before it).
    watch = watch_for("0", 9)
    assert watch.see(event("50", 8, pb.ENGINE_STATE_SERVING, "50", 8)) is None
    served = watch.see(event("0", 9, pb.ENGINE_STATE_SERVING, "0", 9))
    assert served is not None
    # Label "7" pushed again with other bytes (generation 12): the engine serving "7" as generation 11
    # serves the other push's bytes.
    again = watch_for("7", 12)
    assert again.see(event("7", 12, pb.ENGINE_STATE_SERVING, "7", 11)) is None
    assert again.see(event("7", 12, pb.ENGINE_STATE_SERVING, "7", 12)) is not None


def test_a_later_commit_or_another_store_on_the_node_is_version_gone_and_no_engine_is_engine_not_found() -> None:
    with pytest.raises(WeightSyncVerlError, match="VERSION_GONE: the node moved on to generation 6"):
        watch_for("5", 5).see(event("6", 6, pb.ENGINE_STATE_APPLYING, "5", 4))
    # Another store (the node's server restarted): before the commit was seen, from before it (the rollout
    # watches from the start of its receive); once the node held it, or on a stream opened after it, gone.
    restarted = watch_for("5", 5)
    assert restarted.see(event("9", 9, pb.ENGINE_STATE_SERVING, "9", 9, epoch=78)) is None
    assert restarted.see(event("5", 5, pb.ENGINE_STATE_APPLYING, "4", 4)) is None
    with pytest.raises(WeightSyncVerlError, match=r"VERSION_GONE: the node's store \(epoch 78\) is not one"):
        restarted.see(event("", 0, pb.ENGINE_STATE_APPLYING, epoch=78))
    reopened = watch_for("5", 5)
    reopened.restart()  # the stream broke: the next one opens after the commit
    with pytest.raises(WeightSyncVerlError, match=r"VERSION_GONE: the node's store \(epoch 78\) is not one"):
        reopened.see(event("", 0, pb.ENGINE_STATE_APPLYING, epoch=78))
    bare = pb.WatchWeightsResponse()
    with pytest.raises(WeightSyncVerlError, match="ENGINE_NOT_FOUND: .*--engine vllm-http=URL"):
        watch_for("5", 5).see(bare)
    with pytest.raises(WeightSyncVerlError, match="no engine named 'sglang-http'"):
        watch_for("5", 5, "sglang-http").see(event("5", 5, pb.ENGINE_STATE_SERVING))
    timed = watch_for("5", 5)
    timed.see(event("5", 5, pb.ENGINE_STATE_APPLYING, "4", 4))
    assert timed.timed_out(10, "").reason == "VERSION_NOT_SERVED"
