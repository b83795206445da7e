"""Waiting for a transfer group's operations, each against a deadline, never in torch's own waits.

An NCCL operation is waited for by polling (`wait_polled`): its completion, its deadline, whether its group
was closed from another thread, and, every STOP_CHECK_SECONDS, whether the caller was told to give up (a part:
a server said the update is aborting). Its outcome is read with `completed_failure`, never with torch's
`wait()`, which aborts the communicator in the waiting thread when the work failed (TORCH_NCCL_BLOCKING_WAIT=1)
and can hang there (ncclCommAbort). A call that may block inside torch (the start of an NCCL point-to-point
operation, which connects the pair at its first transfer) runs in a thread of its own and is waited for the
same way (`wait_call`). A Gloo wait is torch's own, given what is left of the deadline (`gloo_wait_seconds`).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch.distributed as dist

from weightsync.common.logging import get_logger
from weightsync.common.threads import CallAbandoned, ThreadCall

log = get_logger("weightsync.collective")

NCCL_POLL_SECONDS = (0.0001, 0.001)
"""Polling a transfer's completion: first this often, then (after a millisecond) this often."""
STOP_CHECK_SECONDS = 0.01
"""How often a wait asks whether it was told to stop (a part: whether a server ended the update)."""
FAILED_CLOSE_JOIN_SECONDS = 0.5
"""How long a worker whose transfer failed waits for the group's abort before it reports the failure: the
server gives a bucket the group timeout + server/update_session.BUCKET_MARGIN_SECONDS (2 s) and kills a
worker silent past that (see collective.failure_report_bound). Also the bound on reading a completed work's
failure on torch 2.11 (completed_failure), which aborts its communicator in the reading thread."""

