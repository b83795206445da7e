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


def pytest_report_header(config) -> str:
    """The versions every result of the run comes from (the kit's run.log keeps this line)."""
    return versions()


def pytest_terminal_summary(terminalreporter) -> None:
    terminalreporter.write_line(versions())  # -q leaves the header out


def versions() -> str:
    if GPUS == 0:
        return f"GPU suite: no CUDA device (torch {torch.__version__})"
    try:
        nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
    except (AttributeError, RuntimeError):
        nccl = "-"
    return (f"GPU suite: {GPUS} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, NCCL {nccl}")


def _needs_a_server(item) -> bool:
    """A server fixture, requested by name or through a parameter (request.getfixturevalue)."""
    names = set(getattr(item, "fixturenames", ()))
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        names |= {value for value in callspec.params.values() if isinstance(value, str)}
    return bool({"cuda_server", "cpu_server"} & names)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "aborts_queued_kernel: aborts a communicator with a kernel still queued (run "
                                       "last: a fault would be sticky for the process's CUDA context)")


def pytest_collection_modifyitems(config, items):
    # Tests without a server first: they are quick, and a run cut short by its time limit on a
    # lent machine still reports them (the order within each kind is the files' order). Last, the
    # tests that abort a communicator with a kernel still queued: if the abort faulted the context,
    # only they could fail for it (each records whether it did: gpukit.context_after_abort).
    items.sort(key=lambda item: ("aborts_queued_kernel" in item.keywords, _needs_a_server(item)))
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
