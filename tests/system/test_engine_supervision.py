"""Background tasks are supervised: the vLLM driver survives any answer, and cleanups never mask.

A real server drives a fake vLLM (tests/fake_vllm.py) whose answers are scripted: a 200 that is
not JSON, `[]`, garbage bytes. Each is a typed failure in GetServerInfo.engines, retried with
backoff, and the next commit is still driven until vLLM serves the node's version; SIGTERM then
exits 0 and removes the local socket file. A refused apply is typed and the next commit is served,
with no /pause or /resume around it (vLLM runs each call between its steps). On the engine side (vllm_backend.py, with vLLM's modules faked) a failing
finalize does not hide the load error either, and releases come after the GPU copies.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import types
from types import SimpleNamespace
from typing import Generic, TypeVar

import pytest
import torch
from fake_vllm import FakeVllm

from weightsync.engine.client import StoreSnapshot, devices_to_synchronize
from weightsync.server.engines import driver as engine_driver
from weightsync.server.engines.driver import EngineAnswerMalformed, parse_answer
from weightsync.server.engines.vllm import VllmHttpDriver
from weightsync.server.published.engine_registry import EngineRegistry
from weightsync.server.published.publisher import Watchers
from weightsync.server.store.version import PublishedVersion
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import sdk_client, start_server, wait_for

pytestmark = pytest.mark.timeout(240)
MALFORMED = [(200, b"this is not json"), (200, b"[]"), (200, b"\xff\xfe\x00\x9c garbage \x80\x81")]


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(32, 8, generator=generator), "b": torch.randn(8, generator=generator)}


def driven(server) -> pb.EngineStatus:
    info = server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    return {e.name: e for e in info.engines}["vllm-http"]


@pytest.fixture
def fake():
    engine = FakeVllm()
    yield engine
    engine.close()


def test_malformed_answers_are_typed_failures_and_the_next_version_is_still_driven(tmp_path, fake):
    fake.script["GET /weight_info"] = list(MALFORMED)
    server = start_server(tmp_path, "--engine", f"vllm-http={fake.url}", workers=1)
    try:
        socket_path = server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).local_socket
        assert os.path.exists(socket_path)
        with sdk_client(server) as trainer:
            trainer.push(weights(1), version="v1", transport="inline", allow_new_tensors=True)
            wait_for(lambda: driven(server).state == pb.ENGINE_STATE_FAILED)
            assert driven(server).last_error.startswith("ENGINE_ANSWER_MALFORMED: GET /weight_info: not JSON")
            trainer.push(weights(2), version="v2", transport="inline")
            trainer.push(weights(3), version="v3", transport="inline")
            # Every scripted answer was a failure; after them vLLM answers well, and serves v3: at once
            # on a commit, or on the retry (5 s after a failure).
            wait_for(lambda: (e := driven(server)).state == pb.ENGINE_STATE_SERVING
                     and e.applied_version.version == "v3", timeout=90)
        node = server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).current_version
        assert (driven(server).applied_version.generation, node.version) == (node.generation, "v3")
        assert all(torch.equal(fake.weights[k], v) for k, v in weights(3).items())
        assert fake.script["GET /weight_info"] == []
        failures = [line for line in server.log().splitlines() if "engine_apply_failed" in line]
        assert len(failures) == 3 and all("ENGINE_ANSWER_MALFORMED" in line for line in failures), failures
        assert [("not JSON" in f, "got list" in f) for f in failures] == [(True, False), (False, True), (True, False)]
    finally:
        code = server.stop()
    assert code == 0, server.log()[-3000:]
    assert not os.path.exists(socket_path), "the local socket file was left behind"
    assert "Traceback" not in server.log()


def test_a_refused_apply_is_typed_and_the_next_commit_is_served_without_pause_or_resume(tmp_path, fake):
    fake.script["POST /update_weights"] = [(200, b"{}"), (500, b'{"error": "LOAD_FAILED: the checkpoint broke"}')]
    server = start_server(tmp_path, "--engine", f"vllm-http={fake.url}", workers=1)
    try:
        with sdk_client(server) as trainer:
            trainer.push(weights(1), version="v1", transport="inline", allow_new_tensors=True)
            wait_for(lambda: driven(server).state == pb.ENGINE_STATE_FAILED)
            error = driven(server).last_error
            assert error == 'ENGINE_REFUSED: POST /update_weights: HTTP 500: {"error": "LOAD_FAILED: the checkpoint broke"}'
            trainer.push(weights(2), version="v2", transport="inline")  # the next commit is served
            wait_for(lambda: (e := driven(server)).state == pb.ENGINE_STATE_SERVING
                     and e.applied_version.version == "v2", timeout=60)
        assert all(torch.equal(fake.weights[k], v) for k, v in weights(2).items())
        calls = [c for c in fake.calls if c.startswith("POST")]
        assert not [c for c in calls if "/pause" in c or "/resume" in c], calls
        assert calls[-4:] == ["POST /start_weight_update", "POST /update_weights", "POST /update_weights",
                              "POST /finish_weight_update"], calls
    finally:
        code = server.stop()
    assert code == 0, server.log()[-3000:]


# -- local engines: an applied=False release leaves APPLYING ---------------------------------------------------
def test_an_engine_that_applies_nothing_returns_to_its_state():
    registry = EngineRegistry()
    registry.register("e", "local", "worker:0")
    registry.applying("e")
    registry.not_applied("e")
    assert registry.records["e"].state == pb.ENGINE_STATE_UNSPECIFIED
    registry.failed("e", "TENSOR_MISMATCH: x")
    registry.applying("e")
    registry.not_applied("e")
    assert (registry.records["e"].state, registry.records["e"].last_error) == (pb.ENGINE_STATE_FAILED,
                                                                              "TENSOR_MISMATCH: x")


# -- the engine side: release after the copies --------------------------------------------------------------------
class _RecordingClient:
    def __init__(self, order: list[str]) -> None:
        self.order = order
        self.released: list[tuple[int, bool, str]] = []

    def _release(self, lease_id: int, *, applied: bool, error: str) -> None:
        self.order.append("release")
        self.released.append((lease_id, applied, error))


def _snapshot(client, devices) -> StoreSnapshot:
    return StoreSnapshot(client, 7, pb.WeightVersion(version="v", generation=3), {}, {}, devices=frozenset(devices))


def test_release_waits_for_the_copies_on_the_store_gpus_first(monkeypatch):
    order: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: order.append(f"synchronize {device}"))
    client = _RecordingClient(order)
    _snapshot(client, [torch.device("cuda", 1), torch.device("cuda", 0)]).release(applied=True)
    assert order == ["synchronize cuda:0", "synchronize cuda:1", "release"]
    assert client.released == [(7, True, "")]
    order.clear()
    _snapshot(client, [torch.device("cpu")]).release(applied=True)  # host memory is read synchronously
    assert order == ["release"]
    assert devices_to_synchronize([torch.device("cpu"), torch.device("cuda", 2)]) == [torch.device("cuda", 2)]


def test_a_failing_device_sync_still_releases_saying_so(monkeypatch):
    def broken(device=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", broken)
    client = _RecordingClient([])
    _snapshot(client, [torch.device("cuda", 0)]).release(applied=True)
    (lease, applied, error), = client.released
    assert (lease, applied) == (7, False) and error.startswith("DEVICE_SYNC_FAILED: RuntimeError: CUDA error")


# -- vllm_backend: cleanup errors never mask the load's own -----------------------------------------------------
A = TypeVar("A")
B = TypeVar("B")


@pytest.fixture
def backend(monkeypatch):
    """weightsync.engine.vllm_backend imported against stand-ins of the vLLM modules it uses."""
    calls: list[str] = []

    class WeightTransferEngine(Generic[A, B]):
        def __init__(self, config, vllm_config, device, model) -> None:
            self.model, self.device = model, device

    class Info:
        pass

    def finalize(model, model_config) -> None:
        calls.append("finalize")
        raise RuntimeError("finalize broke")

    modules = {
        "vllm": {}, "vllm.distributed": {}, "vllm.distributed.weight_transfer": {},
        "vllm.distributed.weight_transfer.base": {"WeightTransferEngine": WeightTransferEngine,
                                                  "WeightTransferInitInfo": Info, "WeightTransferUpdateInfo": Info},
        "vllm.logger": {"init_logger": logging.getLogger},
        "vllm.model_executor": {}, "vllm.model_executor.model_loader": {},
        "vllm.model_executor.model_loader.reload": {
            "initialize_layerwise_reload": lambda model: calls.append("initialize"),
            "finalize_layerwise_reload": finalize},
        "vllm.model_executor.model_loader.reload.layerwise": {"LAYERWISE_INFO": {}},
        "vllm.model_executor.layers": {}, "vllm.model_executor.layers.attention": {
            "is_deferred_attention_layer": lambda module: False},
    }
    for name, attributes in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "weightsync.engine.vllm_backend", raising=False)
    import weightsync.engine.vllm_backend as vllm_backend

    yield vllm_backend, calls
    sys.modules.pop("weightsync.engine.vllm_backend", None)


def test_a_failing_finalize_does_not_hide_the_load_error(backend):
    vllm_backend, calls = backend

    class Model(torch.nn.Module):
        def load_weights(self, weights) -> None:
            for _ in weights:
                raise ValueError("load broke on the first tensor")

    engine = object.__new__(vllm_backend.WeightSyncEngine)
    engine.model, engine.model_config = Model(), None
    snapshot = _snapshot(_RecordingClient([]), [])
    snapshot.tensors["w"] = torch.zeros(2)
    with pytest.raises(ValueError, match="load broke on the first tensor") as caught:
        engine._load(snapshot, ["w"], vllm_backend.ApplyStats())
    assert calls == ["initialize", "finalize"]
    assert caught.value.__notes__ == ["restoring the layers failed too: RuntimeError('finalize broke')"]
    assert snapshot.applied is False


# -- the driver loop itself --------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, message", [
    (b"not json", "not JSON"), (b"[]", "expected a JSON object, got list"), (b"\xff\x80", "not JSON"),
    (b"42", "expected a JSON object, got int"), (b'"text"', "expected a JSON object, got str"),
])
def test_every_answer_but_a_json_object_is_malformed(raw, message):
    with pytest.raises(EngineAnswerMalformed, match=message) as caught:
        parse_answer("GET", "/weight_info", raw)
    assert str(caught.value).startswith("ENGINE_ANSWER_MALFORMED: GET /weight_info: ")
    assert parse_answer("GET", "/weight_info", b' {"weight_version": "v1"} ') == {"weight_version": "v1"}
    assert parse_answer("POST", "/resume", b"") == {}


def started_driver() -> tuple[EngineRegistry, SimpleNamespace, VllmHttpDriver]:
    """A vLLM driver on a stand-in publisher at generation 7, started (call inside the event loop)."""
    registry = EngineRegistry()
    publisher = SimpleNamespace(watchers=Watchers(), version=PublishedVersion(7))
    driver = VllmHttpDriver("vllm-http", "http://127.0.0.1:9", publisher, registry, "/x.sock",
                                          SimpleNamespace(token="", reloads=0))
    driver.start()
    return registry, publisher, driver


def test_the_driver_loop_survives_an_unexpected_error_and_stops_cleanly(monkeypatch):
    monkeypatch.setattr(engine_driver, "LOOP_RETRY_SECONDS", (0.0,))
    monkeypatch.setattr(engine_driver, "POLL_SECONDS", 0.01)
    calls: list[int] = []

    async def converge(self) -> int:
        calls.append(len(calls))
        if len(calls) == 1:
            raise KeyError("a bug in the driver")
        return self.publisher.version.generation

    monkeypatch.setattr(VllmHttpDriver, "_converge", converge)

    async def scenario() -> None:
        registry, publisher, driver = started_driver()
        while len(calls) < 3:
            await asyncio.sleep(0.01)
        record = registry.records["vllm-http"]
        assert (record.state, record.last_error) == (pb.ENGINE_STATE_FAILED, "DRIVER_ERROR: KeyError('a bug in the driver')")
        await driver.stop()  # never raises
        assert publisher.watchers.queues == set()

    asyncio.run(scenario())


# -- a commit while vLLM applies is driven at once, not at the next poll ---------------------------------------
class ScriptedVllm:
    """The driver's _call, in process: /update_weights of `hold` waits for `release`, then answers
    `answer` (None: applied); every call is recorded."""

    def __init__(self, hold: int, answer: Exception | None = None) -> None:
        self.hold, self.answer = hold, answer
        self.held = asyncio.Event()
        self.release = asyncio.Event()
        self.updates: list[int] = []
        self.served: str | None = None

    async def call(self, method: str, path: str, body: dict | None = None) -> dict:
        if path == "/weight_info":
            return {"weight_version": self.served}
        if path == "/update_weights":
            generation = body["update_info"]["generation"]
            self.updates.append(generation)
            if generation == self.hold:
                self.held.set()
                await self.release.wait()
                if self.answer is not None:
                    raise self.answer
        if path == "/finish_weight_update":
            self.served = body["weight_version"]
        return {}


def commit(publisher: SimpleNamespace, label: str) -> None:
    publisher.version = PublishedVersion(7, label, publisher.version.generation + 1)
    publisher.watchers.publish(pb.WatchWeightsResponse(version=publisher.version.to_proto()))


@pytest.mark.parametrize("answer", [None, engine_driver.EngineRefused(
    "POST /update_weights: HTTP 500: VERSION_GONE: generation 1 is not held")], ids=["applied", "version-gone"])
def test_a_commit_while_vllm_applies_is_driven_at_once(monkeypatch, answer):
    """Generation 2 is committed while vLLM applies generation 1 (and then applies it, or finds it gone):
    the driver goes on to generation 2 without waiting for the poll (an hour here)."""
    monkeypatch.setattr(engine_driver, "POLL_SECONDS", 3600.0)
    vllm = ScriptedVllm(hold=1, answer=answer)

    async def call(self, method: str, path: str, body: dict | None = None) -> dict:
        return await vllm.call(method, path, body)

    monkeypatch.setattr(VllmHttpDriver, "_call", call)

    async def scenario() -> None:
        registry, publisher, driver = started_driver()
        commit(publisher, "v1")
        await asyncio.wait_for(vllm.held.wait(), 60)
        commit(publisher, "v2")
        vllm.release.set()
        while registry.records["vllm-http"].applied is None or registry.records["vllm-http"].applied.generation < 2:
            await asyncio.sleep(0.01)
        assert (vllm.updates, vllm.served) == ([1, 2], "v2")
        assert registry.records["vllm-http"].state == pb.ENGINE_STATE_SERVING
        await driver.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))
