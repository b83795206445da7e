"""delta's kept copy of CUDA tensors (client/delta/base.py): in pinned host memory by default, nothing of
it on the trainer's GPU; compared against a copy brought over a piece at a time (never the whole
tensor on the device); patches exact; its copies out of the device waited for before the host reads
them. An expand() view keeps only the storage it reads, there too."""

from __future__ import annotations

import pytest
import torch

from weightsync.client import WeightSyncClient
from weightsync.client.delta import base as delta_module
from weightsync.client.delta.base import DeltaBase
from weightsync.common.checksum import ws64
from weightsync.common.patches import XOR, bits_of, decode_patch

from gpukit import SLEEP_CYCLES, assert_same_bytes, gpu_model

pytestmark = pytest.mark.timeout(300)

BIG_ELEMENTS = 16 << 20
"""64 MiB of float32: the comparison, brought over 1 MiB at a time, must stay far below it."""


def model(seed: int) -> dict[str, torch.Tensor]:
    named = gpu_model(seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1000)
    named["big"] = torch.randn(BIG_ELEMENTS, device="cuda", generator=g)
    named["transposed"] = torch.randn(300, 200, device="cuda", generator=g).t()  # not contiguous
    named["bias"] = torch.full((1,), 0.5, device="cuda").expand(1 << 21)  # 8 MiB over 4 bytes
    return named


