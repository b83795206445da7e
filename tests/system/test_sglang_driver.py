"""The server drives SGLang after each commit: --engine sglang-http=URL (server/engines/sglang.py).

A real weightsync server drives a fake SGLang (tests/fake_sglang.py) that records every call and
really loads the node's store the way weightsync's SGLang loader does. After each commit: pause,
begin, update (the weightsync request naming the generation and what the engine serves), end,
set the label without aborting requests, continue; a new SGLang (or a restarted one) is
warm-started with every tensor; every failed or malformed answer is a typed failure after which
SGLang is left unpaused with no update open, and the next commit is served.
"""

from __future__ import annotations

import json
import threading
import urllib.request

import grpc
import pytest
import torch
from fake_sglang import FakeSglang

from weightsync.engine.request import UpdateRequest
from weightsync.engine.sglang.request import LOAD_FORMAT
from weightsync.server.config import EngineSpec, config_from_args, parse_engine_spec
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import sdk_client, start_server, wait_for

pytestmark = pytest.mark.timeout(240)
NAME = "sglang-http"
UPDATE = ["POST /pause_generation", "POST /begin_weight_update", "POST /update_weights_from_tensor",
          "POST /end_weight_update", "POST /update_weight_version", "POST /continue_generation"]


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(32, 8, generator=generator), "b": torch.randn(8, generator=generator)}


def driven(server) -> pb.EngineStatus:
    info = server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    return {e.name: e for e in info.engines}[NAME]


def serving(server, label: str) -> bool:
    status = driven(server)
    return status.state == pb.ENGINE_STATE_SERVING and status.applied_version.version == label


def same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return actual.keys() == expected.keys() and all(torch.equal(actual[k], v) for k, v in expected.items())


def scrape(server) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.ready['metrics_port']}/metrics", timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


@pytest.fixture
def fake():
    engine = FakeSglang()
    yield engine
    engine.close()


def started(tmp_path, fake: FakeSglang, options: str = "", *extra: str):
    server = start_server(tmp_path, "--engine", f"sglang-http={fake.url}{options}", *extra, workers=1)
    fake.socket_path = server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).local_socket
    return server


@pytest.mark.parametrize("options, mode", [("", "retract"), ("?pause=abort", "abort"),
                                           ("?pause=in_place&timeout_s=30", "in_place")])
def test_each_commit_pauses_updates_labels_and_continues_sglang(tmp_path, fake, options, mode):
    server = started(tmp_path, fake, options, "--metrics-listen", "127.0.0.1:0")
    watched: list[pb.WatchWeightsResponse] = []
    stream = server.stub().WatchWeights(pb.WatchWeightsRequest(), timeout=120)
    reader = threading.Thread(target=lambda: watched.extend(_until_cancelled(stream)), daemon=True)
    reader.start()
    try:
        status = driven(server)
        assert (status.kind, status.endpoint, status.state) == (NAME, fake.url, pb.ENGINE_STATE_UNSPECIFIED)
        assert fake.calls == []  # nothing committed: nothing to drive
        with sdk_client(server) as trainer:
            g1 = trainer.push(weights(1), version="v1", transport="inline", allow_new_tensors=True).servers[0].generation
            wait_for(lambda: serving(server, "v1"))
            # A new SGLang: its version read first, its TP size once, then every tensor (since -1).
            assert fake.calls[0] == ("GET /model_info", {})
            assert fake.routes() == ["GET /server_info", *UPDATE]
            assert fake.body("POST /pause_generation") == {"mode": mode}
            assert fake.body("POST /begin_weight_update") == {}
            update = fake.body("POST /update_weights_from_tensor")
            assert (update["load_format"], len(update["serialized_named_tensors"]), update["flush_cache"],
                    update["abort_all_requests"], "weight_version" in update) == (LOAD_FORMAT, 2, mode != "in_place",
                                                                                  False, False)
            assert fake.body("POST /update_weight_version") == {"new_version": "v1", "abort_all_requests": False}
            assert fake.requests == [UpdateRequest(generation=g1, since_generation=-1)]
            assert same(fake.weights, weights(1)) and (fake.served, fake.paused, fake.session) == ("v1", False, False)

            # The next commit: what changed since the version SGLang serves; no second /server_info.
            g2 = trainer.push({"w": weights(2)["w"]}, version="v2", transport="inline").servers[0].generation
            wait_for(lambda: serving(server, "v2"))
            assert fake.routes() == ["GET /server_info", *UPDATE, *UPDATE]
            assert fake.requests[-1] == UpdateRequest(generation=g2, since_generation=g1)
            assert same(fake.weights, {"w": weights(2)["w"], "b": weights(1)["b"]})
            assert fake.body("POST /update_weight_version") == {"new_version": "v2", "abort_all_requests": False}
        status = driven(server)
        assert (status.applied_version.version, status.applied_version.generation, status.last_error) == ("v2", g2, "")
        assert status.HasField("applied_time") and status.HasField("commit_to_serving")
        samples = scrape(server)
        assert samples[f'weightsync_engine_applied_generation{{engine="{NAME}",kind="{NAME}",state="serving"}}'] == g2
        assert f'weightsync_engine_commit_to_serving_seconds{{engine="{NAME}"}}' in samples
        wait_for(lambda: any(_serves(event, "v2") for event in list(watched)))
        states = [{e.name: e.state for e in event.engines}.get(NAME) for event in list(watched)]
        assert pb.ENGINE_STATE_APPLYING in states, states
    finally:
        stream.cancel()
        code = server.stop()
    assert code == 0, server.log()[-3000:]
    assert "Traceback" not in server.log()


