"""One intra-op thread for the SDK's own CPU work, in the calling thread only.

Packing and checksums are many small memory-bound torch ops. With several OpenMP
threads each op pays a barrier, and on a host whose cores are busy with the
broadcast (sockets, receivers) a barrier waits for a thread that cannot run:
packing measured 3-10x slower on 2 loaded cores with 2 threads than with 1.

torch.set_num_threads is no answer for a client that may share its process with
training threads: it changes the count torch gives every thread started from then
on, whichever thread calls it. OpenMP keeps the count per thread, so the SDK sets
OpenMP's own value in the calling thread, around its own ops only (never around
caller code such as a progress callback or a tensor iterator), and puts it back.
Where no OpenMP runtime is loaded (another torch build), nothing is changed.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Iterator

import torch

_RUNTIMES = ("libgomp", "libiomp5", "libomp")


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (opening a loaded library again returns the same one)."""
    try:
        with open(f"/proc/{os.getpid()}/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith(_RUNTIMES):
            try:
                runtime = ctypes.CDLL(path)
                runtime.omp_get_max_threads.restype = ctypes.c_int
                runtime.omp_set_num_threads.argtypes = [ctypes.c_int]
                return runtime
            except (OSError, AttributeError):
                continue
    return None


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """torch ops in this block, in this thread, run on one intra-op thread; other threads are untouched."""
    runtime = _openmp()
    if runtime is None:
        yield
        return
    torch.get_num_threads()  # torch sets a thread's count on its first use: let that happen before, not inside
    previous = runtime.omp_get_max_threads()
    if previous == 1:
        yield
        return
    runtime.omp_set_num_threads(1)
    try:
        yield
    finally:
        runtime.omp_set_num_threads(previous)
