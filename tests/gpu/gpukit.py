"""Shared by the GPU suite: a model on the GPU, writes queued behind a long kernel, byte checks."""

from __future__ import annotations

import torch

from weightsync.engine import EngineClient
from weightsync.v1 import weight_sync_service_pb2 as pb

SLEEP_CYCLES = 2_000_000_000
"""About a second of GPU time queued before the writes a push must wait for."""


def gpu_model(seed: int, scale: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "embed.weight": torch.randn(512 * scale, 256, device="cuda", generator=g).to(torch.bfloat16),
        "layer.0.w": torch.randn(1000, 333, device="cuda", generator=g),
        "layer.0.b": torch.randn(333, device="cuda", generator=g).half(),
        "steps": torch.arange(77, device="cuda", dtype=torch.int64) + seed,
    }


def written_behind_a_sleep(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Queue a long kernel, then change every tensor in place on the same (current) stream."""
    torch.cuda._sleep(SLEEP_CYCLES)
    for tensor in model.values():
        tensor.add_(1)
    return model  # nothing synchronized: the new values exist only once the queue drains


def info(server) -> pb.GetServerInfoResponse:
    return server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


def mapped_copy(server, device: str) -> dict[str, torch.Tensor]:
    with EngineClient(server=server.address, name="reader", device=device) as engine:
        with engine.acquire() as snapshot:
            copied = {n: t.clone() for n, t in snapshot.tensors.items()}
            torch.cuda.synchronize()
    return copied


def assert_same_bytes(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    for name in left:
        a = left[name].detach().cpu().contiguous().view(-1).view(torch.uint8)
        b = right[name].detach().cpu().contiguous().view(-1).view(torch.uint8)
        assert torch.equal(a, b), name


def record(name: str, **values) -> dict:
    """A measurement for the run's record: printed (pytest shows it with -rP or on failure) and appended as a
    JSON line to $GPU_KIT_MEASURES when set (tools/gpu_kit/run.sh sets it to $OUT/measures.jsonl)."""
    import json
    import os

    entry = {"measure": name, **values}
    line = json.dumps(entry, sort_keys=True, default=str)
    print(line)
    path = os.environ.get("GPU_KIT_MEASURES")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(line + "\n")
    return entry


def close_while_sending(group, buffer: torch.Tensor, *, close_join: float, blocked_for: float = 1.0) -> dict:
    """Start a send of `buffer` to rank 1 in a thread of its own (one that blocks: its peer never receives), close
    the group from this thread once it blocked for `blocked_for` s, and say how each side ended: whether close()
    finished within `close_join` and took how long, and how (and how soon after the close) the send ended."""
    import threading
    import time

    from weightsync.common.collective import CollectiveError

    ended: dict = {}

    def send() -> None:
        try:
            group.send_async(buffer, 1, 0, deadline=time.monotonic() + 120.0)
            ended["outcome"] = "returned"
        except CollectiveError as error:
            ended["outcome"] = {"closed": "closed" in str(error), "timed_out": error.timed_out}
        ended["at"] = time.monotonic()

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    time.sleep(blocked_for)  # not a synchronisation: whatever the send waits in, close() must end it
    closing = time.monotonic()
    finished = group.close(close_join)
    seconds = time.monotonic() - closing
    sender.join(close_join + 10.0)
    return {"close_finished": finished, "close_seconds": seconds, "send": ended.get("outcome", "still blocked"),
            "send_ended_after_close": ended["at"] - closing if "at" in ended else None}


def send_with_deadline(group, buffer: torch.Tensor, seconds: float) -> dict | str:
    """Send `buffer` to rank 1 with a deadline `seconds` from now: how it ended ("returned", or whether it timed out
    and after how long)."""
    import time

    from weightsync.common.collective import CollectiveError

    started = time.monotonic()
    try:
        group.send_async(buffer, 1, 0, deadline=started + seconds)
        return "returned"
    except CollectiveError as error:
        return {"timed_out": error.timed_out, "seconds": time.monotonic() - started}


def context_after_abort(test: str) -> None:
    """After a test aborted a communicator with a kernel still queued: whether the CUDA context survived (recorded), and
    a failure saying so if not. A fault there is sticky: every later test of the process would fail for the wrong
    reason, which is why such tests run last (conftest.py, marker aborts_queued_kernel)."""
    try:
        torch.cuda.synchronize()
        error = None
    except RuntimeError as failed:
        error = str(failed)[:300]
    record("context_after_abort", test=test, faulted=error is not None, error=error)
    assert error is None, f"the CUDA context faulted once the aborted kernel's queue drained: {error}"


def context_sound() -> None:
    """Before such a test: fail as what it is when an earlier one left the context faulted."""
    import pytest

    try:
        torch.cuda.synchronize()
    except RuntimeError as failed:
        pytest.fail(f"the CUDA context was faulted before this test (see the context_after_abort records): {failed}")