def _wait_for_final_error(server, state: int, start: str, contains: str, step: int) -> None:
    """Until the driven entry is in `state` and its last_error says what the step expects (the failure, and
    what the cleanup added); the test fails with the entry as it stands if it never does within 60 s."""
    seen: list = []

    def settled() -> bool:
        status = driven(server)
        seen[:] = [pb.EngineState.Name(status.state), status.last_error]
        return status.state == state and status.last_error.startswith(start) and contains in status.last_error

    try:
        wait_for(settled, timeout=60)
    except AssertionError:
        raise AssertionError((step, *seen)) from None


def _until_cancelled(stream):
    try:
        yield from stream
    except grpc.RpcError:
        return


def _serves(event: pb.WatchWeightsResponse, label: str) -> bool:
    return any(e.name == NAME and e.state == pb.ENGINE_STATE_SERVING and e.applied_version.version == label
               for e in event.engines)


def _refusal(message: str, status: int = 400) -> tuple[int, bytes]:
    return status, json.dumps({"success": False, "message": message}).encode()


FAILURES = [
    # (route, scripted answers, state, last_error's start, what it must contain too, the calls of the attempt).
    # First, while nothing is committed (so no poll of /model_info can take the scripted answer):
    ("GET /model_info", [(200, b'{"weight_version": 7}')], pb.ENGINE_STATE_FAILED,
     "ENGINE_ANSWER_MALFORMED: GET /model_info: weight_version is int, not a string: 7", "", []),
    ("POST /update_weights_from_tensor", [_refusal("TENSOR_NOT_IN_MODEL: model.extra.weight is not in the model")],
     pb.ENGINE_STATE_FAILED, "ENGINE_REFUSED: POST /update_weights_from_tensor: HTTP 400: TENSOR_NOT_IN_MODEL: "
     "model.extra.weight is not in the model", "", UPDATE[:4] + UPDATE[5:]),
    ("POST /update_weights_from_tensor", [(500, b"Internal Server Error")], pb.ENGINE_STATE_FAILED,
     "ENGINE_REFUSED: POST /update_weights_from_tensor: HTTP 500: Internal Server Error", "", UPDATE[:4] + UPDATE[5:]),
    ("POST /update_weights_from_tensor", "hold", pb.ENGINE_STATE_UNREACHABLE,
     "ENGINE_UNREACHABLE: POST /update_weights_from_tensor: ", "timed out", UPDATE[:4] + UPDATE[5:]),
    ("POST /update_weights_from_tensor", [(200, b"this is not json")], pb.ENGINE_STATE_FAILED,
     "ENGINE_ANSWER_MALFORMED: POST /update_weights_from_tensor: not JSON", "", UPDATE[:4] + UPDATE[5:]),
    ("POST /update_weights_from_tensor", [(200, b'{"success": false, "message": "LOAD_FAILED: RuntimeError: x"}')],
     pb.ENGINE_STATE_FAILED, "ENGINE_REFUSED: POST /update_weights_from_tensor: success false: LOAD_FAILED: "
     "RuntimeError: x", "", UPDATE[:4] + UPDATE[5:]),
    ("POST /update_weights_from_tensor", [(200, b'{"message": "Success"}')], pb.ENGINE_STATE_FAILED,
     "ENGINE_ANSWER_MALFORMED: POST /update_weights_from_tensor: expected a boolean 'success', got "
     '{"message": "Success"}', "", UPDATE[:4] + UPDATE[5:]),
    ("POST /begin_weight_update", [_refusal("a weight-update session is already open")], pb.ENGINE_STATE_FAILED,
     "ENGINE_REFUSED: POST /begin_weight_update: HTTP 400: a weight-update session is already open; and "
     "/end_weight_update failed too: ENGINE_REFUSED: POST /end_weight_update: HTTP 400: no weight-update session "
     "is open", "", UPDATE[:2] + UPDATE[3:4] + UPDATE[5:]),
    ("POST /continue_generation", [(503, b"busy")], pb.ENGINE_STATE_FAILED,
     "ENGINE_REFUSED: POST /update_weights_from_tensor: HTTP 400: VERSION_MISMATCH: x; and /continue_generation "
     "failed too: ENGINE_REFUSED: POST /continue_generation: HTTP 503: busy", "", UPDATE[:4] + UPDATE[5:]),
    ("POST /update_weight_version", [_refusal("Failed to update weight version: boom")], pb.ENGINE_STATE_FAILED,
     "ENGINE_REFUSED: POST /update_weight_version: HTTP 400: Failed to update weight version: boom", "", UPDATE),
]


