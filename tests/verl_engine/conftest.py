"""tests/verl_engine: weightsync as verl's checkpoint engine, with verl 0.9.1 itself. Run in verl's virtualenv:

    make test-verl        # builds .venv-verl (make verl-install) first

Its module skips, with the reason, where verl cannot be imported (make test's .venv). This folder
shares its name with verl's package: an installed verl (a regular package) always wins the import.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # helpers
sys.path.insert(0, str(HERE))  # verl_workers, imported by the spawned worker processes
