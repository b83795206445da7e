"""Common/threads.py: a blocking call waited for until a deadline, abandoned past it."""

from __future__ import annotations

import threading

import pytest

from weightsync.common.threads import CallAbandoned, ThreadCall

pytestmark = pytest.mark.timeout(30)


def test_value_and_error_come_back():
    assert ThreadCall(lambda: 42, name="t").result(10) == 42
    with pytest.raises(KeyError, match="nope"):
        ThreadCall(lambda: {}["nope"], name="t").result(10)


def test_past_the_deadline_the_call_is_abandoned_and_its_value_discarded():
    release = threading.Event()
    discarded = []
    finished = threading.Event()

    def slow() -> str:
        release.wait(10)
        return "built"

    def discard(value: str) -> None:
        discarded.append(value)
        finished.set()

    call = ThreadCall(slow, name="slow", discard=discard)
    with pytest.raises(CallAbandoned, match="within 0.1 s"):
        call.result(0.1)
    assert call.abandoned and not discarded
    release.set()
    assert finished.wait(10)
    assert discarded == ["built"]
    # The next call is unaffected.
    assert ThreadCall(lambda: "next", name="t").result(10) == "next"


def test_abandon_after_it_finished_discards_at_once():
    discarded = []
    call = ThreadCall(lambda: "group", name="t", discard=discarded.append)
    assert call.result(10) == "group"
    call.abandon()
    assert discarded == ["group"]
    call.abandon()  # twice is harmless
    assert discarded == ["group"]


def test_a_failed_abandoned_call_discards_nothing():
    release = threading.Event()
    discarded = []

    def fails() -> str:
        release.wait(10)
        raise RuntimeError("rendezvous failed")

    call = ThreadCall(fails, name="t", discard=discarded.append)
    call.abandon()
    release.set()
    with pytest.raises(RuntimeError):
        call.result(10)
    assert discarded == []