def test_every_failure_is_typed_cleaned_up_and_the_next_commit_is_served(tmp_path, fake):
    server = started(tmp_path, fake, "?timeout_s=2")
    applied, label, state = -1, "default", {}
    tp_unknown = True  # the driver reads /server_info before its first update to an instance it (re)found
    try:
        with sdk_client(server) as trainer:
            for step, (route, answers, failed_state, error_start, contains, attempt) in enumerate(FAILURES):
                hold = threading.Event()
                if answers == "hold":
                    answers = [(200, b'{"success": true, "message": "Success"}', hold)]
                if route == "POST /continue_generation":  # the update fails, and so does the cleanup's continue
                    fake.script["POST /update_weights_from_tensor"] = [_refusal("VERSION_MISMATCH: x")]
                fake.script[route] = list(answers)
                before = len(fake.routes())
                bad = weights(10 + step)
                trainer.push(bad, version=f"bad{step}", transport="inline", allow_new_tensors=step == 0)
                # The entry says the failure before the driver's cleanup (/end_weight_update, /continue_generation)
                # has run: a stuck SGLang is shown at once. The cleanup's calls follow, and its own failures are
                # then added to last_error: wait for the calls, then for the entry the driver leaves at the end.
                calls = (["GET /server_info"] if tp_unknown and attempt else []) + attempt
                expected = before + len(calls)
                wait_for(lambda expected=expected: len(fake.routes()) >= expected, timeout=60)
                _wait_for_final_error(server, failed_state, error_start, contains, step)
                assert fake.routes()[before:] == calls, step
                tp_unknown = failed_state == pb.ENGINE_STATE_UNREACHABLE or (tp_unknown and not attempt)
                hold.set()
                if route == "POST /update_weight_version":
                    state = bad  # loaded, not labelled: the label stays, the weights moved
                else:
                    assert fake.served == label and same(fake.weights, state), step
                # Cleaned up: generation continues and no update is left open (but where continue failed).
                assert (fake.paused, fake.session) == (route == "POST /continue_generation", False), step
                assert fake.script[route] == [] and driven(server).applied_version.generation == max(applied, 0)

                good = weights(100 + step)
                generation = trainer.push(good, version=f"good{step}", transport="inline").servers[0].generation
                wait_for(lambda label=f"good{step}": serving(server, label), timeout=60)
                assert fake.requests[-1] == UpdateRequest(generation=generation, since_generation=applied), step
                assert same(fake.weights, good) and (fake.served, fake.paused, fake.session) == (f"good{step}", False,
                                                                                               False), step
                assert driven(server).last_error == ""
                applied, label, state, tp_unknown = generation, f"good{step}", good, False
    finally:
        code = server.stop()
    assert code == 0, server.log()[-3000:]
    failures = [line for line in server.log().splitlines() if "engine_apply_failed" in line]
    assert len(failures) == len(FAILURES) - 1, failures  # the timeout is UNREACHABLE, not a refusal
    assert "Traceback" not in server.log()