def sparse_step(named: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """~1% of every whole tensor's elements changed, behind a long kernel on the current stream;
    the expanded view's storage changed too."""
    new = {n: t.clone() if n != "bias" else t for n, t in named.items()}
    torch.cuda._sleep(SLEEP_CYCLES)
    for name, tensor in new.items():
        if name != "bias":
            (tensor if tensor.is_contiguous() else tensor.t()).view(-1)[step::97] += 1
    new["bias"] = torch.full((1,), 0.5 + step, device="cuda").expand(1 << 21)
    return new


def exact_patch(old: torch.Tensor, new: torch.Tensor, patch) -> bool:
    """The patch turns `old` into `new`, bit for bit: decoded as a server decodes it, applied to a copy."""
    target = bits_of(old.contiguous()).clone()
    decoded = decode_patch(patch.data, encoding=patch.encoding, numel=new.numel(), count=patch.count,
                           itemsize=new.element_size(), tensor="t")
    target.scatter_(0, decoded.positions.to(target.device), decoded.values.to(target.device).view(target.dtype))
    return torch.equal(target, bits_of(new.contiguous()))


def test_the_kept_copy_of_cuda_tensors_is_in_pinned_host_memory_and_its_patches_are_exact(monkeypatch):
    monkeypatch.setattr(delta_module, "HOST_COMPARE_CHUNK_BYTES", 1 << 20)
    base = DeltaBase()  # WeightSyncClient's default: delta_host_copy=True
    first = model(1)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    base.committed(list(first.items()), None, {"s": 1})
    assert torch.cuda.memory_allocated() == allocated  # nothing of the copy on the GPU
    kept = {**base.tensors, **base.views}
    assert sorted(kept) == sorted(first)
    assert all(t.device.type == "cpu" and t.is_pinned() for t in kept.values())
    assert base.views["bias"].untyped_storage().nbytes() == 4
    assert base.memory_bytes == 4 + sum(t.numel() * t.element_size() for n, t in first.items() if n != "bias")
    assert_same_bytes(kept, first)

    current = first
    for step in range(1, 4):
        previous, current = current, sparse_step(current, step)  # still being written: choose must wait
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        choice = base.choose(list(current.items()), auto=False)
        peak = torch.cuda.max_memory_allocated() - before
        # The 64 MiB tensor was compared through a 1 MiB staging buffer: never copied whole to the GPU.
        assert peak < BIG_ELEMENTS * 4 // 4, f"step {step}: the comparison took {peak} bytes of the GPU"
        # Every changed whole tensor worth a patch; bias (its storage changed) and the smallest dense.
        assert sorted(choice.patches) == sorted(n for n, t in current.items()
                                                if n != "bias" and t.numel() >= delta_module.MIN_PATCH_ELEMENTS)
        assert {n: p.checksum for n, p in choice.patches.items()} == {n: ws64(current[n]) for n in choice.patches}
        for name, patch in choice.patches.items():
            assert patch.encoding != XOR  # compared on the device: its overwriting encodings
            assert exact_patch(previous[name], current[name], patch), f"step {step}: {name}"
        base.take_in_background(list(current.items()), choice)  # as a push does, while its bytes move
        base.committed(list(current.items()), choice, {"s": step + 1})
        kept = {**base.tensors, **base.views}
        assert all(t.device.type == "cpu" and t.is_pinned() for t in kept.values())
        assert_same_bytes(kept, current)


def test_delta_host_copy_false_keeps_the_copy_on_the_device():
    base = DeltaBase(host_copy=False)
    first = model(2)
    base.committed(list(first.items()), None, {"s": 1})
    kept = {**base.tensors, **base.views}
    assert all(t.device == torch.device("cuda", 0) for t in kept.values())
    assert base.views["bias"].untyped_storage().nbytes() == 4
    current = sparse_step(first, 1)
    choice = base.choose(list(current.items()), auto=False)
    assert all(exact_patch(first[n], current[n], p) for n, p in choice.patches.items())
    base.committed(list(current.items()), choice, {"s": 2})
    assert_same_bytes({**base.tensors, **base.views}, current)


def test_default_pushes_of_cuda_tensors_keep_their_copy_on_the_host_and_land_exactly(cpu_server):
    """push()'s defaults (delta="auto", delta_host_copy=True): sparse steps go as patches compared
    against the pinned host copy, the store holds the trainer's bytes after each, the copy never on
    the GPU. INLINE only: the comparison does not depend on the transport, and the kit's
    pytest budget is short."""
    transport = "inline"
    with WeightSyncClient(cpu_server.address, timeout=120) as client:
        current = model(3)
        client.push(current, version="v0", transport=transport, allow_new_tensors=True)
        assert all(t.device.type == "cpu" and t.is_pinned()
                   for t in {**client._delta.tensors, **client._delta.views}.values())
        for step in range(1, 4):
            current = sparse_step(current, step)  # still being written when the push starts
            result = client.push(current, version=f"v{step}", transport=transport)
            assert result.bytes_sent < 0.5 * result.dense_bytes, f"step {step} did not go as patches"
            assert client.verify(current).ok, f"step {step}: the store holds other bytes than the trainer's"
            assert all(t.device.type == "cpu" for t in client._delta.tensors.values())
            # The two tensors under MIN_PATCH_ELEMENTS always go dense: after one dense push their copy
            # becomes a sample (DENSE_RUN_DROPS_COPY); every other tensor's copy is the pushed bytes.
            patched = {n: t for n, t in current.items() if n not in ("steps", "layer.0.b")}
            assert_same_bytes({**client._delta.tensors, **client._delta.views}, patched)
        # The small tensors that change every step went dense: only their samples are kept, on the host.
        assert {"steps", "layer.0.b"} <= set(client._delta.samples)
        assert all(s.device.type == "cpu" for s in client._delta.samples.values())
        client.push(current, version="dense", transport=transport, delta=False)  # and the copy is freed
        assert client._delta.memory_bytes == 0 and client.verify(current).ok


def test_the_background_refresh_copies_on_its_own_stream_after_the_writes(monkeypatch):
    """L3: the refresh of the kept copy runs while the push's bytes move; on the caller's stream its copies out of
    the device would queue ahead of the push's pack copies, checks and sends. On a stream of its own it still
    waits for the writes that made the tensors (here: behind a long kernel on the caller's stream)."""
    base = DeltaBase()
    current = model(5)
    base.committed(list(current.items()), None)
    seen: list[tuple[torch.cuda.Stream, torch.cuda.Stream]] = []
    take_now = DeltaBase._take_now

    def spy(self, named, choice):
        seen.append((torch.cuda.current_stream(torch.device("cuda", 0)), torch.cuda.default_stream(0)))
        take_now(self, named, choice)

    monkeypatch.setattr(DeltaBase, "_take_now", spy)
    caller = torch.cuda.current_stream()
    written = sparse_step(current, 1)  # written behind a long kernel on the caller's stream
    base.take_in_background(list(written.items()), None)
    base.committed(list(written.items()), None)
    [(refresh, default)] = seen
    assert refresh != caller and refresh != default and refresh == base._refresh_streams[torch.device("cuda", 0)]
    assert_same_bytes({**base.tensors, **base.views}, written)  # every copy after the writes


def test_a_background_take_that_fails_waits_for_the_copies_it_queued_before_the_copy_is_dropped(monkeypatch):
    """Review H3, F8: the kept copy's pinned pages are unregistered and unmapped with their last tensor, and torch
    defers nothing for memory it did not allocate. A take that fails after queueing a copy (here: the second
    tensor's pinned allocation refused, the first one's copy queued behind ~1 s of kernel) drops the copy: it
    returns only once its stream drained, so no DMA runs into unmapped pages."""
    from gpukit import record

    base = DeltaBase()
    g = torch.Generator(device="cuda").manual_seed(8)
    named = {"a": torch.randn(4 << 20, device="cuda", generator=g),
             "b": torch.randn(1 << 20, device="cuda", generator=g)}
    torch.cuda.synchronize()
    empty = delta_module._Home.empty
    allocations: list[tuple[int, ...]] = []

    def refused_second(self, shape, dtype):
        allocations.append(tuple(shape))
        if len(allocations) == 2:
            raise RuntimeError("cudaHostRegister refused (the test's)")
        return empty(self, shape, dtype)

    with monkeypatch.context() as patched:
        patched.setattr(delta_module._Home, "empty", refused_second)
        torch.cuda._sleep(SLEEP_CYCLES)  # the writes the refresh waits for
        base.take_in_background(list(named.items()), None)
        settled = base._settle()
        idle = base._refresh_streams[torch.device("cuda", 0)].query()
    record("delta_failed_take", settled=settled, refresh_stream_idle=idle, allocations=len(allocations))
    assert settled is False and base.tensors == {} and len(allocations) == 2
    assert idle, "the failed take returned with its copy into pinned pages still queued"
    base.committed(list(named.items()), None)  # the next push's copy, claimed and exact
    assert base.claims and all(t.is_pinned() for t in base.tensors.values())
    assert_same_bytes(base.tensors, named)
