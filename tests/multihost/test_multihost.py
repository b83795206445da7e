"""Issue "Multi-host netns suite: 2 nodes x 2 workers, COLLECTIVE and INLINE".

Three namespaces on one bridge (netns.py): the trainer at 10.231.0.1, node-a at .2, node-b at
.3, each with a decoy second interface. A 2-worker CPU server runs in each node namespace,
bound to its own address, with mTLS (server certificates carry the node IP as their only SAN).
The trainer (trainer.py, the SDK) runs in the trainer namespace and is driven over stdin; every
gRPC check of the servers goes through it, over mTLS, since this process (root namespace) cannot
reach the mesh. It can reach each server's local unix socket, though (a filesystem path crosses
network namespaces), and reads the node's store through it as an engine does.

What every push here is held to (push() below), over COLLECTIVE (Gloo) and INLINE alike:

  - one owner per bucket per node: each worker's received_bytes grows by exactly the bytes of
    the buckets common/ownership.py gives it, the two add up to the bytes pushed to the node
    (and to its UpdateCommitted.size_bytes), and both workers received some; over Gloo the SDK
    sent each bucket to exactly one rank per server, that server's owner;
  - one copy on the wire per node: each node's interface received the bytes pushed once (plus
    headers), not once per worker; the trainer's sent them once per node;
  - bit-exact (exact()): the SDK's verify, the store's own checksums (GetTensorChecksumsResponse
    .tensors, every tensor's WS64; `workers` empty), and the bytes themselves, read from the
    store's memfd arenas and compared bit for bit;
  - one copy per node in memory: StoreInfo.live_bytes is the bytes pushed, held_bytes that
    once (rounded to pages) after a dense IN_PLACE push into an empty store, twice once a
    STAGED push made the shadow; no worker stages more than a bucket.

  1. the happy path, COLLECTIVE: the TCPStore sits on the trainer's mesh address, the
     collective binds the mesh interface on every host, IN_PLACE then STAGED pushes;
  2. the happy path, INLINE: no group, the bytes inside the mTLS gRPC streams;
  3. 5 ms delay + 0.1% loss on every link, both transports: the updates complete exactly;
  4. node-b's link cut mid-update, both transports, STAGED and IN_PLACE: the push fails with a
     typed status naming node-b, STAGED keeps the old version bit for bit on both nodes,
     IN_PLACE leaves them INCONSISTENT at the old version, and after the link returns the next
     update succeeds, exactly;
  5. the same INLINE cut from a client whose timeout is longer than the servers' transfer
     timeout: node-b must still be the node named, not the healthy node that idled out first.
"""

from __future__ import annotations

import time

import pytest
from meshkit import (
    GROUP_TIMEOUT,
    MARGIN,
    MEASURED,
    NODES,
    RPC_TIMEOUT,
    SERVER_PORT,
    TRANSFER_TIMEOUT,
    Cluster,
    bitwise_equal,
    owned_bytes,
    read_store,
)
from trainer import model

from weightsync.common import dtypes
from weightsync.common.checksum import ws64
from weightsync.common.ownership import bucket_owners
from weightsync.v1 import tensor_pb2

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(300)]

# One model (the set of tensor names is fixed after the first push; a server refuses new ones).
# 24 x 1 MiB buckets and a small one: a cut after bucket 1 leaves far more to send than the
# socket buffers hold, and each worker owns about half of every push.
MODEL_MB = 24
CUT_AT_BUCKET = 1
SETTLE_BEFORE_CUT = 0.5
"""Seconds between bucket 1 being on its way and the cut: buckets 0 and 1 reach both nodes
(100 x the 5 ms delay), so an IN_PLACE push has written into node-b's store before it is cut off."""
WORKERS = 2
PAGE = 4096
"""A store segment's footprint is its size rounded up to a page (one segment per bucket)."""
WIRE_OVERHEAD = 1.2
"""Link bytes allowed per pushed byte: Ethernet/IP/TCP headers, TLS, gRPC framing, retransmits.
A second copy per node (a broadcast to both workers) would be 2.0."""
LOOPBACK = "127.0.0.1"


# -- helpers ------------------------------------------------------------------------------------
def node_addresses(cluster: Cluster) -> list[str]:
    return [f"{cluster.mesh.host(role).ip}:{SERVER_PORT}" for role in NODES]


