"""Four FSDP2 trainer processes push their shards as parts, and an engine on each server's node reads the
committed store bit for bit against full_tensor().

The trainers (tests/sdk_parts_fsdp4_trainer.py) are real processes in one Gloo group, a small model sharded
with fully_shard over a 4-rank CPU mesh: row counts that do not divide by 4, so the shards are uneven and rank 3
holds empty ones. Each step they compute full_tensor() (a collective) before the push and rank 0 saves it; the
test then reads every tensor through an EngineClient attached to each server's local socket (the store mapped
read-only, as a serving engine reads it) and holds the trainers at a store key until it has. Between the two
steps every shard changes, so a stale read fails, and the versions and generations are compared exactly.

INLINE: two servers with the default 2 ingress slots each, so the 4 parts take turns at them. SHM: one server
on this host with 4 slots (SHM gives each part a run of its own)."""

from __future__ import annotations

import datetime
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from sdk_parts_fsdp4_trainer import STEPS
from torch.distributed import TCPStore

from weightsync.engine import EngineClient
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import ServerProcess, run_ranks, start_server

pytestmark = pytest.mark.timeout(300)

TRAINER = Path(__file__).parent / "sdk_parts_fsdp4_trainer.py"
WORLD = 4
TRAINERS_TIMEOUT = 200
"""Bounds the 4 trainer processes, start to end."""
STEP_TIMEOUT = 150.0
"""Bounds the wait for all 4 ranks to post a step's push (their start, imports and sharding included)."""
SHARD_ROWS = {"0.weight": [3, 3, 3, 1], "0.bias": [3, 3, 3, 1], "2.weight": [2, 2, 1, 0], "2.bias": [2, 2, 1, 0],
              "3.weight": [1, 1, 1, 0], "4.weight": [2, 2, 2, 1], "4.bias": [2, 2, 2, 1]}
"""Each rank's rows of each parameter (torch.chunk over 4): uneven, and empty on rank 3 for two of them."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def wait_for_pushes(store: TCPStore, step: str, ranks) -> list[dict[str, int]]:
    """Every rank's generations for `step` as it posted them; bounded, and failing at once (with the logs)
    when the trainers exited first."""
    keys = [f"pushed/{step}/{rank}" for rank in range(WORLD)]
    deadline = time.monotonic() + STEP_TIMEOUT
    while True:
        try:
            store.wait(keys, datetime.timedelta(seconds=1))
            break
        except RuntimeError:  # not all posted within the second (the store's timeout)
            if ranks.done():
                ranks.result()  # a rank that failed: its log's tail
                raise AssertionError(f"the trainers exited before all posted {step}") from None
            if time.monotonic() > deadline:
                raise AssertionError(f"not every rank pushed {step} within {STEP_TIMEOUT} s") from None
    return [json.loads(store.get(key)) for key in keys]


def read_every_tensor(engines: dict[str, EngineClient], step: str, full: dict[str, torch.Tensor],
                      generations: dict[str, int], previous: dict[str, int] | None) -> None:
    """Each server's engine reads the current version: exactly `step` at the generation its push returned, the
    second one more than the first with every tensor written by it, and every tensor's bits full_tensor()'s."""
    for address, engine in engines.items():
        with engine.acquire(wait=10) as snapshot:
            assert (snapshot.version.version, snapshot.generation) == (step, generations[address]), address
            if previous is not None:
                assert snapshot.generation == previous[address] + 1
                assert snapshot.changed_since(previous[address]) == sorted(full)  # every shard changed
            assert sorted(snapshot.tensors) == sorted(full)
            assert set(snapshot.written.values()) == {generations[address]}
            wrong = [name for name, tensor in full.items() if not same_bits(snapshot.tensors[name], tensor)]
            assert wrong == [], f"{address} at {step}: {wrong} differ from full_tensor()"


def run_case(servers: list[ServerProcess], out: Path, transport: str) -> list[dict]:
    """The 4 ranks' two steps, an engine per server reading each one while the ranks wait; their records."""
    addresses = [s.address for s in servers]
    store = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    argv = [str(TRAINER), "{rank}", str(WORLD), str(free_port()), str(store.port), ",".join(addresses), str(out),
            transport]
    engines = {a: EngineClient(server=a, name=f"fsdp4-reader-{k}", timeout=30) for k, a in enumerate(addresses)}
    with ThreadPoolExecutor(1) as pool:
        ranks = pool.submit(run_ranks, argv, WORLD, out, TRAINERS_TIMEOUT)
        previous: dict[str, int] | None = None
        fulls: dict[str, dict[str, torch.Tensor]] = {}
        try:
            for step in STEPS:
                posted = wait_for_pushes(store, step, ranks)
                assert all(p == posted[0] for p in posted) and sorted(posted[0]) == sorted(addresses), posted
                fulls[step] = torch.load(out / f"full-{step}.pt")
                read_every_tensor(engines, step, fulls[step], posted[0], previous)
                previous = posted[0]
                store.set(f"read/{step}", "go")
        finally:
            for step in STEPS:
                if not store.check([f"read/{step}"]):
                    store.set(f"read/{step}", "stop")  # a failed read: the ranks end rather than wait out
            for engine in engines.values():
                engine.close()
        records = ranks.result()
    # Every tensor changed between the steps: a stale read could not have passed.
    assert [n for n in fulls["v1"] if same_bits(fulls["v1"][n], fulls["v2"][n])] == []
    return records


def check_records(records: list[dict], servers: list[ServerProcess]) -> None:
    first = records[0]["v1"]
    for record in records:
        assert record["v1"] == first and record["v2"] == {a: g + 1 for a, g in first.items()}
        assert record["v1_placements"] == record["v2_placements"] == ["(Shard(dim=0),)"]
    assert {name: [r["v1_rows"][name] for r in records] for name in SHARD_ROWS} == SHARD_ROWS
    for server in servers:
        info = server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        assert (info.current_version.version, info.current_version.generation) == ("v2", first[server.address] + 1)


def test_four_fsdp_ranks_inline_to_two_servers_read_by_an_engine_on_each(tmp_path):
    servers = [start_server(tmp_path, workers=2) for _ in range(2)]
    try:
        for server in servers:  # 4 parts, 2 slots each: they take turns
            assert server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).limits.ingress_slot_count == 2
        check_records(run_case(servers, tmp_path, "inline"), servers)
    finally:
        codes = [server.stop() for server in servers]
    assert codes == [0, 0], [s.log()[-3000:] for s in servers]


def test_four_fsdp_ranks_over_shm_to_one_server_read_by_its_engine(tmp_path):
    server = start_server(tmp_path, "--local-socket", "auto", "--ingress-slot-count", str(WORLD), workers=2)
    try:
        check_records(run_case([server], tmp_path, "shm"), [server])
    finally:
        code = server.stop()
    assert code == 0, server.log()[-3000:]
