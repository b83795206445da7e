"""verl 0.9.1 drives weightsync's checkpoint engine: its registry finds "weightsync" (through the
custom_backend_module its workers import), and each sync runs verl's lifecycle as its
CheckpointEngineManager.update_weights does (prepare on every worker, the class's build_topology on
their answers, init_process_group with each one's part, send_weights on every actor rank beside
receive_weights on the rollout worker, finalize), across processes: two actor ranks (rank 0 is
verl's is_master, the sender), one rollout worker, a real weightsync server. The test process plays
the manager (verl's own manager needs Ray worker groups; the calls and their order are its).

Several steps, bit-exact against the actor's full tensors; a refused push fails every actor rank
and the rollout with PUSH_FAILED naming rank 0 at once, and the node keeps the last version;
the next step and a verify then pass; a LoRA adapter handed over (its tensors, or its peft_config)
is LORA_UNSUPPORTED on every worker at once, nothing pushed, then the next step; a sender that dies
is SENDER_LOST on the other rank.

Every actor rank sending its part (senders "all"): over INLINE (its own fleet), and over COLLECTIVE (the
senders-one fleet's processes, their engines built again in place, with torch.distributed over Gloo
between the actor ranks as verl's actor workers have it): one transfer group of both actor ranks and the
server's workers, made once and kept across steps, a refused share named on every worker, the next step
on a new group.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("verl.checkpoint_engine", reason="verl is not installed here: run make test-verl")

import torch  # noqa: E402
from verl.checkpoint_engine import CheckpointEngineRegistry  # noqa: E402
from verl.utils.import_utils import import_external_libs  # noqa: E402
from verl_workers import serve, weights_for  # noqa: E402

from weightsync.client import WeightSyncClient  # noqa: E402
from weightsync.engine import EngineClient  # noqa: E402

from helpers import running_server  # noqa: E402

pytestmark = pytest.mark.timeout(900)

ANSWER_S = 240.0
"""Bound on each answer from a worker process (the first delta push compiles the SDK's numba
kernels: over a minute on a loaded 2-core machine)."""
READY_S = 240.0
"""Bound on a worker's start: importing verl (Ray, transformers) takes a minute on a loaded 2-core machine."""
FLEET_KWARGS = {"transport": "inline", "timeout_s": 200, "senders": "one"}
"""The fleet's: actor rank 0 pushes every step, with delta."""
COLLECTIVE_KWARGS = {"transport": "collective", "senders": "all", "timeout_s": 20}
"""senders "all" over COLLECTIVE: every actor rank joins one transfer group with the server's workers."""


class Worker:
    def __init__(self, role: str, is_master: bool, engine_kwargs: dict) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child, role, is_master, engine_kwargs), daemon=True)
        self.process.start()
        child.close()

    def ready(self) -> str:
        return self.answer(READY_S)

    def call(self, method: str, **args) -> None:
        self.conn.send((method, args))

    def answer(self, bound: float = ANSWER_S):
        if not self.conn.poll(bound):
            raise AssertionError(f"worker {self.process.pid} did not answer within {bound} s")
        kind, value = self.conn.recv()
        return value if kind in ("ok", "ready") else ("error", value)

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("stop", {}))
                self.conn.poll(10)
            except (BrokenPipeError, OSError):
                pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)


def build_process_group(actors: list[Worker], rollouts: list[Worker]) -> None:
    """CheckpointEngineManager.build_process_group: prepare on every worker, the class's build_topology
    on their answers, init_process_group with each one's part; the backend class found as its __init__
    finds it (the custom module imported, then the registry)."""
    import_external_libs("weightsync.integrations.verl")
    backend_cls = CheckpointEngineRegistry.get("weightsync")
    workers = actors + rollouts
    for w in workers:
        w.call("prepare")
    metadata = [w.answer() for w in workers]
    actor_kwargs, rollout_kwargs = backend_cls.build_topology(len(actors), len(rollouts), metadata)
    for kwargs, group in ((actor_kwargs, actors), (rollout_kwargs, rollouts)):
        assert all(len(v) == len(group) for v in kwargs.values())
        for i, w in enumerate(group):
            w.call("init_process_group", **{k: v[i] for k, v in kwargs.items()})
    assert [w.answer() for w in workers] == [None] * len(workers)


