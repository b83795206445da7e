"""bench/pause.py's rules, by table: the pause in a window of model steps, and the reference path cutting
its buffers exactly as vLLM's pack_tensors does (the worker and the trainer must agree on every chunk)."""

from __future__ import annotations

import pytest
import torch

from bench.pause import pause_around, pause_in
from bench.pause_ext import chunk_sizes

STEPS = [[0.0, 1.0], [1.5, 2.0], [5.0, 6.0], [6.1, 7.0]]


@pytest.mark.parametrize("window, pause", [
    ((1.8, 6.05), 3.0),    # the gap 2.0 -> 5.0 holds the update
    ((2.5, 4.0), 3.0),     # a window inside one gap: that whole gap
    ((0.2, 1.6), 0.5),     # only the gap 1.0 -> 1.5 overlaps
    ((6.05, 6.2), 0.1),
    ((7.5, 8.0), 0.0),     # after the last step: no gap known
])
def test_the_pause_is_the_longest_gap_that_overlaps_the_window(window, pause):
    assert pause_in(STEPS, window)[0] == pytest.approx(pause)


@pytest.mark.parametrize("began, ended, pause", [
    (2.5, 4.9, 3.0),       # the apply inside the gap 2.0 -> 5.0: that gap
    (1.2, 1.4, 0.5),
    (0.5, 1.4, 1.5),       # began inside a step: the gap runs from the step before it (none: 0.0 -> 1.5 here)
    (7.2, 7.4, float("nan")),  # no step after it yet
])
def test_the_pause_is_the_gap_that_holds_the_call_that_changed_the_weights(began, ended, pause):
    assert pause_around([[0.0, 0.0], *STEPS], began, ended) == pytest.approx(pause, nan_ok=True)


@pytest.mark.parametrize("sizes, buffer, counts", [
    ([10, 10, 10], 15, [2, 1]),          # a chunk closes once it holds more than the buffer
    ([10, 10, 10], 30, [3]),             # exactly the buffer: not more, one chunk
    ([40, 5, 5], 15, [1, 2]),            # a tensor larger than the buffer goes alone
    ([5], 100, [1]),
    ([], 100, []),
])
def test_the_reference_cuts_its_buffers_by_a_literal_table(sizes, buffer, counts):
    assert chunk_sizes(sizes, buffer) == counts


def test_the_reference_cuts_its_buffers_as_vllms_pack_tensors_does():
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    sizes = [10, 30, 7, 64, 1, 1, 90, 5]
    items = iter((f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate(sizes))
    packed = []
    while (chunk := pack_tensors(items, lambda item: item[1], 40)) is not None:
        packed.append(len(chunk.names))
    assert packed == chunk_sizes(sizes, 40)
