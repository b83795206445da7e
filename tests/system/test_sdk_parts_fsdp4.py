"""Four FSDP2 trainer processes push their shards as parts, and an engine on each server's node reads the
committed store bit for bit against full_tensor().

The trainers (tests/sdk_parts_fsdp4_trainer.py) are real processes in one Gloo group, a small model sharded
with fully_shard over a 4-rank CPU mesh: row counts that do not divide by 4, so the shards are uneven and rank 3
holds empty ones. Each step they compute full_tensor() (a collective) before the push and rank 0 saves it; the
test then reads every tensor through an EngineClient attached to each server's local socket (the store mapped
read-only, as a serving engine reads it) and holds the trainers at a store key until it has. Every shard
changes from one step to the next, so a stale read fails, and versions and generations are compared exactly.

The same 4 processes (their start is most of the time on a loaded host) push two steps INLINE to two servers
with the default 2 ingress slots each, so the 4 parts take turns at them, then two steps over SHM to a third
server on this host with 4 slots (SHM gives each part a run of its own), then two steps over COLLECTIVE to the
first two servers again: create_group() on every rank makes one Gloo transfer group (the 4 trainer ranks, then
each server's 2 workers) that carries both steps, each part's buckets point-to-point to each server's owner; the
servers' metrics show which transport committed each step, and the group is gone once the parts' clients close.
Every part's shards travel as several 64-byte buckets, so each one needs a slot again within a push."""

from __future__ import annotations

import contextlib
import datetime
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore

from weightsync.engine import EngineClient
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import ServerProcess, free_port, run_ranks, start_server

pytestmark = pytest.mark.timeout(300)

TRAINER = Path(__file__).resolve().parents[1] / "sdk_parts_fsdp4_trainer.py"
WORLD = 4
TRAINERS_TIMEOUT = 200
"""Bounds the 4 trainer processes, start to end."""
STEP_TIMEOUT = 150.0
"""Bounds the wait for all 4 ranks to post a step's push (their start, imports and sharding included)."""
SHARD_ROWS = {"0.weight": [3, 3, 3, 1], "0.bias": [3, 3, 3, 1], "2.weight": [2, 2, 1, 0], "2.bias": [2, 2, 1, 0],
              "3.weight": [1, 1, 1, 0], "4.weight": [2, 2, 2, 1], "4.bias": [2, 2, 2, 1]}
"""Each rank's rows of each parameter (torch.chunk over 4): uneven, and empty on rank 3 for two of them."""



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


PHASES = (("inline", ("v1", "v2")), ("shm", ("v3", "v4")), ("collective", ("v5", "v6")))
"""The trainers' phases (one client each), the steps of each: INLINE to the 2 servers, SHM to the third, then
COLLECTIVE to the first 2 again (their generations 3 and 4) through one Gloo transfer group."""


def scrape(server: ServerProcess) -> dict[str, float]:
    """The server's metrics, sample name (labels included) to value."""
    url = f"http://127.0.0.1:{server.ready['metrics_port']}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {name: float(value) for name, _, value in
            (line.rpartition(" ") for line in text.splitlines() if line and not line.startswith("#"))}


def committed(server: ServerProcess, transport: str) -> float:
    """How many staged updates the server committed over `transport`."""
    key = ('weightsync_update_duration_seconds_count{mode="staged",outcome="committed",'
           f'transport="{transport}"}}')
    return scrape(server).get(key, 0.0)


def listed_groups(server: ServerProcess) -> list[tuple[str, int, int, int]]:
    """The server's transfer groups: id, world size, trainer ranks, state."""
    return [(g.group_id, g.world_size, g.trainer_ranks, g.state)
            for g in server.stub().ListTransferGroups(pb.ListTransferGroupsRequest(), timeout=10).groups]


