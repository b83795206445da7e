"""tests/sglang_engine: weightsync into a real SGLang server (CPU, TP 2). Run in SGLang's virtualenv:

    make test-sglang        # builds .venv-sglang (make sglang-install) first

Modules that need SGLang skip, with the reason, where it cannot be imported (make test's .venv).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # sharding, sglang_server
sys.path.insert(0, str(HERE.parent / "engines"))  # tiny_model
sys.path.insert(0, str(HERE.parent))  # helpers (tests/conftest.py adds it too)
