"""The GPU suite (`make test-gpu`): what only a GPU can show.

Without CUDA every test here skips with a reason and the run exits 0; tests that need two GPUs
skip with a reason on one. Servers run as real processes with CUDA workers; the trainer is this
process, with tensors on the GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # helpers, models
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpukit

from helpers import ServerProcess, start_server  # noqa: E402

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    for item in items:
        if GPUS == 0:
            item.add_marker(pytest.mark.skip(reason="no CUDA device: the GPU suite runs on a machine with one"))
        elif "two_gpus" in item.keywords and GPUS < 2:
            item.add_marker(pytest.mark.skip(
                reason=f"needs 2 GPUs, this machine has {GPUS} (NCCL refuses two ranks on one GPU)"))


@pytest.fixture
def cuda_server(tmp_path) -> ServerProcess:
    """One CUDA worker on cuda:0, with the local socket (engines, SHM) and the ingress (INLINE)."""
    server = start_server(tmp_path, "--local-socket", "auto", workers=0, devices="cuda:0")
    yield server
    assert server.stop() == 0, server.log()[-3000:]


@pytest.fixture
def cpu_server(tmp_path) -> ServerProcess:
    server = start_server(tmp_path, "--local-socket", "auto", workers=1)
    yield server
    assert server.stop() == 0, server.log()[-3000:]
