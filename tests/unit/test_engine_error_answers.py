"""An engine's error answer is read whole (up to ERROR_ANSWER_MAX_BYTES), not its first 1000 bytes: a large
tensor-parallel engine refuses with one outcome per rank, and the one that matters (VERSION_GONE, a rank's
TENSOR_MISMATCH) may come after the first kilobyte. The message stays readable: its head, and how much was
cut. A real HTTP server (tests/fake_vllm.py) gives the scripted answers; the drivers' own _http reads them."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from fake_vllm import FakeVllm

from weightsync.server.engines import driver as engine_driver
from weightsync.server.engines.driver import (
    ERROR_ANSWER_MAX_BYTES,
    ERROR_DETAIL_MAX_CHARS,
    EngineRefused,
)
from weightsync.server.engines.sglang import SglangHttpDriver
from weightsync.server.engines.vllm import VllmHttpDriver
from weightsync.server.published.engine_registry import EngineRegistry
from weightsync.server.published.publisher import Watchers
from weightsync.server.store.version import PublishedVersion
from weightsync.v1 import weight_sync_service_pb2 as pb

pytestmark = pytest.mark.timeout(60)
TP = 16


def refusal_of_every_rank(last: str) -> str:
    """What a TP=16 engine answers when every rank refused but the last differently: 2.3 KB."""
    ranks = [f"rank tp{r}/{TP} refused: TENSOR_MISMATCH: model.layers.{r}.mlp.down_proj.weight is bfloat16 "
             f"[4096, 14336] in the store, float16 [4096, 14336] in the model" for r in range(TP - 1)]
    return "; ".join([*ranks, f"rank tp{TP - 1}/{TP} refused: {last}"])


@pytest.fixture
def fake():
    engine = FakeVllm()
    yield engine
    engine.close()


def vllm_driver(url: str) -> VllmHttpDriver:
    return VllmHttpDriver("vllm-http", url, SimpleNamespace(), EngineRegistry(), "/x.sock",
                                        SimpleNamespace(token="", reloads=0), timeout_s=10.0)


def test_a_refusal_longer_than_a_kilobyte_is_read_whole_and_shown_cut_saying_how_much(fake):
    detail = refusal_of_every_rank("VERSION_GONE: generation 3 is not held")
    assert 2000 < len(detail) < ERROR_ANSWER_MAX_BYTES
    fake.script["POST /update_weights"] = [(500, detail.encode())]
    driver = vllm_driver(fake.url)
    with pytest.raises(EngineRefused) as caught:
        driver._http("POST", "/update_weights", {"update_info": {"generation": 3, "since_generation": -1}})
    assert caught.value.answer == detail  # all of it, the last rank's VERSION_GONE included
    cut = len(detail) - ERROR_DETAIL_MAX_CHARS
    assert str(caught.value) == (f"ENGINE_REFUSED: POST /update_weights: HTTP 500: {detail[:ERROR_DETAIL_MAX_CHARS]} "
                                 f"[{cut} more characters cut]")
    # the next call is answered normally
    assert driver._http("POST", "/start_weight_update", None) == {}
    assert fake.calls == ["POST /update_weights", "POST /start_weight_update"]


def test_a_short_refusal_is_shown_whole(fake):
    fake.script["POST /update_weights"] = [(400, b'{"error": "NOT_INITIALIZED"}')]
    driver = vllm_driver(fake.url)
    with pytest.raises(EngineRefused) as caught:
        driver._http("POST", "/update_weights", {})
    assert str(caught.value) == 'ENGINE_REFUSED: POST /update_weights: HTTP 400: {"error": "NOT_INITIALIZED"}'
    assert caught.value.answer == ""
    assert driver._http("POST", "/resume", None) == {}


def test_a_refusal_past_the_bound_is_cut_there_saying_of_how_many_bytes(fake):
    body = bytes(range(48, 58)) * 10_000  # 100 000 bytes of digits
    fake.script["POST /update_weights"] = [(500, body)]
    driver = vllm_driver(fake.url)
    with pytest.raises(EngineRefused) as caught:
        driver._http("POST", "/update_weights", {})
    assert caught.value.answer == (body[:ERROR_ANSWER_MAX_BYTES].decode()
                                   + f" [answer cut at {ERROR_ANSWER_MAX_BYTES} of 100000 bytes]")
    assert str(caught.value).endswith(f" [{len(caught.value.answer) - ERROR_DETAIL_MAX_CHARS} more characters cut]")
    assert driver._http("POST", "/resume", None) == {}


def test_sglangs_long_message_is_taken_out_of_its_json_whole(fake):
    """SGLang answers {"success": false, "message": ...}: cut at 1000 bytes it was no JSON, and showed raw."""
    message = refusal_of_every_rank("STORE_EMPTY: nothing committed yet")
    fake.script["POST /update_weights_from_tensor"] = [(400, json.dumps({"success": False,
                                                                         "message": message}).encode())]
    driver = SglangHttpDriver("sglang-http", fake.url, SimpleNamespace(), EngineRegistry(), timeout_s=10.0)
    with pytest.raises(EngineRefused) as caught:
        driver._http("POST", "/update_weights_from_tensor", {})
    assert caught.value.answer == message
    assert str(caught.value).startswith(f"ENGINE_REFUSED: POST /update_weights_from_tensor: HTTP 400: "
                                        f"{message[:ERROR_DETAIL_MAX_CHARS]} [")
    assert driver._http("POST", "/continue_generation", None) == {}


def test_a_version_gone_past_the_first_kilobyte_goes_on_to_the_newer_commit(fake, monkeypatch):
    """The last rank found generation 1 replaced: the driver goes on to generation 2 at once (no FAILED, no
    retry backoff), as it does for a short VERSION_GONE."""
    monkeypatch.setattr(engine_driver, "POLL_SECONDS", 3600.0)
    fake.script["POST /update_weights"] = [(500, refusal_of_every_rank(
        "VERSION_GONE: generation 1 is not held").encode())]
    failures: list[str] = []

    class Registry(EngineRegistry):
        def failed(self, name: str, error: str) -> None:
            failures.append(error)
            super().failed(name, error)

    registry = Registry()
    publisher = SimpleNamespace(watchers=Watchers(), version=PublishedVersion(7))
    driver = VllmHttpDriver("vllm-http", fake.url, publisher, registry, "/x.sock",
                                          SimpleNamespace(token="", reloads=0), timeout_s=10.0)
    updates: list[int] = []
    real_call = VllmHttpDriver._call

    async def call(self, method: str, path: str, body: dict | None = None) -> dict:
        if path == "/init_weight_transfer_engine":
            return {}  # no store here: the fake's attach is not what this test is about
        if path == "/update_weights":
            updates.append(body["update_info"]["generation"])
            if len(updates) == 1:
                commit(publisher, "v2")  # committed while the engine read generation 1
                return await real_call(self, method, path, body)  # the scripted refusal
            return {}
        return await real_call(self, method, path, body)

    monkeypatch.setattr(VllmHttpDriver, "_call", call)

    async def scenario() -> None:
        driver.start()
        commit(publisher, "v1")
        while (applied := registry.records["vllm-http"].applied) is None or applied.generation < 2:
            await asyncio.sleep(0.01)
        await driver.stop()

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert failures == []  # a newer commit, not a failure: no FAILED, no backoff, no engine_apply_failed
    assert updates == [1, 2] and fake.served == "v2"
    assert registry.records["vllm-http"].state == pb.ENGINE_STATE_SERVING


def commit(publisher: SimpleNamespace, label: str) -> None:
    publisher.version = PublishedVersion(7, label, publisher.version.generation + 1)
    publisher.watchers.publish(pb.WatchWeightsResponse(version=publisher.version.to_proto()))
