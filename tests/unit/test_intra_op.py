"""Client/intra_op.py: one intra-op thread for the SDK's own ops, in the calling thread only."""

from __future__ import annotations

import threading

import pytest
import torch

from weightsync.client.intra_op import _openmp, one_intra_op_thread


def fresh_thread_count() -> int:
    box: list[int] = []
    thread = threading.Thread(target=lambda: box.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return box[0]


@pytest.mark.skipif(_openmp() is None, reason="this torch build has no OpenMP runtime")
def test_one_thread_inside_for_this_thread_only_and_restored():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_intra_op_thread():
            assert torch.get_num_threads() == 1
            assert fresh_thread_count() == 2  # a thread started meanwhile gets the process's count
            torch.ones(1 << 20).sum()  # ops still work
        assert torch.get_num_threads() == 2
        assert fresh_thread_count() == 2
    finally:
        torch.set_num_threads(previous)


def test_nested_and_raising_blocks_restore():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError):
            with one_intra_op_thread():
                with one_intra_op_thread():
                    raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)
