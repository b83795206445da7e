"""PATCH_XOR at memory speed on the host: numba kernels (common.patch_jit) driven from here.

Why: with torch eager ops a changed element cost ~100 ns end to end (nonzero, index_select,
scatter, each a pass and an allocation); here the trainer's compare is one streaming pass over
both tensors that writes the patch's bytes, and the receiver's check and apply are one pass over
the patch. The byte layout and the refusals are common.patch_format's (the reference these are
tested against bit for bit).

Host (CPU) tensors only, contiguous, any supported dtype (raw bits by element width 1, 2, 4, 8).
Thread-safe: every call works on its own buffers; calls on distinct tensors may run side by side.
The first call of each kernel loads it from numba's cache (or compiles it): warm_up() does that
ahead of time, from a thread if the caller likes.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from weightsync.common import patch_jit as jit
from weightsync.common import patch_jit_check as check
from weightsync.common.patch_format import (
    COUNT_MISMATCH,
    INDEX_BITMASK,
    INDEX_GAPS,
    MALFORMED,
    MASK64,
    OUT_OF_RANGE,
    PLANE_DENSE,
    PLANE_SPARSE,
    PLANE_ZERO,
    bits,
    refuse,
)
from weightsync.common.patches import SampleLayout

MIN_BYTES_PER_THREAD = 1 << 20
"""Below this per thread, one thread: a task hand-off costs more than it saves."""
_REASONS = {jit.MALFORMED: MALFORMED, jit.OUT_OF_RANGE: OUT_OF_RANGE, jit.COUNT_MISMATCH: COUNT_MISMATCH}
_DETAILS = {
    0: "count outside [0, numel]", 1: "has no index kind byte", 2: "varint runs past the end",
    3: "varint longer than 10 bytes", 4: "varint over int64", 5: "bitmask cut short",
    6: "unknown index kind", 7: "plane kinds cut short", 8: "dense plane cut short",
    9: "sparse plane bitmap cut short", 10: "sparse plane bitmap sets bits past count",
    11: "sparse plane bytes cut short", 12: "unknown plane kind", 13: "bytes left over",
    14: "bitmask sets bits past numel", 15: "bitmask bits differ from count",
}
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class EncodedPatch:
    data: torch.Tensor
    """uint8, the PATCH_XOR bytes (TensorSpec.size_bytes = data.numel())."""
    count: int
    """Changed elements (patch_count); 0 when the tensors are equal bit for bit."""
    ws64_delta: int
    """WS64(new) - WS64(base) modulo 2^64: the new tensor's WS64 is the base's plus this."""


def _executor(threads: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < threads:
            _pool = ThreadPoolExecutor(threads, thread_name_prefix="weightsync-patch")
        return _pool


def _run(calls: list) -> list:
    """Run zero-argument calls, the first on this thread, the rest on the pool."""
    if len(calls) == 1:
        return [calls[0]()]
    futures = [_executor(len(calls) - 1).submit(call) for call in calls[1:]]
    first = calls[0]()
    return [first] + [future.result() for future in futures]


def _ranges(numel: int, itemsize: int, threads: int) -> list[tuple[int, int]]:
    """Split [0, numel) into per-thread ranges starting at multiples of 8 elements (bitmask bytes
    and 64-bit words never straddle two ranges)."""
    parts = max(1, min(threads, numel * itemsize // MIN_BYTES_PER_THREAD))
    edges = [min(numel, (numel * i // parts) & ~7) for i in range(parts)] + [numel]
    return [(edges[i], edges[i + 1]) for i in range(parts)]


def _host_bits(tensor: torch.Tensor, what: str) -> np.ndarray:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"{what}: patch kernels need a contiguous CPU tensor (got {tensor.device}, "
                         f"contiguous={tensor.is_contiguous()})")
    return bits(tensor)


_NO_WORDS = np.empty(0, np.uint64)


def _words(flat: np.ndarray) -> np.ndarray:
    """flat's whole 64-bit words when it is 8-byte aligned (the fast path), else empty."""
    if flat.ctypes.data % 8:
        return _NO_WORDS
    whole = flat.size * flat.itemsize // 8
    return flat[: whole * 8 // flat.itemsize].view(np.uint64)


def _data(data: torch.Tensor | bytes | np.ndarray) -> np.ndarray:
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8 or data.device.type != "cpu":
            raise ValueError("patch bytes must be a uint8 CPU tensor")
        return data.contiguous().numpy()
    return np.frombuffer(data, np.uint8) if isinstance(data, bytes | bytearray | memoryview) else data


# -- the trainer's side ------------------------------------------------------------------------
def compare_and_encode(base: torch.Tensor, new: torch.Tensor, threads: int = 1, *,
                       limit_bytes: int | None = None, advance_base: bool = False) -> EncodedPatch | None:
    """The PATCH_XOR patch from base to new, in one pass over both. None when the patch would be
    longer than limit_bytes (checked before its bytes are written: send the tensor dense).
    advance_base: the same pass writes every changed element of new into base, so base equals
    new bit for bit on return, whatever the result (the trainer's kept copy, brought up to date
    without a pass of its own: only the changed words are written, in lines the compare has
    just read)."""
    a, b = _host_bits(base, "base"), _host_bits(new, "new")
    if a.dtype != b.dtype or a.size != b.size:
        raise ValueError(f"base and new differ: {base.dtype}{tuple(base.shape)} vs {new.dtype}{tuple(new.shape)}")
    numel, itemsize = a.size, a.itemsize
    ranges = _ranges(numel, itemsize, threads)
    guess = max(16, (ranges[0][1] - ranges[0][0]) // 64)
    a64, b64 = _words(a), _words(b)
    if not (a64.size and b64.size):
        a64 = b64 = _NO_WORDS
    scans = _run([partial(jit.scan, a, b, a64, b64, s, e, guess, advance_base) for s, e in ranges])
    # Plan: the whole patch's shape from each range's summary (O(ranges)).
    count = sum(r[0] for r in scans)
    first_gaps, previous, gap_bytes = [], -1, 0
    for r_count, first, last, _, used, _, _, _ in scans:
        first_gaps.append(first - previous - 1 if r_count else 0)
        if r_count:
            gap_bytes += int(jit.varint_size(first_gaps[-1])) + used
            previous = last
    bitmask_bytes = (numel + 7) // 8
    index_kind = INDEX_BITMASK if bitmask_bytes < gap_bytes else INDEX_GAPS
    at = 1 + (bitmask_bytes if index_kind == INDEX_BITMASK else gap_bytes)
    nonzero = sum(r[6] for r in scans) if scans else np.zeros(8, np.int64)
    kinds = np.zeros(8, np.int64)
    plane_at = np.zeros(8, np.int64)
    sparse_bytes_at = np.zeros(8, np.int64)
    kinds_at, at = at, at + itemsize
    for j in range(itemsize):
        options = [(count, PLANE_DENSE), ((count + 7) // 8 + int(nonzero[j]), PLANE_SPARSE)]
        if nonzero[j] == 0:
            options.append((0, PLANE_ZERO))
        size, kinds[j] = min(options)
        plane_at[j] = at
        sparse_bytes_at[j] = at + (count + 7) // 8
        at += size
    delta = int(sum(int(r[7]) for r in scans)) & MASK64
    if limit_bytes is not None and at > limit_bytes:
        return None
    out = torch.empty(at, dtype=torch.uint8)
    buffer = out.numpy()
    buffer[0] = index_kind
    buffer[kinds_at: kinds_at + itemsize] = kinds[:itemsize]
    bitmask_at = 1 if index_kind == INDEX_BITMASK else -1
    heads = [np.zeros(8, np.int64) for _ in scans]
    calls, index_at, bit_start, sparse_at = [], 1, 0, sparse_bytes_at.copy()
    for (s, e), r, first_gap, head in zip(ranges, scans, first_gaps, heads, strict=True):
        r_count, first, _, varints, used, xors, r_nonzero, _ = r
        calls.append(partial(jit.emit, buffer, s, e, r_count, first, varints, used, xors, first_gap, bitmask_at,
                             index_at, kinds, plane_at, bit_start, sparse_at.copy(), head))
        if r_count:
            index_at += int(jit.varint_size(first_gap)) + used
        bit_start += r_count
        sparse_at += r_nonzero
    _run(calls)
    bit_start = 0
    for r, head in zip(scans, heads, strict=True):  # sparse bitmap bytes two ranges share
        if bit_start & 7:
            for j in range(itemsize):
                if kinds[j] == PLANE_SPARSE:
                    buffer[plane_at[j] + (bit_start >> 3)] |= head[j]
        bit_start += r[0]
    return EncodedPatch(out, count, delta)


SPLIT_ABOVE_BYTES = 64 << 20
"""compare_many: a tensor this large is split across the threads (one tensor may be most of
the model); smaller ones go whole, one per thread at a time."""


def compare_many(pairs: list[tuple[torch.Tensor, torch.Tensor, int | None]],
                 threads: int = 1, *, advance_base: bool = False) -> list[EncodedPatch | None]:
    """compare_and_encode(base, new, limit_bytes=limit, advance_base=advance_base) for each
    (base, new, limit), in order.

    Why not one call per tensor with the threads splitting each: a model is hundreds of tensors,
    most of a few MB, and splitting each costs two hand-offs and a join per tensor; here each
    thread takes whole tensors, largest first, and waits once. Measured on the bench's dense
    workload (291 bf16 tensors, 0.73 GB, 1% changed, 2 threads): see bench/results/delta.md."""
    results: list[EncodedPatch | None] = [None] * len(pairs)
    whole: list[int] = []
    for i, (base, new, limit) in enumerate(pairs):
        if threads > 1 and new.numel() * new.element_size() >= SPLIT_ABOVE_BYTES:
            results[i] = compare_and_encode(base, new, threads, limit_bytes=limit, advance_base=advance_base)
        else:
            whole.append(i)
    whole.sort(key=lambda i: -pairs[i][1].numel() * pairs[i][1].element_size())
    claimed = iter(whole)
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = next(claimed, None)
            if i is None:
                return
            base, new, limit = pairs[i]
            results[i] = compare_and_encode(base, new, 1, limit_bytes=limit, advance_base=advance_base)

    helpers = max(0, min(threads, len(whole)) - 1)
    _run([work] * (helpers + 1))
    return results


def count_changed(base: torch.Tensor, new: torch.Tensor, sample: SampleLayout | None = None) -> int:
    """Elements of base and new whose bits differ: every element, or those `sample` reads."""
    a, b = _host_bits(base, "base"), _host_bits(new, "new")
    sample = sample or SampleLayout(a.size, 1, 1)
    _check_sample(sample, a.size)
    return int(jit.count_changed(a, b, sample.blocks, sample.stride, sample.run))


def resample(new: torch.Tensor, sample: SampleLayout, kept: torch.Tensor) -> tuple[int, torch.Tensor]:
    """A fresh sample of new's raw bits (`sample.of(patches.bits_of(new))`) and how many of its
    elements differ from `kept`, an earlier sample of the same tensor, in one pass: the dense phase
    of delta="auto" keeps only samples, and this is all it reads of a tensor."""
    a, old = _host_bits(new, "new"), _host_bits(kept, "sample")
    _check_sample(sample, a.size)
    if old.size != sample.size or old.itemsize != a.itemsize:
        raise ValueError(f"a sample of {old.size} x {old.itemsize} bytes is not one of {a.size} elements "
                         f"of {a.itemsize} bytes laid out as {sample}")
    fresh = torch.empty_like(kept)
    return int(jit.resample(a, sample.blocks, sample.stride, sample.run, old, bits(fresh))), fresh


def _check_sample(sample: SampleLayout, numel: int) -> None:
    if sample.blocks < 0 or not 1 <= sample.run <= sample.stride or sample.blocks * sample.stride > numel:
        raise ValueError(f"{sample} does not sample a tensor of {numel} elements")


# -- the receiver's side (and the trainer's kept copy) -----------------------------------------
def _structure(data: np.ndarray, numel: int, itemsize: int, count: int, tensor: str):
    status, detail, index_end, kinds, plane_at, sparse_at = check.structure(data, numel, count, itemsize)
    if status:
        raise refuse(_REASONS[status], tensor, f"{_DETAILS[detail]} (numel {numel}, count {count}, "
                                               f"{data.size} bytes)")
    return index_end, kinds, plane_at, sparse_at


def _walk(data: np.ndarray, live: np.ndarray, numel: int, count: int, mode: int, tensor: str,
          outputs: bool = False) -> tuple[int, np.ndarray, np.ndarray]:
    """Validate, then walk the patch (patch_jit.walk's modes); outputs: (positions, values)
    arrays of count, allocated once count is known to be sane."""
    shape = _structure(data, numel, live.itemsize, count, tensor)
    positions = np.empty(count if outputs else 0, np.int64)
    values = np.empty(count if outputs else 0, live.dtype)
    status, bad, delta = check.walk(data, numel, count, *shape, live, mode, positions, values)
    if status:
        raise refuse(_REASONS[status], tensor, f"position {bad} >= numel {numel}")
    return int(delta), positions, values


def _check_layout(live: np.ndarray, numel: int, itemsize: int) -> None:
    if live.size != numel or live.itemsize != itemsize:
        raise ValueError(f"live tensor has {live.size} elements of {live.itemsize} bytes, "
                         f"the patch is for {numel} of {itemsize}")


def check_patch(data: torch.Tensor | bytes, live: torch.Tensor, numel: int, itemsize: int, count: int,
                *, live_ws64: int, tensor: str = "") -> int:
    """WS64 of `live` once patched, from live_ws64 (its WS64 now), in O(patch); validates every
    byte of the patch and writes nothing. InvalidArgument for a malformed patch."""
    flat = _host_bits(live, tensor or "live")
    _check_layout(flat, numel, itemsize)
    return (live_ws64 + _walk(_data(data), flat, numel, count, 0, tensor)[0]) & MASK64


def apply_patch(data: torch.Tensor | bytes, target: torch.Tensor, count: int, *, tensor: str = "") -> int:
    """target ^= the patch's XORs in place (IN_PLACE on the receiver; the trainer's kept copy);
    returns the WS64 change. Run check_patch first: on a patch it refuses, apply never writes
    outside target, but may have written the elements before the fault."""
    flat = _host_bits(target, tensor or "target")
    return _walk(_data(data), flat, flat.size, count, 1, tensor)[0]


def apply_checked(data: torch.Tensor | bytes, target: torch.Tensor, count: int, *, live_ws64: int,
                  tensor: str = "") -> int:
    """check_patch and apply_patch in one pass: target ^= the patch's XORs, validating as it goes;
    returns target's WS64 afterwards (live_ws64, its WS64 before, plus the change). A malformed
    patch is refused (InvalidArgument) with target bit for bit as it was: the pass is deterministic
    and XOR undoes itself, so walking it again up to where it stopped takes back what it wrote.
    A caller that refuses the returned WS64 undoes the whole patch with apply_patch (same data)."""
    flat = _host_bits(target, tensor or "target")
    patch = _data(data)
    shape = _structure(patch, flat.size, flat.itemsize, count, tensor)  # refuses before any write
    status, bad, delta = check.walk(patch, flat.size, count, *shape, flat, 1, _NO_POSITIONS, flat[:0])
    if status:
        check.walk(patch, flat.size, count, *shape, flat, 1, _NO_POSITIONS, flat[:0])  # the same prefix: undone
        raise refuse(_REASONS[status], tensor, f"position {bad} >= numel {flat.size}")
    return (live_ws64 + int(delta)) & MASK64


_NO_POSITIONS = np.empty(0, np.int64)


def decode_new_values(data: torch.Tensor | bytes, live: torch.Tensor, count: int, *, live_ws64: int,
                      tensor: str = "") -> tuple[int, torch.Tensor, torch.Tensor]:
    """check_patch and the patch's (positions int64, new values in live's dtype) in one pass: a
    STAGED receiver keeps these until commit (then scatter_values)."""
    flat = _host_bits(live, tensor or "live")
    delta, positions, values = _walk(_data(data), flat, flat.size, count, 2, tensor, outputs=True)
    values_t = torch.from_numpy(values.view(np.uint8)).view(live.dtype)
    return (live_ws64 + delta) & MASK64, torch.from_numpy(positions), values_t


def decode_xor(data: torch.Tensor | bytes, numel: int, itemsize: int, count: int,
               *, tensor: str = "") -> tuple[np.ndarray, np.ndarray]:
    """(positions int64, XOR values as unsigned ints of the element's width): patch_format.decode."""
    no_live = np.empty(0, np.dtype(f"u{itemsize}"))  # mode 3 never reads live
    _, positions, values = _walk(_data(data), no_live, numel, count, 3, tensor, outputs=True)
    return positions, values


def scatter_values(target: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """target[positions] = values (a kept patch, from decode_new_values, at commit)."""
    flat = _host_bits(target, "target")
    check.scatter(flat, positions.numpy(), _host_bits(values, "values"))


def warm_up(itemsizes: tuple[int, ...] = (1, 2, 4, 8), *, should_stop: Callable[[], bool] = lambda: False) -> None:
    """Load (or compile: ~13 s for all four widths on the bench machine, once per numba cache) every
    kernel for these element widths; thread-safe, idempotent. Call it from a thread at start-up.
    Between kernels it returns early once should_stop() is true."""
    widths = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    for itemsize in itemsizes:
        for step in _warm_up_steps(widths[itemsize]):
            if should_stop():
                return
            step()


def _warm_up_steps(dtype: torch.dtype) -> list[Callable[[], object]]:
    """One call of every kernel for this element width, each a step warm_up may stop after."""
    base = torch.zeros(9, dtype=dtype)
    new = base.clone()
    new[3] = 1
    patch = compare_and_encode(base, new)
    assert patch is not None
    return [
        partial(check_patch, patch.data, base, 9, base.element_size(), patch.count, live_ws64=0),
        partial(decode_new_values, patch.data, base, patch.count, live_ws64=0),
        partial(decode_xor, patch.data, 9, base.element_size(), patch.count),
        partial(apply_patch, patch.data, base, patch.count),
        partial(scatter_values, base, torch.zeros(1, dtype=torch.int64), new[:1]),
        partial(count_changed, base, new),
        partial(resample, new, SampleLayout(9, 1, 1), base),
    ]

WARM_UP_EXIT_WAIT_S = 120.0
"""How long interpreter exit waits for the warm-up to reach its next stop check (one kernel's
compile, a few seconds cold)."""
_warming: threading.Thread | None = None
_stop_warming = threading.Event()


def warm_up_in_background(itemsizes: tuple[int, ...] = (1, 2, 4, 8)) -> threading.Thread:
    """warm_up on a daemon thread, once per process (a worker or a client starting): the first patch
    then finds its kernels loaded. A kernel called meanwhile loads itself (numba serializes it).

    The process's exit stops and joins it (atexit): a daemon thread still inside a torch op when
    the interpreter finalizes is ended by pthread_exit, whose unwinding through torch's noexcept
    GIL guard calls std::terminate ("terminate called without an active exception", SIGABRT),
    so a short trainer script that pushed and returned would die at exit."""
    global _warming
    with _pool_lock:
        if _warming is None:
            _warming = threading.Thread(target=_warm_quietly, args=(itemsizes,), name="weightsync-patch-warm-up",
                                        daemon=True)
            atexit.register(_stop_warm_up)
            _warming.start()
        return _warming


def _stop_warm_up() -> None:
    _stop_warming.set()
    if _warming is not None and _warming is not threading.current_thread():
        _warming.join(WARM_UP_EXIT_WAIT_S)


def _warm_quietly(itemsizes: tuple[int, ...]) -> None:
    try:
        warm_up(itemsizes, should_stop=_stop_warming.is_set)
    except Exception as error:  # noqa: BLE001 - a failed warm-up only means the first patch compiles
        from weightsync.common.logging import get_logger

        get_logger("weightsync.patch_kernels").warning("patch_kernels_warm_up_failed", error=repr(error))