def infos(cluster: Cluster) -> list[dict]:
    info = cluster.trainer.call("info")["servers"]
    assert [s["address"] for s in info] == node_addresses(cluster)
    return info


def assert_serving(cluster: Cluster, version: str, generation: int | None = None) -> list[dict]:
    """Both servers: the store CONSISTENT (and so every worker's view of it), `version` live, the
    same generation on both."""
    info = infos(cluster)
    for server in info:
        assert server["store_state"] == "STORE_STATE_CONSISTENT", server
        assert server["store"]["present"] and server["store"]["state"] == "STORE_STATE_CONSISTENT", server
        assert server["version"] == version, server
        assert [w["store_state"] for w in server["workers"]] == ["STORE_STATE_CONSISTENT"] * WORKERS, server
        assert [w["state"] for w in server["workers"]] == ["WORKER_STATE_RUNNING"] * WORKERS, server
    generations = {s["generation"] for s in info}
    assert len(generations) == 1, info
    if generation is not None:
        assert generations == {generation}, info
    return info


def link_bytes(cluster: Cluster) -> dict[str, tuple[int, int]]:
    return {role: cluster.mesh.link_bytes(role) for role in cluster.mesh.hosts}


def owner_rank_offsets(cluster: Cluster, group_id: str) -> list[int]:
    """Each server's rank_offset in the group (its worker w is rank rank_offset + w)."""
    groups = cluster.trainer.call("groups")["groups"]
    offsets = []
    for address in node_addresses(cluster):
        mine = [g for g in groups[address] if g["group_id"] == group_id]
        assert len(mine) == 1, groups
        offsets.append(mine[0]["rank_offset"])
    return offsets


def assert_one_owner_per_bucket(cluster: Cluster, answer: dict, before: list[dict], after: list[dict],
                                transport: str) -> None:
    """Each bucket received by exactly one worker per node, its owner (see the module docstring)."""
    sizes = answer["bucket_sizes"]
    assert len(sizes) == answer["buckets"] and sum(sizes) == answer["bytes"] and min(sizes) > 0, answer
    expected = owned_bytes(sizes, WORKERS)
    largest = max(sizes)
    for old, new, outcome in zip(before, after, answer["servers"], strict=True):
        where = new["address"]
        assert outcome["server"] == where, answer
        # received_bytes counts since the worker (re)started: none may have restarted meanwhile.
        assert [w["restart_count"] for w in new["workers"]] == [w["restart_count"] for w in old["workers"]], (old, new)
        got = [n["received_bytes"] - o["received_bytes"] for o, n in zip(old["workers"], new["workers"], strict=True)]
        assert got == expected, f"{where}: workers received {got}, owners of {sizes} would be {expected}"
        assert sum(got) == outcome["size_bytes"] == answer["bytes"], (where, got, outcome, answer["bytes"])
        if len(sizes) >= WORKERS:
            assert all(share > 0 for share in got), f"{where}: a worker received nothing: {got}"
        for worker in new["workers"]:  # receivers, not replicas: at most a bucket of staging, in host memory
            assert not worker["staging_on_device"] and 0 <= worker["staging_bytes"] <= largest, (where, worker)
    if transport == "collective":
        offsets = owner_rank_offsets(cluster, answer["group_id"])
        ranks = [[offset + owner for offset in offsets] for owner in bucket_owners(sizes, WORKERS)]
        assert answer["sent_to"] == ranks, f"Gloo sends went to {answer['sent_to']}, the owners are {ranks}"
    else:
        assert answer["sent_to"] == [], answer["sent_to"]


def assert_one_copy_on_the_wire(answer: dict, before: dict[str, tuple[int, int]],
                                after: dict[str, tuple[int, int]]) -> dict[str, float]:
    """Each node's interface took in the pushed bytes once; the trainer's sent them once per node."""
    pushed = answer["bytes"]
    ratios = {}
    for role in NODES:
        received = after[role][0] - before[role][0]
        ratios[role] = round(received / pushed, 4)
        assert pushed <= received <= pushed * WIRE_OVERHEAD, (
            f"{role} received {received} bytes on its link for a {pushed}-byte push ({ratios[role]:.3f}x)")
    sent = after["trainer"][1] - before["trainer"][1]
    ratios["trainer (sent)"] = round(sent / pushed, 4)
    assert len(NODES) * pushed <= sent <= len(NODES) * pushed * WIRE_OVERHEAD, (sent, pushed)
    return ratios


