"""verl's actor ranks as real FSDP2 (issue 36): two actor processes with torch's fully_shard on CPU
over Gloo (a small model, rows that do not divide evenly by 2, float32 and bfloat16), one rollout
worker, a real weightsync server, verl's lifecycle as test_verl_checkpoint_engine drives it. The
model's state dict is DTensors; with every actor rank sending (senders "auto" over INLINE), each
rank's send_weights pushes its own local shards (the SDK sends them as boxes of the global tensor),
and the rollout reads every tensor bit for bit against the actor's full_tensor(). Two steps, every
shard changed between them.
"""

from __future__ import annotations

import multiprocessing
import socket
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("verl.checkpoint_engine", reason="verl is not installed here: run make test-verl")

from test_verl_checkpoint_engine import READY_S, Worker, assert_bit_exact, sync  # noqa: E402
from verl_workers import serve  # noqa: E402

from weightsync.client import WeightSyncClient  # noqa: E402

from helpers import running_server  # noqa: E402

pytestmark = pytest.mark.timeout(600)

WORLD = 2


class FsdpWorker(Worker):
    """A worker process whose actor rank is an FSDP2 rank (verl_workers.FsdpActor)."""

    def __init__(self, role: str, is_master: bool, engine_kwargs: dict, fsdp: tuple[int, int, int] | None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child, role, is_master, engine_kwargs, fsdp), daemon=True)
        self.process.start()
        child.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def workers_and_server(tmp_path) -> Iterator:
    """The workers started first, the server while they import verl (on a port picked for it)."""
    address = f"127.0.0.1:{free_port()}"
    kwargs = {"servers": [address], "transport": "inline", "timeout_s": 120}
    gloo = free_port()
    actors = [FsdpWorker("actor", rank == 0, kwargs, (rank, WORLD, gloo)) for rank in range(WORLD)]
    rollouts = [FsdpWorker("rollout", False, kwargs, None)]
    try:
        with running_server(tmp_path, "--listen", address, workers=1) as server:
            yield actors, rollouts, server
    finally:
        for w in actors + rollouts:
            w.stop()


def test_fsdp2_actor_ranks_each_send_their_shards_and_the_rollout_reads_full_tensors(workers_and_server) -> None:
    actors, rollouts, server = workers_and_server
    assert [w.answer(READY_S) for w in actors + rollouts] == ["WeightSyncCheckpointEngine"] * 3
    previous = None
    for step in (1, 2):
        actor_results, (received,) = sync(actors, rollouts, step)
        for result in actor_results:
            assert isinstance(result, dict), result  # else ("error", what the actor rank raised)
            assert result["placements"] == ["(Shard(dim=0),)"]
        full = actor_results[0]["full"]
        assert_bit_exact(received, full)
        for name, tensor in actor_results[1]["full"].items():
            assert_bit_exact({name: tensor}, {name: full[name]})  # both ranks gathered the same
        assert {t.dtype for t in full.values()} == {torch.float32, torch.bfloat16}
        if previous is not None:  # every tensor changed since the last step
            assert all(not t.equal(previous[name]) for name, t in full.items())
        previous = full

        # Each rank pushed every tensor as a DTensor, holding only its own rows (torch.chunk: the
        # first rank the larger half): its local shards, not the full tensors.
        for rank, result in enumerate(actor_results):
            pushed = {name: (kind, shape) for name, kind, shape in result["pushed"]}
            assert sorted(pushed) == sorted(full)
            for name, tensor in full.items():
                rows = tensor.shape[0]
                mine = (rows + 1) // 2 if rank == 0 else rows - (rows + 1) // 2
                assert pushed[name] == ("DTensor", [mine, *tensor.shape[1:]]), (rank, name)
    with WeightSyncClient(server.address) as client:
        assert client.verify(full).ok