def read_steps(phases: list[tuple[str, list[ServerProcess]]], store: TCPStore, out: Path, ranks) -> None:
    """Every phase's steps as the ranks post them, an engine per server reading each one while the ranks wait."""
    engines = {s.address: EngineClient(server=s.address, name=f"fsdp4-reader-{k}", timeout=30)
               for k, s in enumerate(server for _, servers in phases for server in servers)}
    fulls: dict[str, dict[str, torch.Tensor]] = {}
    last: dict[str, int] = {}  # each server's generation at the last step read
    try:
        store.set("phases", json.dumps([[transport, [s.address for s in servers]] for transport, servers in phases]))
        for (transport, servers), (_, phase_steps) in zip(phases, PHASES, strict=True):
            previous: dict[str, int] | None = None
            if all(s.address in last for s in servers):  # a server of an earlier phase: its next generation
                previous = {s.address: last[s.address] for s in servers}
            for step in phase_steps:
                posted = wait_for_pushes(store, step, ranks)
                assert all(p == posted[0] for p in posted), posted
                assert sorted(posted[0]) == sorted(s.address for s in servers), posted
                if previous is None:  # a fresh server's first commit
                    assert set(posted[0].values()) == {1}, posted
                fulls[step] = torch.load(out / f"full-{step}.pt")
                read_every_tensor({s.address: engines[s.address] for s in servers}, step, fulls[step], posted[0],
                                  previous)
                if transport == "collective":  # the one group every rank created, the same for both steps
                    store.wait([f"group/{rank}" for rank in range(WORLD)], datetime.timedelta(seconds=10))
                    ids = {store.get(f"group/{rank}").decode() for rank in range(WORLD)}
                    assert len(ids) == 1, ids
                    for server in servers:  # 4 trainer ranks, then 2 workers of each server
                        assert listed_groups(server) == [(*ids, WORLD + 4, WORLD, pb.GROUP_STATE_READY)]
                previous = posted[0]
                last.update(previous)
                store.set(f"read/{step}", "go")
    finally:
        for engine in engines.values():
            engine.close()
    # Every tensor changed from each step to the next: a stale read could not have passed.
    steps = [step for _, phase_steps in PHASES for step in phase_steps]
    for before, after in pairwise(steps):
        assert [n for n in fulls[before] if same_bits(fulls[before][n], fulls[after][n])] == [], (before, after)


def test_four_fsdp_ranks_push_inline_to_two_servers_then_shm_to_one_each_read_by_an_engine(tmp_path):
    store = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    argv = [str(TRAINER), "{rank}", str(WORLD), str(free_port()), str(store.port), str(tmp_path)]
    started: list[ServerProcess] = []
    with ThreadPoolExecutor(4) as pool:
        # The ranks and the servers start side by side (each start is many seconds on a loaded host): the
        # ranks wait for the phases the test posts once the servers are up.
        ranks = pool.submit(run_ranks, argv, WORLD, tmp_path, TRAINERS_TIMEOUT)
        try:
            metrics = ("--metrics-listen", "127.0.0.1:0")  # which transport committed each step
            starts = [pool.submit(start_server, tmp_path, *metrics, workers=2) for _ in range(2)]
            starts.append(pool.submit(start_server, tmp_path, *metrics, "--local-socket", "auto",
                                      "--ingress-slot-count", str(WORLD), workers=2))
            for start in starts:  # start_server is bounded (90 s each)
                with contextlib.suppress(Exception):
                    started.append(start.result())
            assert len(started) == 3, [start.exception() for start in starts]
            servers = {"inline": started[:2], "shm": started[2:]}
            # INLINE: 4 parts, 2 slots a server, so they take turns; SHM: a run of one slot each.
            assert [s.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).limits.ingress_slot_count
                    for s in started] == [2, 2, WORLD]
            servers["collective"] = servers["inline"]
            read_steps([(transport, servers[transport]) for transport, _ in PHASES], store, tmp_path, ranks)
            ranks.exception()  # the ranks done: part 0's client deleted the group on closing
            groups_after = [listed_groups(s) for s in servers["collective"]]
            counts = {transport: [committed(s, transport) for s in started] for transport, _ in PHASES}
        finally:
            # Whatever failed, the ranks end rather than wait out their bounds: no phases, or no more steps.
            if not store.check(["phases"]):
                store.set("phases", "[]")
            for _, steps in PHASES:
                for step in steps:
                    if not store.check([f"read/{step}"]):
                        store.set(f"read/{step}", "stop")
            ranks.exception()  # the ranks done (run_ranks is bounded) before their servers stop
            codes = list(pool.map(lambda server: server.stop(), started))
        records = ranks.result()
    assert codes == [0, 0, 0], [s.log()[-3000:] for s in started]
    generations: dict[str, int] = {}
    for transport, (first, second) in PHASES:
        before = {s.address: generations.get(s.address, 0) for s in servers[transport]}
        for record in records:
            assert record[first] == {a: g + 1 for a, g in before.items()}
            assert record[second] == {a: g + 2 for a, g in before.items()}
            assert record[f"{first}_buckets"] > 2 and record[f"{second}_buckets"] > 2  # slots needed again
            assert record[f"{first}_placements"] == record[f"{second}_placements"] == ["(Shard(dim=0),)"]
        generations.update(record[second])
    assert {name: [r["v1_rows"][name] for r in records] for name in SHARD_ROWS} == SHARD_ROWS
    # Each phase's steps went over its transport: 2 INLINE then 2 COLLECTIVE commits on the first 2 servers, 2 SHM
    # on the third; each part of a COLLECTIVE step sent its buckets point-to-point through the group.
    assert counts == {"inline": [2, 2, 0], "shm": [0, 0, 2], "collective": [2, 2, 0]}, counts
    assert len({r["group_id"] for r in records}) == 1
    assert [r["group"] for r in records] == [{"rank": rank, "world_size": WORLD + 4, "trainer_ranks": WORLD}
                                             for rank in range(WORLD)]
    assert groups_after == [[], []]  # deleted at the end
