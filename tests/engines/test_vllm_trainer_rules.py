"""The pure rules of vLLM's weightsync backend, by literal tables: which engine records are a vLLM's
ranks, how a failed call of vLLM's client is typed, what a trainer's init info refuses, and that a
shadow of a model never shares a tensor table with it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from weightsync.engine.vllm_staging import StagedLayer, StagedModel, shadow_model  # noqa: E402
from weightsync.engine.vllm_trainer import WeightSyncTrainerInitInfo, engine_failure, rank_of  # noqa: E402


@pytest.mark.parametrize("record, name, expected", [
    ("vllm", "vllm", True), ("vllm:tp1", "vllm", True), ("vllm:tp12", "vllm", True), ("vllm:pp1tp0", "vllm", True),
    ("vllm-http", "vllm", False), ("vllm:tp", "vllm", False), ("vllm:tp1x", "vllm", False), ("vllm2", "vllm", False),
    ("other:tp1", "vllm", False), ("a.b:tp3", "a.b", True), ("vllm:second", "vllm", False),
])
def test_which_records_are_the_ranks_of_an_engine_name(record, name, expected):
    assert rank_of(record, name) is expected


class _Response:
    def __init__(self, text: str) -> None:
        self.text = text


class _HttpError(OSError):  # what requests raises: an OSError with the answer attached
    def __init__(self, message: str, body: str) -> None:
        super().__init__(message)
        self.response = _Response(body)


@pytest.mark.parametrize("error, reason", [
    (_HttpError("500 Server Error", '{"error": {"message": "Worker failed with error \'TENSOR_NOT_IN_MODEL: 1 '
                "tensor(s)'\"}}"), "TENSOR_NOT_IN_MODEL"),
    (_HttpError("500 Server Error", '{"error": "NOT_INITIALIZED: call init_weight_transfer_engine first"}'),
     "NOT_INITIALIZED"),
    (_HttpError("500 Server Error", '{"error": "something else"}'), "ENGINE_CALL_FAILED"),
    (ConnectionRefusedError("[Errno 111] Connection refused"), "ENGINE_UNREACHABLE"),
    (TimeoutError("timed out"), "ENGINE_UNREACHABLE"),
    (RuntimeError("RayTaskError: VERSION_GONE: generation 3 is not held"), "VERSION_GONE"),
    (RuntimeError("a Ray actor died"), "ENGINE_CALL_FAILED"),
])
def test_a_failed_call_of_vllms_client_is_typed(error, reason):
    typed = engine_failure("update_weights", error, pushed=True)
    assert (typed.reason, typed.pushed) == (reason, True)
    assert typed.detail.startswith("vLLM's update_weights: ")


@pytest.mark.parametrize("fields, complaint", [
    ({"servers": []}, "at least one weightsync server"),
    ({"servers": ["no-port"]}, "servers"),
    ({"servers": ["a:1"], "engine_server": "b:2"}, "must be one of servers"),
    ({"servers": ["a:1"], "transport": "carrier-pigeon"}, "transport must be one of"),
    ({"servers": ["a:1"], "mode": "sideways"}, "mode must be one of"),
    ({"servers": ["a:1"], "delta": "yes"}, "delta must be"),
    ({"servers": ["a:1"], "trainer_ranks": 0}, "trainer_ranks must be"),
    ({"servers": ["a:1"], "trainer_ranks": 2, "transport": "collective"}, "not collective"),
    ({"servers": ["a:1"], "engine_name": ""}, "prepare needs an engine_name"),
    ({"servers": ["a:1"], "timeout_s": 0}, "timeout_s must be"),
])
def test_the_init_info_refuses_what_cannot_work(fields, complaint):
    with pytest.raises(ValueError, match=complaint):
        WeightSyncTrainerInitInfo(rank=0, **fields)
    assert WeightSyncTrainerInitInfo(servers=["a:1"], rank=0).engine_server == "a:1"
    assert WeightSyncTrainerInitInfo(servers="a:1", rank=0, engine_name="", prepare=False).servers == ["a:1"]


def test_a_shadow_shares_no_tensor_table_and_keeps_aliases():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model.tied = model[0]  # an alias, as a tied lm_head is of embed_tokens
    shadow, live_of = shadow_model(model)
    assert shadow[0] is shadow.tied and shadow[0] is not model[0]
    assert live_of[id(shadow[0])] is model[0] and live_of[id(shadow)] is model
    shadow[0].weight = torch.nn.Parameter(torch.zeros(2, 2))  # loading into the shadow
    assert model[0].weight is not shadow[0].weight and not torch.equal(model[0].weight, shadow[0].weight)
    assert shadow[1].weight is model[1].weight  # untouched tables still point at the live tensors


def test_the_swap_copies_into_the_live_tensors_and_sets_changed_attributes():
    live = torch.nn.Linear(2, 2)
    kernel = live.weight
    live.handle, live.stale = "old", "gone"
    staged = torch.full((2, 2), 7.0)
    model = StagedModel([StagedLayer("layer", live, [(kernel.data, staged)], {"handle": "new"}, ["stale"])])
    assert model.copy_bytes == 16
    model.swap()
    assert live.weight is kernel and torch.equal(kernel, staged)  # the same tensor object, new values
    assert live.handle == "new" and not hasattr(live, "stale") and model.layers == []


@pytest.mark.parametrize("outcomes, reason, message", [
    ([("tp0/2", "TENSOR_NOT_IN_MODEL: 1 tensor(s)"), ("tp1/2", "TENSOR_NOT_IN_MODEL: 1 tensor(s)")],
     "TENSOR_NOT_IN_MODEL", "rank tp0/2, tp1/2 refused: TENSOR_NOT_IN_MODEL: 1 tensor(s)"),
    ([("tp0/2", ""), ("tp1/2", "NOT_PREPARED: none")], "NOT_PREPARED",
     "rank tp0/2 ready; rank tp1/2 refused: NOT_PREPARED: none"),
    ([("tp0/3", "VERSION_GONE: g3"), ("tp1/3", ""), ("tp2/3", "PREPARE_TIMEOUT: slow")], "VERSION_GONE",
     "rank tp0/3 refused: VERSION_GONE: g3; rank tp1/3 ready; rank tp2/3 refused: PREPARE_TIMEOUT: slow"),
])
def test_the_ranks_refusal_names_every_ranks_outcome(outcomes, reason, message):
    from weightsync.engine.vllm_ranks import combined

    assert combined(outcomes) == (reason, "the version not applied, the engine keeps its weights: " + message)


def test_a_rank_that_does_not_raise_ends_vllms_session_on_its_worker():
    from weightsync.engine.vllm_ranks import end_session

    class Engine:
        reset = 0

        def reset_weight_update_target(self) -> None:
            self.reset += 1

    class Worker:  # what vLLM 0.32's worker holds
        def __init__(self, engine) -> None:
            self.weight_transfer_engine = engine
            self._weight_update_active = True

    engine = Engine()
    worker = Worker(engine)
    end_session(engine)
    assert worker._weight_update_active is False and engine.reset == 1


@pytest.mark.parametrize("leases, readings", [
    ({1: (7, 10), 2: (7, 10)}, {1}),                          # one rank staging: its first lease
    ({1: (7, 10), 2: (7, 10), 3: (7, 11), 4: (7, 11)}, {1, 3}),  # two ranks (connections 10, 11)
    ({2: (7, 10)}, set()),                                    # staged already: only its second lease left
    ({5: (7, 12)}, set()),                                    # another engine reading the version
    ({1: (6, 10), 2: (7, 10)}, set()),                        # an older generation does not count
    ({}, set()),
])
def test_the_driver_waits_for_the_first_of_each_ranks_two_leases(leases, readings):
    from types import SimpleNamespace

    from weightsync.server.engines.vllm import reading_leases

    table = {i: SimpleNamespace(generation=g, owner=o) for i, (g, o) in leases.items()}
    assert reading_leases(table, 7) == readings
