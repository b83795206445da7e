"""Issue "Run it in a real mesh": multi-host operation, on one machine, with network namespaces.

Three namespaces on one bridge (netns.py): the trainer at 10.231.0.1, node-a at .2, node-b at
.3, each with a decoy second interface. A 2-worker CPU server runs in each node namespace,
bound to its own address, with mTLS (server certificates carry the node IP as their only SAN).
The trainer (trainer.py, the SDK) runs in the trainer namespace and is driven over stdin; every
check of the servers goes through it, over mTLS, since this process (root namespace) cannot
reach the mesh.

  1. the happy path: the TCPStore sits on the trainer's mesh address, the collective binds the
     mesh interface on every host, STAGED and IN_PLACE pushes verify on both nodes;
  2. 5 ms delay + 0.1% loss on every link: the update completes and verifies;
  3. node-b's link cut mid-update: the push fails with a clear status, STAGED keeps the old
     version on both nodes, and after the link returns the next update succeeds.
"""

from __future__ import annotations

import time

import pytest
from meshkit import GROUP_TIMEOUT, MARGIN, MEASURED, NODES, RPC_TIMEOUT, SERVER_PORT, Cluster

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(300)]

# One model (the set of tensor names is fixed after the first push; a server refuses new ones).
# 24 x 1 MB buckets: a cut after bucket 1 leaves far more to send than the socket buffers hold.
MODEL_MB = 24
CUT_AT_BUCKET = 1
LOOPBACK = "127.0.0.1"


# -- helpers ------------------------------------------------------------------------------------
def node_addresses(cluster: Cluster) -> list[str]:
    return [f"{cluster.mesh.host(role).ip}:{SERVER_PORT}" for role in NODES]


def assert_serving(cluster: Cluster, version: str, generation: int | None = None) -> list[dict]:
    """Both servers: store CONSISTENT on every worker, `version` live (same generation on both)."""
    info = cluster.trainer.call("info")["servers"]
    assert [s["address"] for s in info] == node_addresses(cluster)
    for server in info:
        assert server["store_state"] == "STORE_STATE_CONSISTENT", server
        assert server["version"] == version, server
        assert [w["store_state"] for w in server["workers"]] == ["STORE_STATE_CONSISTENT"] * 2, server
    generations = {s["generation"] for s in info}
    assert len(generations) == 1, info
    if generation is not None:
        assert generations == {generation}, info
    return info


def push(cluster: Cluster, seed: int, version: str, *, mode: str = "staged", mb: float = MODEL_MB,
         wait: float = 120.0) -> dict:
    answer = cluster.trainer.call("push", seed=seed, version=version, mode=mode, mb=mb, wait=wait,
                                  expect=("pushed", "push_failed"))
    assert answer["event"] == "pushed", f"{answer.get('code')} {answer.get('reason')}: {answer.get('message')}"
    assert [s["version"] for s in answer["servers"]] == [version, version]
    return answer


def verify(cluster: Cluster, seed: int, mb: float = MODEL_MB) -> None:
    answer = cluster.trainer.call("verify", seed=seed, mb=mb, wait=120)
    assert answer["ok"], answer["mismatches"]
    assert answer["checked"] > 0


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


@pytest.fixture
def impaired(cluster):
    """5 ms one-way delay and 0.1% loss on every link, for one test."""
    method = cluster.mesh.impair(delay_ms=5, loss_pct=0.1)
    MEASURED["impairment method"] = method
    yield method
    cluster.mesh.clear_impairment()
    if method == "userspace":
        MEASURED.setdefault("userspace link emulator stats", []).append(cluster.mesh.emulator_stats)


# -- 1. the happy path --------------------------------------------------------------------------
def test_push_across_hosts_with_mtls(cluster):
    # The transports that make sense across hosts: TRANSPORT_COLLECTIVE (the only one the server
    # offers; SHM is same-host by definition, INLINE answers UNIMPLEMENTED) over Gloo, the CPU
    # backend. NCCL needs a GPU per rank (5 here): not on this machine.
    backend = "gloo"
    trainer_ip = cluster.mesh.host("trainer").ip
    node_ips = {cluster.mesh.host(role).ip for role in NODES}
    mesh_ips = node_ips | {trainer_ip}

    # Every server speaks mTLS at its own address; a client without a certificate is refused.
    info = cluster.trainer.call("info")["servers"]
    for server in info:
        assert "TRANSPORT_COLLECTIVE" in server["transports"], server  # the one cross-host transport
        assert f"BACKEND_{backend.upper()}" in server["backends"], server
        assert [w["state"] for w in server["workers"]] == ["WORKER_STATE_RUNNING"] * 2, server
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
            assert len(joins) == 2 and all(f'"store": "{trainer_ip}:{group["store_port"]}"' in j for j in joins), joins
            own = cluster.mesh.host(role).ip
            to_store = [s for s in established(cluster, role) if (s[2], s[3]) == store]
            assert len(to_store) >= 2 and {s[0] for s in to_store} == {own}, to_store

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
        a_ip, b_ip = (cluster.mesh.host(role).ip for role in NODES)
        assert [s for s in established(cluster, "node-a") if s[2] == b_ip], "no Gloo connection node-a <-> node-b"

        timings = {}
        answer = push(cluster, 1, "v1", mode="staged")
        timings["staged"] = answer["seconds"]
        verify(cluster, 1)
        generation = assert_serving(cluster, "v1")[0]["generation"]
        answer = push(cluster, 2, "v2", mode="in_place")
        timings["in_place"] = answer["seconds"]
        verify(cluster, 2)
        assert_serving(cluster, "v2", generation + 1)
        MEASURED[f"push {answer['bytes'] / 1e6:.1f} MB to 2 hosts x 2 workers ({backend}), s"] = timings
    finally:
        cluster.trainer.call("delete_group")