def assert_held(info: list[dict], answer: dict, copies: tuple[int, ...]) -> None:
    """StoreInfo: live_bytes is the pushed bytes; held_bytes that many times over (`copies`: the
    counts allowed), each copy rounded up to a page per bucket; never a copy per worker."""
    pushed, buckets = answer["bytes"], answer["buckets"]
    for server in info:
        store = server["store"]
        assert store["live_bytes"] == pushed, (server["address"], store, pushed)
        assert store["tensor_count"] == answer["tensors"], (server["address"], store, answer["tensors"])
        held = store["held_bytes"]
        assert any(n * pushed <= held <= n * (pushed + PAGE * buckets) for n in copies), (
            f"{server['address']}: held_bytes {held} for a {pushed}-byte model in {buckets} buckets; "
            f"expected {' or '.join(f'{n} cop' + ('y' if n == 1 else 'ies') for n in copies)}")


def exact(cluster: Cluster, seed: int, version: str, mb: float = MODEL_MB) -> None:
    """Every tensor of `model(seed)` on both nodes, bit for bit: verify, the store's checksums, its bytes."""
    answer = cluster.trainer.call("verify", seed=seed, mb=mb, wait=120)
    assert answer["ok"] and answer["checked"] > 0, answer["mismatches"]
    tensors = model(seed, mb)
    expected = {name: {"dtype": tensor_pb2.Dtype.Name(dtypes.from_torch(t.dtype)), "shape": list(t.shape),
                       "algorithm": "CHECKSUM_ALGORITHM_WS64", "value": ws64(t)} for name, t in tensors.items()}
    servers = cluster.trainer.call("checksums", wait=120)["servers"]
    assert [s["address"] for s in servers] == node_addresses(cluster)
    for server in servers:
        where = server["address"]
        assert (server["version"], server["store_state"]) == (version, "STORE_STATE_CONSISTENT"), server
        assert server["workers"] == 0, f"{where}: checksums per worker ({server['workers']}); the store has one copy"
        assert [t["name"] for t in server["tensors"]] == sorted(expected), where
        wrong = [t["name"] for t in server["tensors"] if {k: v for k, v in t.items() if k != "name"} != expected[t["name"]]]
        assert not wrong, f"{where}: checksums differ for {wrong[:10]}"
    for role, info in zip(NODES, infos(cluster), strict=True):
        held_version, stored = read_store(info["local_socket"])
        assert held_version == version, (role, held_version)
        assert sorted(stored) == sorted(tensors), role
        wrong = [name for name, t in tensors.items() if not bitwise_equal(stored[name], t)]
        assert not wrong, f"{role}: bytes differ for {wrong[:10]}"


def push(cluster: Cluster, seed: int, version: str, *, mode: str, transport: str, mb: float = MODEL_MB,
         wait: float = 120.0) -> tuple[dict, list[dict]]:
    """A push that must commit on both nodes, held to one owner per bucket and one copy on the
    wire; returns its answer and both servers' info afterwards."""
    before, links_before = infos(cluster), link_bytes(cluster)
    answer = cluster.trainer.call("push", seed=seed, version=version, mode=mode, transport=transport, mb=mb,
                                  wait=wait, expect=("pushed", "push_failed"))
    links_after = link_bytes(cluster)
    assert answer["event"] == "pushed", f"{answer.get('code')} {answer.get('reason')}: {answer.get('message')}"
    assert [s["version"] for s in answer["servers"]] == [version, version]
    after = infos(cluster)
    assert_one_owner_per_bucket(cluster, answer, before, after, transport)
    ratios = assert_one_copy_on_the_wire(answer, links_before, links_after)
    worst = MEASURED.setdefault(f"link bytes per pushed byte, largest ({transport})", {})
    for where, ratio in ratios.items():
        worst[where] = max(worst.get(where, 0.0), ratio)
    return answer, after


def established(cluster: Cluster, role: str) -> list[tuple[str, int, str, int, str]]:
    return [s for s in cluster.mesh.tcp_sockets(role) if s[4] == "ESTABLISHED"]


def wait_reachable(cluster: Cluster, attempts: int = 20) -> int:
    """Ask both servers until both answer (a channel may need one failed call to reconnect after
    a link flap); returns how many calls failed first."""
    for failed in range(attempts):
        if cluster.trainer.call("groups", expect=("groups", "error"))["event"] == "groups":
            return failed
        time.sleep(0.5)
    raise AssertionError(f"a server was still unreachable {attempts} calls after the link came back")


