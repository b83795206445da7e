"""The SGLang plugin's decisions, on literal bodies (no SGLang needed): which bodies no rank may read
(body_problem: every rank holds the whole body and decides alike), which entries carry weightsync's
request (carries_request), and what the tensor-update hook answers for each load format without
calling SGLang. Over a real SGLang, in test_sglang_server.py."""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import pytest
import torch

from weightsync.engine.request import REQUEST_NAME
from weightsync.engine.sglang import LOAD_FORMAT, UpdateRequest, update_body
from weightsync.engine.sglang.plugin import body_problem, carries_request, guarded_update
from weightsync.engine.sglang.request import encode


def unpickle(entry: str) -> object:
    """What SGLang's deserialisation does with an entry of ours (its restricted unpickler aside)."""
    import base64

    return pickle.loads(base64.b64decode(entry, validate=True))  # noqa: S301 - our own bytes


GOOD = encode(UpdateRequest(generation=3))


@pytest.mark.parametrize(("entries", "load_format", "tp_size", "expected"), [
    ([GOOD, GOOD], LOAD_FORMAT, 2, None),
    ([GOOD, GOOD, GOOD], LOAD_FORMAT, 2, None),  # a larger tp_size is harmless: rank R reads entry R
    ([GOOD], LOAD_FORMAT, 2, "REQUEST_MALFORMED: serialized_named_tensors has 1 entries and this SGLang runs 2 TP "
                             "ranks, one entry each (update_body(..., tp_size=2): GET /server_info says tp_size); "
                             "nothing loaded"),
    ([], None, 1, "REQUEST_MALFORMED: serialized_named_tensors has 0 entries and this SGLang runs 1 TP ranks, one "
                  "entry each (update_body(..., tp_size=1): GET /server_info says tp_size); nothing loaded"),
    (["x"], "direct", 2, "REQUEST_MALFORMED: serialized_named_tensors has 1 entries and this SGLang runs 2 TP ranks, "
                         "one entry each (update_body(..., tp_size=2): GET /server_info says tp_size); nothing loaded"),
    (["not base64!", GOOD], "direct", 2, None),  # another format's entries are SGLang's to read
    ([GOOD, "bm90IGEgcGlja2xl"], LOAD_FORMAT, 2, "REQUEST_MALFORMED: entry 1 of serialized_named_tensors is not one "
                                                 "SGLang reads (UnpicklingError: invalid load key, 'n'.); nothing "
                                                 "loaded"),
])
def test_body_problem(entries: list, load_format: str | None, tp_size: int, expected: str | None) -> None:
    assert body_problem(entries, load_format, tp_size, unpickle) == expected


@dataclass
class Meta:
    name: str


@pytest.mark.parametrize(("named_tensors", "expected"), [
    (unpickle(GOOD), True),
    ([("model.norm.weight", torch.zeros(2)), (REQUEST_NAME, torch.zeros(5, dtype=torch.int64))], True),
    ([("model.norm.weight", torch.zeros(2))], False),
    ({"flattened_tensor": torch.zeros(5), "metadata": [Meta(REQUEST_NAME)]}, True),
    ({"flattened_tensor": torch.zeros(5), "metadata": [Meta("model.norm.weight")]}, False),
    ([], False),
    ("garbage", False),
])
def test_carries_request(named_tensors: object, expected: bool) -> None:
    assert carries_request(named_tensors) is expected


class Updater:
    """A rank's WeightUpdater, as far as the hook looks at it."""

    custom_weight_loaders = [LOAD_FORMAT, "some.other.loader"]


def test_the_hook_refuses_weightsyncs_request_under_any_other_known_load_format_without_calling_sglang() -> None:
    calls = []

    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return True, "Success"

    ours = unpickle(update_body(UpdateRequest(generation=3), tp_size=1)["serialized_named_tensors"][0])
    for load_format in (None, "direct", "some.other.loader"):
        success, message = guarded_update(original, Updater(), ours, load_format)
        assert (success, message) == (False, f"LOAD_FORMAT_MISMATCH: the body carries weightsync's request under "
                                             f"load_format {load_format!r}, which would not load it; set load_format "
                                             f"to {LOAD_FORMAT!r} (update_body does); nothing loaded, the weight "
                                             "version unchanged")
    assert calls == []
    # An unknown format is refused as such, whatever it carries.
    assert guarded_update(original, Updater(), ours, "no.such.loader") == (
        False, "LOAD_FORMAT_UNKNOWN: load_format 'no.such.loader' is not one this SGLang loads")
    # Weights under SGLang's own formats go to SGLang untouched; an unknown format is refused.
    weights = [("model.norm.weight", torch.zeros(2))]
    assert guarded_update(original, Updater(), weights, None) == (True, "Success")
    assert guarded_update(original, Updater(), weights, load_format="direct") == (True, "Success")
    assert len(calls) == 2
    assert guarded_update(original, Updater(), weights, "no.such.loader") == (
        False, "LOAD_FORMAT_UNKNOWN: load_format 'no.such.loader' is not one this SGLang loads")
    assert len(calls) == 2
