from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# helpers.py and the fakes live here; a few test modules import another tier's module (a harness or a
# fake it defines), so each tier's folder is importable whichever tiers a run collects.
TESTS = Path(__file__).parent
for folder in (TESTS / "system", TESTS / "integration", TESTS / "unit", TESTS):
    sys.path.insert(0, str(folder))

from helpers import ServerProcess, shm_segments, start_server  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ServerProcess:
    """One 2-worker CPU server shared by a module's tests; must exit 0 and leave no segment."""
    proc = start_server(tmp_path_factory.mktemp("server"))
    segments = proc.segments()
    assert len(segments) == 4  # a command and an event queue per worker
    # Names are unlinked at creation: even a SIGKILLed server leaves nothing behind.
    assert segments & shm_segments() == set()
    yield proc
    code = proc.stop()
    assert code == 0, proc.log()
    assert segments & shm_segments() == set()