def wait_settled(cluster: Cluster, deadline: float) -> float:
    """Until neither store is UPDATING (a node cut off mid-update ends it by its own timeout:
    nothing else tells it that the trainer gave up), by `deadline` (monotonic); returns when."""
    while True:
        states = {s["address"]: s["store"]["state"] for s in infos(cluster)}
        if "STORE_STATE_UPDATING" not in states.values():
            return time.monotonic()
        assert time.monotonic() < deadline, f"still in the aborted update: {states}"
        time.sleep(0.25)


def cut_mid_push(cluster: Cluster, seed: int, version: str, *, mode: str, transport: str,
                 rpc_timeout: float | None = None, wait: float = GROUP_TIMEOUT + RPC_TIMEOUT + 60,
                 ) -> tuple[dict, float, float]:
    """Push, pause after bucket 1 is on its way, pull node-b's cable, go on; put the cable back once the
    push answered. Returns its answer, when the cut was (monotonic) and the seconds from it to the answer."""
    trainer = cluster.trainer
    trainer.send("push", seed=seed, version=version, mode=mode, transport=transport, mb=MODEL_MB,
                 pause_at=CUT_AT_BUCKET, rpc_timeout=rpc_timeout)
    paused = trainer.expect("paused", wait=60)
    assert paused["bucket"] == CUT_AT_BUCKET and paused["bucket_count"] > 10, paused
    time.sleep(SETTLE_BEFORE_CUT)
    cluster.mesh.cut("node-b")
    cut_at = time.monotonic()
    try:
        trainer.send("continue")
        answer = trainer.expect("push_failed", "pushed", wait=wait)
        elapsed = time.monotonic() - cut_at
    finally:
        cluster.mesh.restore("node-b")
    print(f"{transport} {mode}: push answered {answer['event']} after {elapsed:.2f} s: code={answer.get('code')} "
          f"reason={answer.get('reason')} server={answer.get('server')}: {answer.get('message')}")
    return answer, cut_at, elapsed


@pytest.fixture
def impaired(cluster):
    """5 ms one-way delay and 0.1% loss on every link, for one test."""
    method = cluster.mesh.impair(delay_ms=5, loss_pct=0.1)
    MEASURED["impairment method"] = method
    yield method
    cluster.mesh.clear_impairment()
    if method == "userspace":
        MEASURED.setdefault("userspace link emulator stats", []).append(cluster.mesh.emulator_stats)


