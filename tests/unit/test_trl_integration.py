"""Weightsync.integrations.trl without TRL: the version gate, the config, and how a sync decides
that vLLM serves its version (pure functions over the protos, a fake clock).

The integration end to end (TRL, vLLM, a weightsync server) is tests/engines/test_trl_grpo.py.
"""

from __future__ import annotations

import pytest

from weightsync.integrations.trl import WeightSyncConfig, WeightSyncTrlError, versions
from weightsync.integrations.trl.serving import (
    canonical_url,
    find_engine,
    serving_outcome,
    wait_serving,
)
from weightsync.v1 import weight_sync_service_pb2 as pb


# -- versions --------------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["1.16.0", "1.16.3", "1.16.0rc1", "1.16.1.dev0+local", "v1.16"])
def test_trl_1_16_is_supported(version):
    assert versions.problem(version) is None


@pytest.mark.parametrize("version", ["1.15.0", "1.17.0", "2.16.0", "0.16.0", "1.1.6", "main", ""])
def test_other_trl_releases_are_refused_saying_what_to_install(version):
    message = versions.problem(version)
    assert message == (f"weightsync.integrations.trl supports TRL >=1.16.0,<1.17, found trl {version}: its "
                       "GRPOTrainer may build and call its vLLM client differently. pip install 'weightsync[trl]' "
                       "(trl>=1.16.0,<1.17; tested with trl==1.16.0)")


def test_missing_trl_is_refused_saying_what_to_install():
    assert versions.problem(None) == ("weightsync.integrations.trl needs TRL, which is not installed: pip install "
                                      "'weightsync[trl]' (trl>=1.16.0,<1.17; tested with trl==1.16.0)")


def test_the_trl_names_check_the_version_before_importing_trl(monkeypatch):
    import weightsync.integrations.trl as integration

    monkeypatch.setattr(versions, "installed_version", lambda: "1.17.0")
    with pytest.raises(versions.UnsupportedTrlVersion, match=r"found trl 1\.17\.0"):
        integration.GRPOTrainer  # noqa: B018 - the attribute access is the import
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        integration.nothing  # noqa: B018


# -- config ----------------------------------------------------------------------------------
def test_config_from_the_environment():
    config = WeightSyncConfig.from_env({"WEIGHTSYNC_SERVER": "10.0.0.5:50051", "WEIGHTSYNC_TRANSPORT": "shm",
                                        "WEIGHTSYNC_TIMEOUT_S": "45", "WEIGHTSYNC_TOKEN": "t0k",
                                        "WEIGHTSYNC_ENGINE": "vllm-http-1", "WEIGHTSYNC_DTYPE": "float16"})
    assert config == WeightSyncConfig(server="10.0.0.5:50051", transport="shm", timeout_s=45.0, token="t0k",
                                      engine="vllm-http-1", dtype="float16")
    assert WeightSyncConfig.from_env({"WEIGHTSYNC_SERVER": "h:1"}) == WeightSyncConfig(server="h:1")


@pytest.mark.parametrize(("environ", "message"), [
    ({}, "WEIGHTSYNC_SERVER is not set"),
    ({"WEIGHTSYNC_SERVER": "http://h:1"}, "has a scheme"),
    ({"WEIGHTSYNC_SERVER": "h:1", "WEIGHTSYNC_TRANSPORT": "nccl"}, "transport must be one of collective, inline, shm"),
    ({"WEIGHTSYNC_SERVER": "h:1", "WEIGHTSYNC_TIMEOUT_S": "soon"}, "WEIGHTSYNC_TIMEOUT_S must be a number"),
    ({"WEIGHTSYNC_SERVER": "h:1", "WEIGHTSYNC_TIMEOUT_S": "0"}, "timeout_s must be positive"),
    ({"WEIGHTSYNC_SERVER": "h:1", "WEIGHTSYNC_DTYPE": "int8"}, "dtype must be one of auto, bfloat16"),
])
def test_a_bad_environment_names_what_is_wrong(environ, message):
    with pytest.raises(ValueError, match=message):
        WeightSyncConfig.from_env(environ)


# -- which engine ----------------------------------------------------------------------------
def engine(name="vllm-http", kind="vllm-http", endpoint="http://127.0.0.1:8000", state=pb.ENGINE_STATE_SERVING,
           version="", generation=0, error="") -> pb.EngineStatus:
    status = pb.EngineStatus(name=name, kind=kind, endpoint=endpoint, state=state, last_error=error)
    if generation:
        status.applied_version.version, status.applied_version.generation = version, generation
    return status


@pytest.mark.parametrize(("a", "b"), [
    ("http://0.0.0.0:8000", "http://127.0.0.1:8000/"),
    ("http://localhost:8000", "HTTP://127.0.0.1:8000"),
    ("127.0.0.1:8000", "http://[::1]:8000"),
    ("http://vllm.internal", "http://vllm.internal:80"),
])
def test_urls_of_one_vllm_compare_equal(a, b):
    assert canonical_url(a) == canonical_url(b)


