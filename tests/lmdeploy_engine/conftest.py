"""tests/lmdeploy_engine: LMDeploy's own model classes (CPU) loading from a real weightsync server.
Run in LMDeploy's virtualenv:

    make test-lmdeploy        # builds .venv-lmdeploy (make lmdeploy-install) first

Modules that need LMDeploy skip, with the reason, where it cannot be imported (make test's .venv).
LMDeploy's engine and pipeline need a GPU: tests/gpu/test_lmdeploy_engine.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # helpers (tests/conftest.py adds it too)