# -- 1. the happy path, COLLECTIVE ----------------------------------------------------------------
def test_push_across_hosts_with_mtls(cluster):
    # Across hosts: TRANSPORT_COLLECTIVE over Gloo, the CPU backend (here), and INLINE (test 2).
    # SHM is offered too, to trainers on the server's own host. NCCL needs a GPU per rank (5 here).
    backend = "gloo"
    trainer_ip = cluster.mesh.host("trainer").ip
    node_ips = {cluster.mesh.host(role).ip for role in NODES}
    mesh_ips = node_ips | {trainer_ip}

    # Every server speaks mTLS at its own address; a client without a certificate is refused.
    # The cluster is fresh: an empty store, nothing received yet.
    for server in infos(cluster):
        assert {"TRANSPORT_COLLECTIVE", "TRANSPORT_INLINE"} <= set(server["transports"]), server
        assert f"BACKEND_{backend.upper()}" in server["backends"], server
        assert [w["state"] for w in server["workers"]] == ["WORKER_STATE_RUNNING"] * WORKERS, server
        assert server["store"] == {"present": True, "state": "STORE_STATE_EMPTY", "tensor_count": 0,
                                   "live_bytes": 0, "held_bytes": 0}, server
        assert [w["received_bytes"] for w in server["workers"]] == [0] * WORKERS, server
    refused = cluster.trainer.call("probe_without_client_cert")["codes"]
    assert set(refused.values()) == {"UNAVAILABLE"}, refused

    started = time.monotonic()
    group = cluster.trainer.call("create_group", timeout=GROUP_TIMEOUT)
    MEASURED["create_group across hosts, s"] = round(time.monotonic() - started, 3)
    try:
        # The rendezvous store is on the trainer's routable address, never loopback...
        assert group["store_host"] == trainer_ip != LOOPBACK, group
        store = (trainer_ip, group["store_port"])
        for role in NODES:  # ...every worker was told so, and is connected to it from its own address
            joins = [line for line in cluster.servers[role].log().splitlines()
                     if '"group_joining"' in line and group["group_id"] in line]
            assert len(joins) == WORKERS and all(f'"store": "{trainer_ip}:{group["store_port"]}"' in j
                                                 for j in joins), joins
            own = cluster.mesh.host(role).ip
            to_store = [s for s in established(cluster, role) if (s[2], s[3]) == store]
            assert len(to_store) >= WORKERS and {s[0] for s in to_store} == {own}, to_store
        # Ranks: the trainer 0, node-a's workers 1-2, node-b's 3-4 (the SDK sends to owners by rank).
        assert owner_rank_offsets(cluster, group["group_id"]) == [1, 1 + WORKERS]

        # The collective binds the mesh interface everywhere (not the decoy eth1, not loopback):
        # Gloo listens on each host's mesh address, and the full mesh of connections runs between
        # mesh addresses, node-a <-> node-b included.
        for role in cluster.mesh.hosts:
            own = cluster.mesh.host(role).ip
            sockets = cluster.mesh.tcp_sockets(role)
            assert not [s for s in sockets if LOOPBACK in (s[0], s[2]) and s[4] != "LISTEN"], sockets
            assert not [s for s in sockets if s[4] == "ESTABLISHED" and not {s[0], s[2]} <= mesh_ips], sockets
            gloo_listeners = [s for s in sockets if s[4] == "LISTEN" and s[0] == own and s[1] != SERVER_PORT]
            assert gloo_listeners, sockets
        b_ip = cluster.mesh.host("node-b").ip
        assert [s for s in established(cluster, "node-a") if s[2] == b_ip], "no Gloo connection node-a <-> node-b"

        timings = {}
        # A dense IN_PLACE push into the empty store: one copy of the model per node.
        answer, info = push(cluster, 1, "v1", mode="in_place", transport="collective")
        timings["in_place"] = answer["seconds"]
        assert answer["buckets"] >= 2 * WORKERS, answer
        exact(cluster, 1, "v1")
        generation = assert_serving(cluster, "v1")[0]["generation"]
        assert_held(info, answer, copies=(1,))
        # STAGED: the new bytes go to a shadow of every segment, swapped live at commit: two copies.
        answer, info = push(cluster, 2, "v2", mode="staged", transport="collective")
        timings["staged"] = answer["seconds"]
        exact(cluster, 2, "v2")
        assert_serving(cluster, "v2", generation + 1)
        assert_held(info, answer, copies=(2,))
        MEASURED[f"push {answer['bytes'] / 1e6:.1f} MB to 2 hosts x 2 workers ({backend}), s"] = timings
        MEASURED["store after STAGED (live, held bytes)"] = [info[0]["store"]["live_bytes"],
                                                             info[0]["store"]["held_bytes"]]
    finally:
        cluster.trainer.call("delete_group")


# -- 2. the happy path, INLINE ----------------------------------------------------------------------
def test_inline_push_across_hosts_with_mtls(cluster):
    # No transfer group: the bytes travel inside each server's UpdateWeights stream (mTLS).
    assert cluster.trainer.call("groups")["groups"] == {a: [] for a in node_addresses(cluster)}
    timings = {}
    # IN_PLACE: one copy, or two if an earlier STAGED push made the shadow (kept for the next one).
    answer, info = push(cluster, 3, "v3", mode="in_place", transport="inline")
    timings["in_place"] = answer["seconds"]
    assert answer["buckets"] >= 2 * WORKERS, answer
    exact(cluster, 3, "v3")
    generation = assert_serving(cluster, "v3")[0]["generation"]
    assert_held(info, answer, copies=(1, 2))
    answer, info = push(cluster, 4, "v4", mode="staged", transport="inline")
    timings["staged"] = answer["seconds"]
    exact(cluster, 4, "v4")
    assert_serving(cluster, "v4", generation + 1)
    assert_held(info, answer, copies=(2,))
    MEASURED[f"push {answer['bytes'] / 1e6:.1f} MB to 2 hosts x 2 workers (inline), s"] = timings