def test_one_rank_refusing_keeps_every_rank_and_the_next_commit_lands_on_both(tmp_path, fake):
    # SGLang answers rank 0's message; the loader's names every rank's outcome (engine/sglang/loader.py).
    # The driver keeps all of it, cleans up, and drives the next commit from the version SGLang still
    # serves: since_generation is the last applied one, so the refused version's tensors come along.
    server = started(tmp_path, fake)
    try:
        with sdk_client(server) as trainer:
            g1 = trainer.push(weights(1), version="v1", transport="inline", allow_new_tensors=True).servers[0].generation
            wait_for(lambda: serving(server, "v1"))
            fake.rank_refusals = {1: "TENSOR_MISMATCH: 1 tensor(s) do not fit Qwen2ForCausalLM: 'w' (model [32, 8], "
                                     "store [8, 32])"}
            g2 = trainer.push(weights(2), version="v2", transport="inline").servers[0].generation
            wait_for(lambda: driven(server).state == pb.ENGINE_STATE_FAILED, timeout=60)
            assert driven(server).last_error == (
                f"ENGINE_REFUSED: POST /update_weights_from_tensor: HTTP 400: version 'v2' (generation {g2}) not "
                "loaded, the engine keeps its weights: rank tp0/2 ready; rank tp1/2 refused: TENSOR_MISMATCH: 1 "
                "tensor(s) do not fit Qwen2ForCausalLM: 'w' (model [32, 8], store [8, 32])")
            assert all(same(rank, weights(1)) for rank in fake.rank_weights)
            assert (fake.served, fake.paused, fake.session, fake.rank_refusals) == ("v1", False, False, {})
            assert driven(server).applied_version.generation == g1

            g3 = trainer.push({"b": weights(3)["b"]}, version="v3", transport="inline").servers[0].generation
            wait_for(lambda: serving(server, "v3"), timeout=60)
            assert fake.requests[-1] == UpdateRequest(generation=g3, since_generation=g1)
            assert all(same(rank, {"w": weights(2)["w"], "b": weights(3)["b"]}) for rank in fake.rank_weights)
            assert (fake.served, driven(server).last_error) == ("v3", "")
    finally:
        code = server.stop()
    assert code == 0, server.log()[-3000:]


def test_a_restarted_sglang_is_warm_started_with_every_tensor(tmp_path, fake):
    server = started(tmp_path, fake)
    try:
        with sdk_client(server) as trainer:
            trainer.push(weights(1), version="v1", transport="inline", allow_new_tensors=True)
            g2 = trainer.push({"b": weights(2)["b"]}, version="v2", transport="inline").servers[0].generation
            wait_for(lambda: serving(server, "v2") and fake.requests[-1].generation == g2)
            fake.restart(tp_size=1)  # a new SGLang at the URL: its checkpoint, version "default", TP 1
            # The driver's poll sees "default", not v2: every tensor of v2, into the new instance's one rank.
            wait_for(lambda: fake.served == "v2", timeout=30)
            wait_for(lambda: serving(server, "v2"))
        assert fake.requests[-1] == UpdateRequest(generation=g2, since_generation=-1)
        assert len(fake.body("POST /update_weights_from_tensor")["serialized_named_tensors"]) == 1
        assert fake.routes().count("GET /server_info") == 2
        assert same(fake.weights, {"w": weights(1)["w"], "b": weights(2)["b"]})
        assert (fake.paused, fake.session) == (False, False)
    finally:
        code = server.stop()
    assert code == 0, server.log()[-3000:]


@pytest.mark.parametrize("spec, message", [
    ("sglang-http=http://127.0.0.1:30000?pause=later", "pause must be one of retract, abort, in_place, got 'later'"),
    ("sglang-http=http://127.0.0.1:30000?timeout_s=0", "timeout_s must be seconds in (0, 3600], got '0'"),
    ("sglang-http=http://127.0.0.1:30000?timeout_s=soon", "timeout_s must be seconds in (0, 3600], got 'soon'"),
    ("sglang-http=http://127.0.0.1:30000?mode=abort", "options are pause=retract|abort|in_place and timeout_s"),
    ("sglang-http=http://127.0.0.1:30000?pause=abort&pause=retract", "each at most once; got 'pause=retract'"),
    ("sglang-http=127.0.0.1:30000", "--engine must be vllm-http=http://HOST:PORT or sglang-http=http://HOST:PORT"),
    ("vllm-http=http://127.0.0.1:8000?pause=abort", "--engine must be vllm-http=http://HOST:PORT or sglang-http="),
    ("sglang=http://127.0.0.1:30000", "--engine must be vllm-http=http://HOST:PORT or sglang-http="),
])
def test_engine_specs_are_checked_at_start(spec, message):
    with pytest.raises(ValueError) as caught:
        config_from_args(["--engine", spec], env={})
    assert message in str(caught.value)


def test_engine_spec_options():
    assert parse_engine_spec("sglang-http=http://h:30000/") == EngineSpec("sglang-http", "http://h:30000")
    assert parse_engine_spec("sglang-http=https://h:1/x?timeout_s=2.5&pause=in_place") == EngineSpec(
        "sglang-http", "https://h:1/x", pause="in_place", timeout_s=2.5)
    assert parse_engine_spec("vllm-http=http://h:8000") == EngineSpec("vllm-http", "http://h:8000")
    config = config_from_args([], env={"WEIGHTSYNC_ENGINE": "vllm-http=http://a:1,sglang-http=http://b:2?pause=abort"})
    assert config.engines == ("vllm-http=http://a:1", "sglang-http=http://b:2?pause=abort")