Stopped = Callable[[], BaseException | None]
"""Asked while a transfer is waited for: a reason to give up on it now, or None to go on waiting."""
Closed = Callable[[], bool]
"""Whether the transfer's group was closed (from another thread): nothing of it is worth waiting for."""


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the group is no longer usable."""

    def __init__(self, message: str, *, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class TransferStopped(CollectiveError):
    """The caller was told to give up on a transfer (`Stopped` returned a reason): `reason` is what it was told."""

    def __init__(self, reason: BaseException) -> None:
        super().__init__(f"stopped waiting: {reason}", timed_out=False)
        self.reason = reason


def looks_like_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timeout" in text or "timed out" in text or isinstance(error, TimeoutError)


def _check_closed(what: str, closed: Closed) -> None:
    if closed():
        raise CollectiveError(f"{what}: the group was closed while it was waited for", timed_out=False)


def _check(what: str, deadline: float, closed: Closed, stopped: Stopped | None, timeout: float) -> None:
    """Raise if a wait must end now: its group closed, its deadline passed, or the caller told to stop."""
    _check_closed(what, closed)
    if time.monotonic() > deadline:
        raise CollectiveError(f"{what}: not complete after {timeout:g} s", timed_out=True)
    if stopped is not None and (reason := stopped()) is not None:
        raise TransferStopped(reason)


def wait_polled(work: dist.Work, deadline: float, *, what: str, timeout: float, closed: Closed,
                stopped: Stopped | None = None) -> None:
    """Wait for an NCCL work's completion until `deadline` (time.monotonic()), then read its outcome; raises
    CollectiveError (TransferStopped when `stopped` gave a reason). Completion is polled every
    NCCL_POLL_SECONDS, the deadline and `closed` with it, `stopped` every STOP_CHECK_SECONDS. A work that
    completed because its group was closed (its abort ended the kernel) failed, whatever torch says of it."""
    now = time.monotonic()
    fast_until, next_check = now + 0.001, now
    while not work.is_completed():
        now = time.monotonic()
        if now >= next_check or now > deadline:
            _check(what, deadline, closed, stopped, timeout)
            next_check = now + STOP_CHECK_SECONDS
        elif closed():
            _check(what, deadline, closed, None, timeout)
        time.sleep(NCCL_POLL_SECONDS[0] if now < fast_until else NCCL_POLL_SECONDS[1])
    # Completed because its group was closed? An aborted kernel exits (its end event completes) with no exception
    # set, and torch skips reading the communicator's error once it is aborted: a success here would be a lie.
    _check_closed(what, closed)
    failure = completed_failure(work)
    if failure is not None:
        raise CollectiveError(f"{what}: failed: {failure}", timed_out=looks_like_timeout(failure))


def wait_call(call: ThreadCall, deadline: float, *, what: str, timeout: float, closed: Closed,
              stopped: Stopped | None = None) -> object:
    """The value of a call running in a thread of its own, waited for like a work (wait_polled): what it
    raised is raised here; a call given up on is left to end by itself (its group is closed by the caller)."""
    while not call.wait(max(0.0, min(STOP_CHECK_SECONDS, deadline - time.monotonic()))):
        _check(what, deadline, closed, stopped, timeout)
    return call.result(0)


def wait_gloo(work: dist.Work, deadline: float, *, what: str, timeout: float, closed: Closed,
              stopped: Stopped | None = None) -> None:
    """A Gloo work: torch's own wait, with what is left of the deadline; when `stopped` is given, in a thread
    of its own while it is asked every STOP_CHECK_SECONDS (torch's wait cannot be interrupted: a stopped wait
    goes on there until its deadline, or until its receiver leaves the group)."""
    if stopped is None:
        work.wait(datetime.timedelta(seconds=gloo_wait_seconds(deadline - time.monotonic())))
        return
    call = ThreadCall(lambda: work.wait(datetime.timedelta(seconds=gloo_wait_seconds(deadline - time.monotonic()))),
                      name="gloo-transfer")
    while not call.wait(STOP_CHECK_SECONDS):
        if stopped is not None and (reason := stopped()) is not None:
            raise TransferStopped(reason)
        _check_closed(what, closed)
    call.result(0)


def completed_failure(work: dist.Work, bound: float = FAILED_CLOSE_JOIN_SECONDS) -> BaseException | None:
    """What a completed work failed with (None: it succeeded), read without wait() in this thread. isCompleted()
    is true for a work whose communicator reported an error; exception() then holds it.

    torch 2.11 binds exception() without a converter for the std::exception_ptr it returns, so every call
    raises TypeError, and its is_success() refuses NCCL works ("WorkNCCL::isSuccess() is deprecated"); both
    seen on an H200 (torch 2.11.0+cu130, NCCL 2.28.9); torch 2.13 returns the exception or None. What is left
    there is wait() on the completed work: it returns at once on success; on a failure torch aborts the
    communicator in the waiting thread (ncclCommAbort, which can hang), then raises. So it waits in a thread
    of its own, for at most `bound` seconds: past that the work failed (a success returns at once) and its
    abort goes on in that thread."""
    try:
        return work.exception()
    except TypeError:
        call = ThreadCall(work.wait, name="completed-work")
        try:
            call.result(bound)
        except CallAbandoned:
            log.warning("failed_work_abort_running", bound=bound)
            return CollectiveError(f"the transfer failed and its communicator's abort did not end within {bound:g} s",
                                   timed_out=False)
        except RuntimeError as error:
            return error
        return None
    except RuntimeError as error:  # the binding itself raising is a failure too
        return error


def gloo_wait_seconds(remaining: float) -> float:
    """The timeout a Gloo wait is given for what is left of its transfer's deadline: at least 1 ms
    (torch reads a zero timeout as "none": the group's default)."""
    return max(0.001, remaining)


def run_bounded(fn: Callable[[], None], timeout: float, name: str) -> bool:
    """Run fn in a thread of its own and wait for it at most `timeout` seconds; True if it finished
    (a failure is logged, never raised). What fn does after the timeout is left to it."""
    try:
        ThreadCall(fn, name=name).result(timeout)
    except CallAbandoned:
        log.warning("bounded_call_abandoned", call=name, timeout=timeout)
        return False
    except Exception as error:  # noqa: BLE001 - a failed teardown is logged, never raised
        log.warning("bounded_call_failed", call=name, error=f"{type(error).__name__}: {error}")
    return True