# -- 3. 5 ms delay + 0.1% loss ----------------------------------------------------------------
@pytest.mark.parametrize("transport", ["collective", "inline"])
def test_update_completes_with_delay_and_loss(cluster, impaired, request, transport):
    if transport == "collective":
        request.getfixturevalue("group")
    rtt = cluster.trainer.call("rtt", count=5)["ms"]
    MEASURED["TCP connect round trip under impairment, ms"] = rtt
    assert all(ms >= 8.0 for ms in rtt.values()), f"the {impaired} impairment is not in the path: {rtt}"

    answer, _ = push(cluster, 13, "v13", mode="staged", transport=transport)
    exact(cluster, 13, "v13")
    generation = assert_serving(cluster, "v13")[0]["generation"]
    answer_in_place, _ = push(cluster, 14, "v14", mode="in_place", transport=transport)
    exact(cluster, 14, "v14")
    assert_serving(cluster, "v14", generation + 1)
    MEASURED[f"push {answer['bytes'] / 1e6:.1f} MB with 5 ms + 0.1% loss ({impaired}, {transport}), s"] = {
        "staged": answer["seconds"], "in_place": answer_in_place["seconds"]}


# -- 4. a link cut mid-update --------------------------------------------------------------------
# What the SDK says when node-b's link is cut, and by when (from the cut), per transport:
CUT_FAILURE = {
    # Gloo sends to node-b's owner stall; the group timeout fails the push, naming the node whose
    # stream is gone (the healthy one only saw the collective break).
    "collective": (("UNAVAILABLE", "SERVER_UNREACHABLE"), GROUP_TIMEOUT),
    # node-b's stream takes no more bytes; the SDK gives up after its per-RPC timeout.
    "inline": (("DEADLINE_EXCEEDED", "SERVER_UNRESPONSIVE"), RPC_TIMEOUT),
}
INLINE_CUT_LOST = ("UNAVAILABLE", "SERVER_UNREACHABLE")
"""INLINE, the other of two equal timers: the kernel gives up on the unacknowledged bytes after the
channel's keepalive timeout (gRPC sets TCP_USER_TIMEOUT to it; client/channels/server_set.py makes it the client
timeout), the same moment the SDK's own give-up comes due. Under load either fires first (a fresh-clone
CI run saw this one); both name node-b, at the same bound."""


@pytest.mark.parametrize("mode", ["staged", "in_place"])
@pytest.mark.parametrize("transport", ["collective", "inline"])
def test_link_cut_mid_update(cluster, impaired, request, transport, mode):
    trainer = cluster.trainer
    if transport == "collective":
        request.getfixturevalue("group")
    seed = {("collective", "staged"): 20, ("collective", "in_place"): 30,
            ("inline", "staged"): 40, ("inline", "in_place"): 50}[transport, mode]
    old, after = f"old-{seed}", f"after-{seed}"
    push(cluster, seed, old, mode="staged", transport=transport)
    exact(cluster, seed, old)
    old_generation = assert_serving(cluster, old)[0]["generation"]

    failed, cut_at, elapsed = cut_mid_push(cluster, seed + 1, f"new-{seed}", mode=mode, transport=transport)
    label = f"{transport} {mode}"
    MEASURED.setdefault("link cut -> UpdateFailed, s", {})[label] = round(elapsed, 2)
    MEASURED.setdefault("link cut status", {})[label] = (f"{failed.get('code')} {failed.get('reason')} "
                                                         f"(server named: {failed.get('server')})")
    assert failed["event"] == "push_failed", f"the update survived a cut link: {failed}"
    assert failed["type"] == "UpdateFailed"
    status, bound = CUT_FAILURE[transport]
    # The cut-off node is named, with a status that says so.
    named = (failed["code"], failed["reason"], failed["server"])
    node_b = f"{cluster.mesh.host('node-b').ip}:{SERVER_PORT}"
    assert named == (*status, node_b) or (transport == "inline" and named == (*INLINE_CUT_LOST, node_b)), failed
    # At the timeout, plus the SDK's grace for the servers to answer the abort (4 s).
    assert elapsed <= bound + 4.0 + MARGIN, failed

    # The link is back. A COLLECTIVE group is broken: delete it once the servers answer again.
    reconnect_failures = wait_reachable(cluster)
    MEASURED.setdefault("calls failing UNAVAILABLE after the link returned", {})[label] = reconnect_failures
    if transport == "collective":
        trainer.call("delete_group")
    # node-b ended its part of the update by its own timeout, while cut off or soon after: the
    # group's (COLLECTIVE), or the transfer timeout counted from its last bucket (INLINE).
    settled = wait_settled(cluster, cut_at + (GROUP_TIMEOUT if transport == "collective" else TRANSFER_TIMEOUT) + MARGIN)
    MEASURED.setdefault("link cut -> both stores out of the update, s", {})[label] = round(settled - cut_at, 2)

    if mode == "staged":
        # STAGED: the old version, bit for bit, on both nodes (node-a got every bucket it was sent).
        assert_serving(cluster, old, old_generation)
        exact(cluster, seed, old)
    else:
        # IN_PLACE: both nodes had bytes of the new version written into their store: INCONSISTENT,
        # still naming the last version they committed; the workers are fine.
        for server in infos(cluster):
            assert (server["store_state"], server["store"]["state"]) == ("STORE_STATE_INCONSISTENT",) * 2, server
            assert (server["version"], server["generation"]) == (old, old_generation), server
            assert [w["state"] for w in server["workers"]] == ["WORKER_STATE_RUNNING"] * WORKERS, server

    # No group is left behind on either server.
    assert trainer.call("groups")["groups"] == {a: [] for a in node_addresses(cluster)}

    # The next update succeeds on both nodes, exactly (COLLECTIVE: on a new group).
    if transport == "collective":
        trainer.call("create_group", timeout=GROUP_TIMEOUT)
    push(cluster, seed + 2, after, mode=mode, transport=transport)
    exact(cluster, seed + 2, after)
    assert_serving(cluster, after, old_generation + 1)


