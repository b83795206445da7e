"""Operating a node: metrics, the plaintext health port, trace context, and
rotating the token and certificate (SIGHUP) without dropping a running update."""

from __future__ import annotations

import json
import re
import shutil
import signal
import ssl
import threading
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from weightsync.client import TlsConfig, UpdateFailed, WeightSyncClient, WeightSyncRpcError
from weightsync.engine import EngineClient, ModuleFollower
from weightsync.v1 import weight_sync_service_pb2 as pb
from weightsync.v1 import weight_sync_service_pb2_grpc as pb_grpc

from certs import make_pki
from helpers import start_server, wait_for
from models import mixed_model

pytestmark = pytest.mark.timeout(180)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


# -- metrics --------------------------------------------------------------------------------------------
def scrape(server) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.ready['metrics_port']}/metrics", timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("metrics"), "--metrics-listen", "127.0.0.1:0")
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def grew(before: dict[str, float], after: dict[str, float], sample: str) -> float:
    """How much a sample grew between two scrapes (absent: 0): the module's server is shared, so a
    test counts what it did, not what the tests before it did."""
    return after.get(sample, 0.0) - before.get(sample, 0.0)


def test_metrics_count_a_push_and_a_failure(observed):
    before = scrape(observed)
    model = mixed_model(1)
    with WeightSyncClient(observed.address) as client:
        result = client.push(model, version="m1", transport="inline", allow_new_tensors=True)
        client.create_group(timeout=30)
        bad = {**model, "layers.0.attn.q_proj.bias": torch.zeros(7)}
        with pytest.raises(UpdateFailed):
            client.push(bad, version="bad", mode="staged")
        after = scrape(observed)
    committed = '{mode="in_place",outcome="committed",transport="inline"}'
    assert grew(before, after, f"weightsync_update_duration_seconds_count{committed}") == 1
    assert grew(before, after, 'weightsync_update_bytes_sum{mode="in_place",transport="inline"}') == result.size_bytes
    assert grew(before, after, 'weightsync_buckets_applied_total{transport="inline"}') == result.bucket_count
    assert grew(before, after, 'weightsync_update_failures_total{code="INVALID_ARGUMENT",reason="TENSOR_SHAPE_MISMATCH"}') == 1
    failed = '{mode="staged",outcome="failed",transport="collective"}'
    assert grew(before, after, f"weightsync_update_duration_seconds_count{failed}") == 1
    assert grew(before, after, 'weightsync_rpcs_total{code="OK",method="UpdateWeights"}') == 1
    assert grew(before, after, 'weightsync_rpcs_total{code="INVALID_ARGUMENT",method="UpdateWeights"}') == 1
    assert grew(before, after, 'weightsync_rpcs_total{code="OK",method="CreateTransferGroup"}') == 1
    assert grew(before, after, "weightsync_committed_generation") == 1
    assert after['weightsync_store_state{state="consistent"}'] == 1
    assert after["weightsync_store_tensors"] == len(model)
    # Each bucket went to one worker of the node (its owner): together they received it once.
    received = sum(grew(before, after, f'weightsync_worker_received_bytes{{worker="{w}"}}') for w in (0, 1))
    assert received == result.size_bytes
    assert grew(before, after, 'weightsync_groups{state="ready"}') == 1  # the client's group, still open then


def test_metrics_show_engines_groups_and_restarts(observed):
    model = mixed_model(2)
    before = scrape(observed)
    with WeightSyncClient(observed.address) as client:
        client.push(model, version="m2", transport="inline")
        client.create_group(timeout=30)
        assert grew(before, scrape(observed), 'weightsync_groups{state="ready"}') == 1
    with EngineClient(server=observed.address, name="metered") as engine:
        net = torch.nn.Module()
        for name, tensor in model.items():
            net.register_buffer(name.replace(".", "_"), torch.zeros_like(tensor))
        ModuleFollower(engine, net, name_map={n: n.replace(".", "_") for n in model}).update()
        samples = scrape(observed)  # while the engine is connected: serving
        generation = samples["weightsync_committed_generation"]
        assert samples['weightsync_engine_applied_generation{engine="metered",kind="local",state="serving"}'] == generation
        assert samples['weightsync_engine_commit_to_serving_seconds{engine="metered"}'] > 0
    # Its last connection closed: unreachable, still at the generation it applied.
    unreachable = 'weightsync_engine_applied_generation{engine="metered",kind="local",state="unreachable"}'
    wait_for(lambda: scrape(observed).get(unreachable) == generation, timeout=10)
    victim = observed.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).workers[1].pid
    import os

    os.kill(victim, signal.SIGKILL)
    restarts = 'weightsync_worker_restarts_total{worker="1"}'
    wait_for(lambda: grew(before, scrape(observed), restarts) == 1, timeout=30)
    wait_for(lambda: scrape(observed)['weightsync_worker_up{device="cpu",worker="1"}'] == 1, timeout=60)