def sync(actors: list[Worker], rollouts: list[Worker], step: int, *, bad_shape: bool = False,
         bad_norm_on: int | None = None, lora: str = "", bytes_of: int | None = None):
    """One update_weights, in CheckpointEngineManager's order (its steps 4 to 6). bytes_of: the actor
    ranks push weights_for(bytes_of) under the label `step`."""
    workers = actors + rollouts
    build_process_group(actors, rollouts)
    for rank, w in enumerate(actors):
        w.call("update_weights", step=step, bad_shape=bad_shape, bad_norm=rank == bad_norm_on,
               **({"lora": lora} if lora else {}), **({"bytes_of": bytes_of} if bytes_of is not None else {}))
    for w in rollouts:
        w.call("update_weights", step=step)
    results = [w.answer() for w in workers]
    for w in workers:
        w.call("finalize")
    assert [w.answer() for w in workers] == [None] * len(workers)
    return results[: len(actors)], results[len(actors):]


def assert_bit_exact(received: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert isinstance(received, dict), received  # else ("error", what the rollout worker raised)
    assert sorted(received) == sorted(expected)
    for name, tensor in expected.items():
        got = received[name]
        assert (got.dtype, got.shape) == (tensor.dtype, tensor.shape), name
        assert torch.equal(got.view(-1).view(torch.uint8), tensor.contiguous().view(-1).view(torch.uint8)), name


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator:
    with running_server(tmp_path_factory.mktemp("verl")) as server:
        yield server


def start_fleet(kwargs: dict) -> tuple[list[Worker], list[Worker]]:
    actors = [Worker("actor", True, kwargs), Worker("actor", False, kwargs)]
    rollouts = [Worker("rollout", False, kwargs)]
    assert [w.ready() for w in actors + rollouts] == ["WeightSyncCheckpointEngine"] * 3
    return actors, rollouts


@pytest.fixture(scope="module")
def fleet(server) -> Iterator[tuple[list[Worker], list[Worker]]]:
    """senders "one": actor rank 0 pushes every step, with delta."""
    actors, rollouts = start_fleet({"servers": [server.address], **FLEET_KWARGS})
    try:
        yield actors, rollouts
    finally:
        for w in actors + rollouts:
            w.stop()


@pytest.fixture(scope="module")
def parts_server(tmp_path_factory) -> Iterator:
    with running_server(tmp_path_factory.mktemp("verl-parts")) as server:
        yield server


@pytest.fixture(scope="module")
def parts_fleet(parts_server) -> Iterator[tuple[list[Worker], list[Worker]]]:
    """senders "auto" over INLINE: every actor rank pushes its share, one part each of one version.
    timeout_s is also the server's join deadline: a rank that never comes is named within it."""
    actors, rollouts = start_fleet({"servers": [parts_server.address], "transport": "inline", "timeout_s": 40})
    try:
        yield actors, rollouts
    finally:
        for w in actors + rollouts:
            w.stop()


def test_verl_registry_finds_weightsync() -> None:
    import_external_libs("weightsync.integrations.verl")
    from weightsync.integrations.verl import WeightSyncCheckpointEngine

    assert CheckpointEngineRegistry.get("weightsync") is WeightSyncCheckpointEngine


def test_steps_bit_exact_a_refused_push_fails_every_actor_rank_then_next_step(fleet, server) -> None:
    actors, rollouts = fleet
    for step in (1, 2, 3):
        actor_results, (received,) = sync(actors, rollouts, step)
        assert_bit_exact(received, weights_for(step))
        for metrics in actor_results:
            assert set(metrics) == {"weightsync/push_s", "weightsync/bytes_sent", "weightsync/dense_bytes"}
    assert actor_results[0]["weightsync/bytes_sent"] < actor_results[0]["weightsync/dense_bytes"]  # delta

    # Step 4: the sender's push is refused (a tensor of another shape): every actor rank and the
    # rollout worker raise PUSH_FAILED naming rank 0, at once (not at their 200 s bound); the node
    # keeps step 3.
    started = time.monotonic()
    actor_results, (rollout_result,) = sync(actors, rollouts, 4, bad_shape=True)
    assert time.monotonic() - started < 60
    for kind, error in [*actor_results, rollout_result]:
        assert kind == "error"
        assert (error["type"], error["reason"], error["rank"], error["version"]) == (
            "WeightSyncVerlError", "PUSH_FAILED", 0, "4")
        assert error["cause_reason"] == "TENSOR_SHAPE_MISMATCH", error
    with EngineClient(server=server.address, name="test") as engine:
        assert engine.status().version.version == "3"

    # The next step commits, bit-exact, and the server's store verifies against the actor's tensors.
    _, (received,) = sync(actors, rollouts, 5)
    assert_bit_exact(received, weights_for(5))
    with WeightSyncClient(server.address) as client:
        assert client.verify(weights_for(5)).ok


def test_a_lora_adapter_is_refused_on_every_worker_before_anything_moves_then_next_step(fleet, server) -> None:
    """verl 0.9.1's disaggregated path hands a checkpoint engine no adapter (README); a verl that hands
    over the adapter's tensors or its peft_config is refused at once, on both actor ranks and on the
    rollout (not at its 200 s bound), and the node keeps step 5."""
    actors, rollouts = fleet
    for step, lora, what in ((6, "tensors", "1 LoRA adapter tensors (base_model.model.model.layers.0.self_attn."
                                            "q_proj.lora_A.weight)"),
                             (7, "config", "a LoRA adapter's config (peft_config)")):
        started = time.monotonic()
        actor_results, (rollout_result,) = sync(actors, rollouts, step, lora=lora)
        assert time.monotonic() - started < 60
        for kind, error in [*actor_results, rollout_result]:
            assert (kind, error["type"], error["reason"], error["rank"], error["version"]) == (
                "error", "WeightSyncVerlError", "LORA_UNSUPPORTED", -1, str(step)), error
            assert error["message"] == (
                f"LORA_UNSUPPORTED: version {step}: verl handed over {what}; weightsync cannot have the rollout's "
                "engine load an adapter (its loaders load full weights, not a LoRA adapter and its config). Merge "
                "the adapter into the weights before the sync (actor_rollout_ref.model.lora.merge=True: verl then "
                "sends full weights), or use a checkpoint engine that loads adapters"), error
        with EngineClient(server=server.address, name="test") as engine:
            assert engine.status().version.version == "5"

    _, (received,) = sync(actors, rollouts, 8)
    assert_bit_exact(received, weights_for(8))
    with WeightSyncClient(server.address) as client:
        assert client.verify(weights_for(8)).ok


def held(server) -> tuple[str, int]:
    """The node's committed label and generation."""
    with EngineClient(server=server.address, name="test") as engine:
        version = engine.status().version
        return version.version, version.generation


def finalize(workers: list[Worker]) -> None:
    for w in workers:
        w.call("finalize")
    assert [w.answer() for w in workers] == [None] * len(workers)


def test_a_resumed_run_and_a_new_run_each_commit_their_first_step_over_a_node_holding_a_later_one(
        fleet, server) -> None:
    """verl's fit() syncs global_steps right after loading: the checkpoint's step on resume, 0 for a new
    run. The node's server outlived the run before and holds a later step of it. The engines are built
    again (a new run: verl builds them anew), and the first sync commits and the rollout reads exactly its
    bytes (it waits for this sync's commit, not for a label: a label later than the one asked was
    VERSION_GONE on the rollout while the actors' push committed); then the run goes on."""
    actors, rollouts = fleet
    later = int(held(server)[0] or 0) + 50
    _, (received,) = sync(actors, rollouts, later)  # the run before this one, at a later step
    assert_bit_exact(received, weights_for(later))
    for step in (3, 0):  # resumed from a checkpoint at step 3, then a new run
        rebuild(actors, rollouts, {"servers": [server.address], **FLEET_KWARGS})
        _, (received,) = sync(actors, rollouts, step)
        assert_bit_exact(received, weights_for(step))
        assert held(server)[0] == str(step)
    _, (received,) = sync(actors, rollouts, 1)
    assert_bit_exact(received, weights_for(1))
    with WeightSyncClient(server.address) as client:
        assert client.verify(weights_for(1)).ok


def test_a_repeated_label_with_other_bytes_is_read_as_this_sync_pushed_it(fleet, server) -> None:
    """A label the node already holds, pushed again with other bytes: the rollout, asked before the
    actors push, waits for this sync's commit and reads the new bytes (it read the old ones under the
    label at once, reporting success, while the actors were still gathering)."""
    actors, rollouts = fleet
    step = int(held(server)[0] or 0) + 1
    _, (received,) = sync(actors, rollouts, step)
    assert_bit_exact(received, weights_for(step))
    _, generation = held(server)

    build_process_group(actors, rollouts)
    rollouts[0].call("update_weights", step=step)
    # Not yet answered: it waits for the actors' push. (Two seconds cannot fail a rollout that waits, however
    # loaded the machine; one that read the label's old bytes answers within them.)
    assert not rollouts[0].conn.poll(2.0), "the rollout answered before the actors pushed"
    for w in actors:
        w.call("update_weights", step=step, bytes_of=step + 100)
    results = [w.answer() for w in actors + rollouts]
    finalize(actors + rollouts)
    assert all(isinstance(r, dict) for r in results[:2]), results[:2]
    assert_bit_exact(results[2], weights_for(step + 100))
    assert held(server) == (str(step), generation + 1)
    with WeightSyncClient(server.address) as client:
        assert client.verify(weights_for(step + 100)).ok


def test_a_rollout_engine_built_after_the_actors_reads_this_syncs_outcome(fleet, server) -> None:
    """A rollout engine built after the actor ranks have synced many times (a restarted replica, elastic
    scale-up) reads this sync's outcome: a refused push is PUSH_FAILED naming rank 0 at once (it counted
    its own syncs from 1 and read another sync's outcome: then it waited out its 200 s bound for a label,
    VERSION_NOT_COMMITTED); the next step, bit for bit."""
    actors, rollouts = fleet
    step = int(held(server)[0] or 0) + 1
    _, (received,) = sync(actors, rollouts, step)  # the actor ranks have synced before
    assert_bit_exact(received, weights_for(step))
    rebuild([], rollouts, {"servers": [server.address], **FLEET_KWARGS})
    label, generation = held(server)
    step += 1
    started = time.monotonic()
    actor_results, (rollout_result,) = sync(actors, rollouts, step, bad_shape=True)
    assert time.monotonic() - started < 60
    for kind, error in [*actor_results, rollout_result]:
        assert (kind, error["reason"], error["rank"], error["version"], error["cause_reason"]) == (
            "error", "PUSH_FAILED", 0, str(step), "TENSOR_SHAPE_MISMATCH"), error
    assert held(server) == (label, generation)
    _, (received,) = sync(actors, rollouts, step + 1)
    assert_bit_exact(received, weights_for(step + 1))


def groups(server) -> list[str]:
    from weightsync.v1 import weight_sync_service_pb2 as pb

    listed = server.stub().ListTransferGroups(pb.ListTransferGroupsRequest(), timeout=10).groups
    return [g.group_id for g in listed]


def rebuild(actors: list[Worker], rollouts: list[Worker], kwargs: dict, world_port: int | None = None) -> None:
    """Each worker's engine closed and built again with `kwargs`, in the same processes (verl imported
    once); the actor ranks' torch.distributed (Gloo) started first when world_port is given."""
    for rank, w in enumerate(actors):
        w.call("rebuild", engine_kwargs=kwargs, world=(rank, len(actors), world_port) if world_port else None)
    for w in rollouts:
        w.call("rebuild", engine_kwargs=kwargs)
    assert [w.answer() for w in actors + rollouts] == [None] * (len(actors) + len(rollouts))


@pytest.fixture
def collective_fleet(fleet, server) -> Iterator[tuple[list[Worker], list[Worker]]]:
    """The senders-one fleet's started processes, their engines built again for senders "all" over
    "collective" (a worker start costs 13-64 s here); then built back, the group deleted (rank 0's
    close), and one senders-one step bit for bit so the tests after it find the fleet as it was."""
    from helpers import free_port

    actors, rollouts = fleet
    rebuild(actors, rollouts, {"servers": [server.address], **COLLECTIVE_KWARGS}, free_port())
    yield actors, rollouts
    if not actors[1].process.is_alive():  # the test killed it: a new rank 1 in its place (the fleet's list)
        actors[1] = Worker("actor", False, {"servers": [server.address], **FLEET_KWARGS})
        assert actors[1].ready() == "WeightSyncCheckpointEngine"
    rebuild(actors, rollouts, {"servers": [server.address], **FLEET_KWARGS})
    assert groups(server) == []
    with EngineClient(server=server.address, name="test") as engine:
        step = int(engine.status().version.version or 0) + 1
    _, (received,) = sync(actors, rollouts, step)
    assert_bit_exact(received, weights_for(step))


def test_every_actor_rank_sends_its_part_over_one_transfer_group_kept_across_steps(collective_fleet, server) -> None:
    """Each actor rank's share goes point-to-point over one group of both actor ranks and the server's
    workers, made at the first sync's init_process_group and kept; a refused share (rank 1's norm one
    element short) is PUSH_FAILED naming rank 1 on both actor ranks and the rollout within half their 20 s
    bound, the node keeps its step; the next sync makes a new group and commits bit for bit, and the store
    verifies; a killed rank 1 is SENDER_LOST on rank 0."""
    actors, rollouts = collective_fleet
    assert groups(server) == []
    with EngineClient(server=server.address, name="test") as engine:
        first = int(engine.status().version.version or 0) + 1  # after the steps of the tests before
        generations, kept = [], []
        for step in (first, first + 1, first + 2):
            actor_results, (received,) = sync(actors, rollouts, step)
            assert_bit_exact(received, weights_for(step))
            assert actor_results[0] == actor_results[1], actor_results  # both parts' totals
            generations.append(engine.status().version.generation)
            kept.extend(groups(server))
        assert generations == [generations[0], generations[0] + 1, generations[0] + 2]  # one commit per step
        assert len(kept) == 3 and len(set(kept)) == 1, kept  # one group, made once, kept across steps

        bad = first + 3
        started = time.monotonic()
        actor_results, (rollout_result,) = sync(actors, rollouts, bad, bad_norm_on=1)
        assert time.monotonic() - started < COLLECTIVE_KWARGS["timeout_s"] / 2  # at once, not at the bound
        for kind, error in [*actor_results, rollout_result]:
            assert kind == "error", error
            assert (error["type"], error["reason"], error["rank"], error["version"]) == (
                "WeightSyncVerlError", "PUSH_FAILED", 1, str(bad)), error["message"]
        assert engine.status().version.version == str(bad - 1)
        assert engine.status().version.generation == generations[-1]

        # The next sync: every actor rank makes the group again (the failed one may be BROKEN), then commits.
        after = bad + 1
        _, (received,) = sync(actors, rollouts, after)
        assert_bit_exact(received, weights_for(after))
        assert engine.status().version.generation == generations[-1] + 1
        regrouped = groups(server)
        assert len(regrouped) == 1 and regrouped != kept[:1], (regrouped, kept)
    with WeightSyncClient(server.address) as client:
        assert client.verify(weights_for(after)).ok

    # Rank 1 dies once the sync began: rank 0's parts agreement breaks (its Gloo peer is gone), which names
    # no one; rank 1 never publishes its outcome, so rank 0 raises SENDER_LOST naming rank 1 at its 20 s
    # bound (after its own last beat).
    build_process_group(actors, rollouts)
    actors[1].process.kill()
    actors[1].process.join(10)
    started = time.monotonic()
    actors[0].call("update_weights", step=after + 1)
    kind, error = actors[0].answer()
    assert (kind, error["reason"], error["rank"], error["version"]) == ("error", "SENDER_LOST", 1, str(after + 1)), error
    assert time.monotonic() - started < COLLECTIVE_KWARGS["timeout_s"] + 10
    with EngineClient(server=server.address, name="test") as engine:
        assert engine.status().version.version == str(after)


def test_a_dead_sender_is_sender_lost_on_the_other_actor_rank(fleet) -> None:
    """The sender dies once the sync began (after init_process_group): its outcome store goes with it."""
    actors, rollouts = fleet
    sender, other = actors
    build_process_group(actors, rollouts)
    sender.process.kill()
    sender.process.join(10)
    other.call("update_weights", step=9)
    kind, error = other.answer()
    assert (kind, error["reason"], error["rank"], error["version"]) == ("error", "SENDER_LOST", 0, "9")


def test_every_actor_rank_sends_its_part_one_commit_per_step_and_a_failing_rank_is_named(
        parts_fleet, parts_server) -> None:
    actors, rollouts = parts_fleet
    with EngineClient(server=parts_server.address, name="test") as engine:
        generations = []
        for step in (1, 2):
            actor_results, (received,) = sync(actors, rollouts, step)
            assert_bit_exact(received, weights_for(step))
            generations.append(engine.status().version.generation)
            # every rank reports the step's totals over both parts: step 1 dense (the bytes sent count
            # each bucket's alignment, so at least the tensors' bytes), step 2 with delta (each part
            # against its own last commit: rank 0's embedding, two rows changed, as a patch)
            assert actor_results[0] == actor_results[1], actor_results
            dense = sum(t.numel() * t.element_size() for t in weights_for(step).values())
            assert actor_results[0]["weightsync/dense_bytes"] == dense, actor_results
            sent = actor_results[0]["weightsync/bytes_sent"]
            assert sent >= dense if step == 1 else sent < dense / 2, actor_results
        assert generations[1] == generations[0] + 1  # both parts, one commit

        # Step 3: rank 1's share (the norm) has the wrong shape; rank 0's share is fine. Every actor
        # rank and the rollout raise PUSH_FAILED naming rank 1, and the node keeps step 2.
        actor_results, (rollout_result,) = sync(actors, rollouts, 3, bad_norm_on=1)
        for kind, error in [*actor_results, rollout_result]:
            assert kind == "error", error
            assert (error["type"], error["reason"], error["rank"], error["version"]) == (
                "WeightSyncVerlError", "PUSH_FAILED", 1, "3"), error["message"]
        assert engine.status().version.version == "2"
        assert engine.status().version.generation == generations[1]

    # The next step commits, bit-exact, and the server's store verifies.
    _, (received,) = sync(actors, rollouts, 4)
    assert_bit_exact(received, weights_for(4))
    with WeightSyncClient(parts_server.address) as client:
        assert client.verify(weights_for(4)).ok


def test_a_rank_that_never_sends_its_part_is_named_on_the_other(parts_fleet, parts_server) -> None:
    actors, rollouts = parts_fleet
    first, second = actors
    build_process_group(actors, rollouts)  # rank 1 dies once the sync began
    second.process.kill()
    second.process.join(10)
    first.call("update_weights", step=5)
    kind, error = first.answer()
    assert (kind, error["reason"], error["rank"], error["version"], error["cause_reason"]) == (
        "error", "PUSH_FAILED", 1, "5", "PARTS_MISSING"), error
    with EngineClient(server=parts_server.address, name="test") as engine:
        assert engine.status().version.version == "4"


def test_every_rank_sending_over_collective_needs_the_actor_ranks_torch_distributed() -> None:
    """An actor rank without torch.distributed (verl's actor workers have it) cannot agree on the transfer
    group with the others: CONFIG_INVALID saying so, at init_process_group, before any server is asked."""
    import torch.distributed as dist

    from weightsync.integrations.verl import WeightSyncCheckpointEngine, WeightSyncVerlError

    assert not dist.is_initialized()
    engine = WeightSyncCheckpointEngine(bucket_size=1 << 20, is_master=True, servers=["127.0.0.1:1"],
                                        **COLLECTIVE_KWARGS)
    try:
        metadata = [engine.prepare(), {}]
        actor, _ = WeightSyncCheckpointEngine.build_topology(2, 0, metadata)
        with pytest.raises(WeightSyncVerlError) as caught:
            engine.init_process_group(**{k: v[0] for k, v in actor.items()})
        assert caught.value.reason == "CONFIG_INVALID"
        assert str(caught.value) == (
            "CONFIG_INVALID: senders 'all' over 'collective' needs torch.distributed initialized on every actor "
            "rank, its world the actor's (2 ranks, this one 0): here it is not initialized")
    finally:
        engine.close()