def test_inline_cut_names_the_silent_node(cluster, impaired):
    """INLINE, node-b cut off, from a client whose timeout (15 s) is longer than the servers'
    transfer timeout (10 s) -- as a client with the default 60 s is against servers run with
    --transfer-timeout-seconds under ~20 s (its keepalive notices a dead link after ~20 s).

    The SDK sends each chunk to node-a, then node-b, in turn (client/transports/inline.py InlineSink.send):
    once node-b takes nothing more, the SDK waits on it, so node-a gets nothing either and, at
    its transfer timeout, aborts the update DEADLINE_EXCEEDED CLIENT_IDLE, before the SDK gives up
    on node-b. That CLIENT_IDLE is a symptom of the cut, like a broken broadcast on the healthy
    node: the push must still fail naming node-b (DEADLINE_EXCEEDED SERVER_UNRESPONSIVE, as with
    a shorter client timeout, or UNAVAILABLE SERVER_UNREACHABLE, as over COLLECTIVE), not node-a."""
    client_timeout = TRANSFER_TIMEOUT + 5.0
    node_b = f"{cluster.mesh.host('node-b').ip}:{SERVER_PORT}"
    push(cluster, 60, "old-60", mode="staged", transport="inline")
    old_generation = assert_serving(cluster, "old-60")[0]["generation"]

    failed, cut_at, elapsed = cut_mid_push(cluster, 61, "new-60", mode="staged", transport="inline",
                                           rpc_timeout=client_timeout, wait=client_timeout + 60)
    named = (failed.get("code"), failed.get("reason"), failed.get("server"))
    MEASURED["inline cut, client timeout > transfer timeout: status, s"] = [
        f"{named[0]} {named[1]} (server named: {named[2]})", round(elapsed, 2)]
    assert failed["event"] == "push_failed" and failed["type"] == "UpdateFailed", failed
    assert elapsed <= client_timeout + 4.0 + MARGIN, failed

    # Whatever it said, the update is over on both nodes, STAGED kept the old version, and the
    # next push is fine.
    wait_reachable(cluster)
    wait_settled(cluster, cut_at + TRANSFER_TIMEOUT + MARGIN)
    assert_serving(cluster, "old-60", old_generation)
    exact(cluster, 60, "old-60")
    push(cluster, 62, "after-60", mode="staged", transport="inline")
    exact(cluster, 62, "after-60")
    assert_serving(cluster, "after-60", old_generation + 1)

    # node-b named, as the SDK names a node it gave up on (its own wait), or one cut off mid-broadcast.
    assert named in {("DEADLINE_EXCEEDED", "SERVER_UNRESPONSIVE", node_b), ("UNAVAILABLE", "SERVER_UNREACHABLE", node_b)}, (
        f"client/channels/streams.py update_failed/_root_cause: node-b's link was cut, yet the push "
        f"failed naming {named[2]} with {named[0]} {named[1]}: {failed.get('message')}. The healthy node's "
        f"CLIENT_IDLE is a symptom of the SDK waiting on the silent node-b (stream.unresponsive) and must not be "
        f"taken for the cause.")