# -- 2. 5 ms delay + 0.1% loss ----------------------------------------------------------------
def test_update_completes_with_delay_and_loss(cluster, impaired, group):
    rtt = cluster.trainer.call("rtt", count=5)["ms"]
    MEASURED["TCP connect round trip under impairment, ms"] = rtt
    assert all(ms >= 8.0 for ms in rtt.values()), f"the {impaired} impairment is not in the path: {rtt}"

    answer = push(cluster, 3, "v3", mode="staged")
    verify(cluster, 3)
    assert_serving(cluster, "v3")
    answer_in_place = push(cluster, 4, "v4", mode="in_place")
    verify(cluster, 4)
    assert_serving(cluster, "v4")
    MEASURED[f"push {answer['bytes'] / 1e6:.1f} MB with 5 ms + 0.1% loss ({impaired}), s"] = {
        "staged": answer["seconds"], "in_place": answer_in_place["seconds"]}


# -- 3. a link cut mid-update --------------------------------------------------------------------
def test_link_cut_mid_update(cluster, impaired, group):
    trainer = cluster.trainer
    push(cluster, 5, "old", mode="staged")
    verify(cluster, 5)
    old_generation = assert_serving(cluster, "old")[0]["generation"]

    # A STAGED update pauses after bucket 1 is on its way; node-b's cable is pulled; it goes on.
    trainer.send("push", seed=6, version="new", mode="staged", mb=MODEL_MB, pause_at=CUT_AT_BUCKET)
    paused = trainer.expect("paused", wait=60)
    assert paused["bucket"] == CUT_AT_BUCKET and paused["bucket_count"] > 10, paused
    cluster.mesh.cut("node-b")
    cut_at = time.monotonic()
    try:
        trainer.send("continue")
        failed = trainer.expect("push_failed", "pushed", wait=GROUP_TIMEOUT + RPC_TIMEOUT + 60)
        elapsed = time.monotonic() - cut_at
    finally:
        cluster.mesh.restore("node-b")
    print(f"push failed after {elapsed:.2f} s: code={failed.get('code')} reason={failed.get('reason')} "
          f"server={failed.get('server')}: {failed.get('message')}")
    MEASURED["link cut -> UpdateFailed, s"] = round(elapsed, 2)
    MEASURED["link cut status"] = f"{failed.get('code')} {failed.get('reason')} (server named: {failed.get('server')})"
    assert failed["event"] == "push_failed", f"the update survived a cut link: {failed}"
    assert failed["type"] == "UpdateFailed"
    # The cut-off node is named, with a status that says so: the healthy one only saw the broadcast break.
    assert (failed["code"], failed["reason"]) == ("UNAVAILABLE", "SERVER_UNREACHABLE"), failed
    assert failed["server"] == f"{cluster.mesh.host('node-b').ip}:{SERVER_PORT}", failed
    # At the group timeout, plus the SDK's grace for the servers to answer the abort (4 s).
    assert elapsed <= GROUP_TIMEOUT + 4.0 + MARGIN, failed

    # The link is back. The SDK's group is broken: delete it once the servers answer again.
    reconnect_failures = wait_reachable(cluster)
    MEASURED["calls failing UNAVAILABLE after the link returned"] = reconnect_failures
    trainer.call("delete_group")

    # STAGED: the old version, bit for bit, on both nodes (node-a got every bucket it was sent).
    assert_serving(cluster, "old", old_generation)
    verify(cluster, 5)

    # No group is left behind on either server.
    assert trainer.call("groups")["groups"] == {a: [] for a in node_addresses(cluster)}

    # The next update, on a new group, succeeds on both nodes.
    trainer.call("create_group", timeout=GROUP_TIMEOUT)
    push(cluster, 7, "after-cut", mode="staged")
    verify(cluster, 7)
    assert_serving(cluster, "after-cut", old_generation + 1)