def test_the_engine_is_the_driven_one_at_trls_vllm_url():
    engines = [engine("local-a", kind="local", endpoint="worker:0"), engine("vllm-http", endpoint="http://10.1.1.1:8000"),
               engine("vllm-http-1", endpoint="http://localhost:8000")]
    assert find_engine(engines, "http://0.0.0.0:8000", None, "s:1") == "vllm-http-1"
    assert find_engine(engines, "http://0.0.0.0:8000", "local-a", "s:1") == "local-a"


def test_a_server_that_does_not_drive_trls_vllm_says_how_to_start_it():
    with pytest.raises(WeightSyncTrlError) as raised:
        find_engine([engine(endpoint="http://10.1.1.1:8000")], "http://127.0.0.1:9000", None, "s:1")
    assert raised.value.reason == "ENGINE_NOT_FOUND"
    assert str(raised.value) == ("ENGINE_NOT_FOUND: the weightsync server s:1 does not drive the vLLM at "
                                 "http://127.0.0.1:9000 that TRL generates with (it drives http://10.1.1.1:8000): "
                                 "start it with --engine vllm-http=http://127.0.0.1:9000, or name its engine in "
                                 "WeightSyncConfig(engine=...)")
    with pytest.raises(WeightSyncTrlError, match="has no engine named 'x' \\(it has 'vllm-http'\\)"):
        find_engine([engine()], "http://127.0.0.1:8000", "x", "s:1")


# -- serving a version ----------------------------------------------------------------------
def test_serving_the_generation_or_a_later_one_ends_the_wait():
    status = engine(version="step-3", generation=4)
    assert serving_outcome(status, 4, None, "step-3") is status
    assert serving_outcome(status, 3, None, "step-2") is status
    assert serving_outcome(status, 5, None, "step-4") is None
    assert serving_outcome(engine(state=pb.ENGINE_STATE_APPLYING, version="step-3", generation=4), 4, None, "x") is None


def test_a_new_failure_is_a_refusal_of_this_version():
    before = engine(version="step-3", generation=4)
    failed = engine(state=pb.ENGINE_STATE_FAILED, version="step-3", generation=4, error="TENSOR_NOT_IN_MODEL: x")
    outcome = serving_outcome(failed, 5, before, "step-4")
    assert isinstance(outcome, WeightSyncTrlError) and outcome.reason == "ENGINE_FAILED"
    assert str(outcome) == ("ENGINE_FAILED: vLLM did not take 'step-4' and keeps serving 'step-3': "
                            "TENSOR_NOT_IN_MODEL: x")


def test_a_failure_reported_before_the_push_is_not_this_versions():
    stale = engine(state=pb.ENGINE_STATE_FAILED, version="step-3", generation=4, error="LOAD_FAILED: old")
    assert serving_outcome(stale, 6, stale, "step-5") is None  # the driver has not tried generation 6 yet
    newer = engine(state=pb.ENGINE_STATE_FAILED, version="step-3", generation=4, error="LOAD_FAILED: new")
    assert serving_outcome(newer, 6, stale, "step-5").reason == "ENGINE_FAILED"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_wait_serving_polls_until_served():
    answers = iter([[engine(state=pb.ENGINE_STATE_APPLYING)], [engine(version="step-1", generation=2)]])
    clock = FakeClock()
    status = wait_serving(lambda: next(answers), "vllm-http", 2, "step-1", before=None, timeout=5, clock=clock,
                          sleep=clock.sleep)
    assert (status.applied_version.version, clock.now) == ("step-1", 0.05)


def test_wait_serving_ends_with_an_error_at_the_timeout_not_a_hang():
    clock = FakeClock()
    unreachable = engine(state=pb.ENGINE_STATE_UNREACHABLE, version="step-0", generation=1,
                         error="GET /weight_info: connection refused")
    with pytest.raises(WeightSyncTrlError) as raised:
        wait_serving(lambda: [unreachable], "vllm-http", 2, "step-1", before=None, timeout=3, clock=clock,
                     sleep=clock.sleep)
    assert raised.value.reason == "ENGINE_TIMEOUT"
    assert str(raised.value) == ("ENGINE_TIMEOUT: vLLM did not serve 'step-1' (generation 2) within 3 s: engine "
                                 "'vllm-http' is ENGINE_STATE_UNREACHABLE; last error: GET /weight_info: "
                                 "connection refused")
    assert 3 <= clock.now < 3.1


def test_an_engine_that_leaves_the_list_ends_the_wait():
    clock = FakeClock()
    with pytest.raises(WeightSyncTrlError, match="ENGINE_NOT_FOUND: the engine left"):
        wait_serving(lambda: [], "vllm-http", 2, "step-1", before=None, timeout=3, clock=clock, sleep=clock.sleep)