# -- trace context ---------------------------------------------------------------------------------------
def test_a_callers_traceparent_is_in_the_servers_log_lines(observed):
    stub = observed.stub()
    stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=(("traceparent", TRACEPARENT),), timeout=10)
    with WeightSyncClient(observed.address, metadata=[("traceparent", TRACEPARENT)]) as client:
        client.push(mixed_model(3), version="traced", transport="inline")
    lines = [json.loads(line) for line in observed.log().splitlines() if line.startswith("{")]
    traced = [line for line in lines if line.get("trace_id") == TRACE_ID]
    committed = [line for line in traced if line["event"] == "update_committed"]
    assert committed and committed[0]["update_id"] and committed[0]["parent_span_id"] == "00f067aa0ba902b7"
    stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=(("traceparent", "00-zz-bad-01"),), timeout=10)  # ignored


# -- the plaintext health port, and a rotation that drops nothing -----------------------------------------
@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    directory = tmp_path_factory.mktemp("secured")
    first, second = make_pki(directory / "first"), make_pki(directory / "second")
    live = directory / "live"
    live.mkdir()
    for name in ("server.pem", "server.key", "ca.pem"):
        shutil.copy(directory / "first" / name, live / name)
    (live / "token").write_text("token-one\n")
    server = start_server(directory, "--tls-cert", str(live / "server.pem"), "--tls-key", str(live / "server.key"),
                          "--token-file", str(live / "token"), "--health-listen", "127.0.0.1:0")
    yield server, live, first, second
    assert server.stop() == 0, server.log()[-3000:]


def health_status(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_probes_use_a_plaintext_health_port_while_the_service_speaks_tls(secured):
    server, *_ = secured
    assert health_status(server.ready["health_port"]) == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(f"127.0.0.1:{server.ready['health_port']}") as channel:
        with pytest.raises(grpc.RpcError) as caught:  # only health lives there
            pb_grpc.WeightSyncServiceStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with pytest.raises(grpc.RpcError):  # the service port is TLS only
        health_status(server.port)


def served_certificate(port: int) -> str:
    return ssl.get_server_certificate(("127.0.0.1", port))


def test_sighup_rotates_token_and_certificate_without_dropping_a_running_update(secured):
    server, live, first, second = secured
    model = mixed_model(4)
    with WeightSyncClient(server.address, token="token-one", tls=TlsConfig(ca_cert=first.ca_cert)) as client:
        client.push(model, version="before", transport="inline", allow_new_tensors=True, bucket_size_bytes=4096)
    assert re.sub(r"\s", "", served_certificate(server.port)) == re.sub(r"\s", "", open(first.server_cert).read())

    held, release, outcome = threading.Event(), threading.Event(), {}

    def slow_push() -> None:
        def hold(report) -> None:
            if report.bucket == 1:
                held.set()
                release.wait(30)

        with WeightSyncClient(server.address, token="token-one", tls=TlsConfig(ca_cert=first.ca_cert)) as c:
            outcome["result"] = c.push(mixed_model(5), version="during", transport="inline", bucket_size_bytes=4096,
                                       progress=hold)

    pusher = threading.Thread(target=slow_push)
    pusher.start()
    assert held.wait(30)
    for name in ("server.pem", "server.key", "ca.pem"):
        shutil.copy(second.ca_cert.replace("ca.pem", name), live / name)
    (live / "token").write_text("token-two\n")
    server.process.send_signal(signal.SIGHUP)
    wait_for(lambda: "credentials_reloaded" in server.log(), timeout=10)
    release.set()
    pusher.join(60)
    assert outcome["result"].servers[0].version == "during"  # the update on the old connection committed

    assert re.sub(r"\s", "", served_certificate(server.port)) == re.sub(r"\s", "", open(second.server_cert).read())
    with WeightSyncClient(server.address, token="token-one", tls=TlsConfig(ca_cert=second.ca_cert)) as old_token:
        with pytest.raises(WeightSyncRpcError) as caught:
            old_token.server_info()
        assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
    with WeightSyncClient(server.address, token="token-two", tls=TlsConfig(ca_cert=second.ca_cert)) as rotated:
        assert rotated.server_info()[0].current_version.version == "during"
        rotated.push(model, version="after", transport="inline", bucket_size_bytes=4096)
        assert rotated.verify(model).ok
    assert health_status(server.ready["health_port"]) == health_pb2.HealthCheckResponse.SERVING
    (live / "token").write_text("")  # a broken rotation is refused: the server keeps what it had
    server.process.send_signal(signal.SIGHUP)
    wait_for(lambda: "credentials_reload_failed" in server.log(), timeout=10)
    with WeightSyncClient(server.address, token="token-two", tls=TlsConfig(ca_cert=second.ca_cert)) as still:
        assert still.server_info()[0].current_version.version == "after"
