"""When delta="auto" sends a patch: the cost model fitted on the benchmark machine, per device and
per link (client/delta/base.py applies it to each tensor's sample and comparison); and where the copy
it compares against lives (kept_copy)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

AUTO_DENSE_ABOVE = 0.25
"""delta="auto" sends the whole update dense when the tensors that would go dense (their samples
say too much changed) hold more than this fraction of the dense bytes, and again when what the
patches and the changed tensors would move is more: a push that mixes patches with many dense
tensors measured slower than dense on the benchmark machine (0.8-0.9x at 1-1.5% changed with a
third to a half of the bytes dense: the comparisons, a patched plan, and the copy of the dense
tensors on top of their transfer), and near the crossover (~2% changed) the samples split the
tensors that way. Checked on the samples before any full comparison."""


@dataclass(frozen=True, slots=True)
class Worth:
    """When a tensor goes as a patch, in fractions of its dense bytes."""

    compare_below: float
    """Compare every element only when the sample predicts a patch below this: the comparison reads
    both copies whole, which a dense push of that tensor does not."""
    patch_below: float
    """Once compared, send the patch when it is at most this (its encoding, the receivers' check
    and scatter cost per changed element)."""


EVERY_SMALLER = Worth(1.0, 1.0)
"""delta=True: a patch wherever it is smaller than the tensor."""
HOST_COMPARE_NS_PER_BYTE = 0.155
"""delta="auto" on host tensors, measured on the 2-core benchmark machine (0.73 GB bf16, 2 CPU
workers; bench --only delta, bench/results/delta.json "forced" rows): patches everywhere took
about the same on every transport, 0.11-0.13 s at 0.1% changed, 0.17 s at 1%, 0.25 s at 3%,
0.33 s at 5% (the compiled compare, one-pass apply; the kept copy taken while the bytes move).
Fitted per dense byte of the tensors: a fixed part (the comparison reading both copies, the
sample, the plan) of this many ns ..."""
HOST_CHANGE_NS_PER_BYTE = 5.8
"""... plus this many ns per dense byte times the fraction of elements changed (the compare
writing the patch, the owners' check and apply, the kept copy's XOR), plus the patch's bytes on
the link. With dense bytes at B bytes/s, patches pay below a fraction changed of
f* = (1/B - fixed) / (change + 1.15/B) (1.15: the patch's bytes per dense byte per changed
fraction, one-ulp bf16). Against the same run's dense pushes: COLLECTIVE (3.4 GB/s) 2.3%, measured
between 2% (0.96x) and 3%; INLINE (1.35 GB/s) 9%, measured 1.5x at 5%, 0.91x at 10%; SHM
(4.2 GB/s) 1.4%, measured 1.07x at 1%, 0.85x at 2%; ~10% at 10 Gbit/s, ~50% at 1 Gbit/s."""
LOOPBACK_BYTES_PER_SECOND = 3.4e9
"""COLLECTIVE's dense throughput on the benchmark machine's loopback, where the constants were fitted."""
ASSUMED_BYTES_PER_SECOND = {"collective": LOOPBACK_BYTES_PER_SECOND, "inline": 1.35e9, "shm": 4.2e9}
"""Per transport, the dense throughput assumed until this client timed a dense push of its own
over it (the benchmark machine's: INLINE 0.4x COLLECTIVE, SHM 1.2x). Where the host's passes over
memory cost more than the bytes (a dense push above ~6.5 GB/s), no patch pays: auto sends
dense (as over SHM, LinkTimings.cannot_pay)."""


def host_worth(dense_bytes_per_second: float | None) -> Worth:
    """delta="auto" for host tensors at this dense throughput (the client's best recent dense push).
    compare_below is in the sample's estimate (it counts every XOR byte: 1.5x a one-ulp bf16 change),
    patch_below in the patch's real bytes; their factors put both at 2.8% and 4.8% on the benchmark
    machine's loopback (one-ulp bf16 changes of ~1.9% and ~4% of the elements): a margin under the
    crossover (2.3%) for the sample's noise, and room above it once the comparison is paid for."""
    crossover = host_crossover(dense_bytes_per_second)
    return Worth(min(1.0, 1.23 * crossover), min(1.0, 2.13 * crossover))


def host_crossover(dense_bytes_per_second: float | None) -> float:
    """The fraction of elements changed below which patches beat dense on host tensors (f* above)."""
    ns_per_byte = 1e9 / (dense_bytes_per_second or LOOPBACK_BYTES_PER_SECOND)
    return max(0.0, (ns_per_byte - HOST_COMPARE_NS_PER_BYTE) / (HOST_CHANGE_NS_PER_BYTE + 1.15 * ns_per_byte))


def auto_dense_above(dense_bytes_per_second: float | None) -> float:
    """AUTO_DENSE_ABOVE on the benchmark machine's loopback, relaxed to 0.8 on a link slow enough
    that the bytes, not the host's passes over memory, decide (patches then pay with many dense
    tensors beside them)."""
    loopback = host_crossover(None)
    scale = host_crossover(dense_bytes_per_second) / loopback if loopback else 1.0
    return min(0.8, max(AUTO_DENSE_ABOVE, AUTO_DENSE_ABOVE * scale))


AUTO_CPU = host_worth(None)
"""Worth(0.028, 0.048) on the benchmark machine's loopback."""
AUTO_CUDA = Worth(0.1, 0.1)
"""delta="auto" for CUDA tensors, on paper (no GPU measurement yet): the comparison runs on the
device, reading the kept copy across the bus where it lives in host memory (the default), at the
bus's bandwidth, well above most links', so what counts is the bytes on the link."""


DEFER_BELOW_BYTES_PER_SECOND = 500e6
"""Host tensors are compared while the patches travel (deferred buckets, client/delta/deferred.py) only
on a link slower than this (4 Gbit/s): there the push costs about max(comparison, transfer)
instead of their sum. Measured on the 2-core benchmark machine (`python -m bench.delta_defer`:
the bench's dense model, 2 CPU workers a server, patches everywhere, COLLECTIVE, 7 alternated
repetitions): over 1 Gbit/s, 3% changed 0.244 s deferred against 0.352 s compared first (1.42x),
1% 1.06x; on plain loopback 0.87x at 1% and 3% (and over INLINE on loopback 0.19-0.23 s against
0.17-0.20 s): where the bytes take little time, the trainer, its servers and their owners' apply
share the machine's two cores, overlapping them gains nothing and each bucket costs an
announcement."""


def defers_comparison(dense_bytes_per_second: float | None) -> bool:
    """Whether a patched push compares while it sends (see DEFER_BELOW_BYTES_PER_SECOND)."""
    return (dense_bytes_per_second or LOOPBACK_BYTES_PER_SECOND) < DEFER_BELOW_BYTES_PER_SECOND


def auto_worth(tensor: torch.Tensor, dense_bytes_per_second: float | None = None) -> Worth:
    return AUTO_CUDA if tensor.is_cuda else host_worth(dense_bytes_per_second)


KeptHome = Literal["host", "pinned host", "device"]


@dataclass(frozen=True, slots=True)
class KeptCopy:
    """Where the copy of one pushed tensor lives and what it holds (DeltaBase keeps it)."""

    home: KeptHome
    """"host": the trainer's memory (a host tensor's copy); "pinned host": page-locked host memory
    (a CUDA tensor's, by default: copied from and to the device asynchronously); "device": the
    tensor's own device (a CUDA trainer that asked for it: delta_host_copy=False)."""
    storage_only: bool
    """A view that reads some elements more than once (expand(), a stride of 0) keeps only the
    storage it reads, with its strides: an update of it is then left out when that storage is
    unchanged and sent dense otherwise (never as a patch)."""
    bytes: int
    """What the copy holds."""


def kept_copy(device_type: str, logical_bytes: int, read_bytes: int, *, host_copy: bool = True) -> KeptCopy:
    """Where delta's copy of a tensor lives: `device_type` is the tensor's (torch.device.type),
    `logical_bytes` its numel times its element size, `read_bytes` the bytes of storage it reads,
    first to last (fewer than logical_bytes only when it reads some more than once). host_copy
    (WeightSyncClient(delta_host_copy=...), default True) keeps a device tensor's copy in host
    memory: a second copy of the model on a trainer's GPU left it short for its optimizer and
    activations a few steps later; comparing then reads the kept copy across the bus."""
    storage_only = read_bytes < logical_bytes
    held = read_bytes if storage_only else logical_bytes
    if device_type == "cpu":
        return KeptCopy("host", storage_only, held)
    if not host_copy:
        return KeptCopy("device", storage_only, held)
    return KeptCopy("pinned host" if device_type == "cuda" else "host", storage_only, held)
