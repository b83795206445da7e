"""Progress lines on stderr: elapsed time, then what is happening."""

from __future__ import annotations

import sys
import time

_START = time.monotonic()


def log(message: str, **fields: object) -> None:
    extra = " ".join(f"{k}={v}" for k, v in fields.items())
    print(f"[bench {time.monotonic() - _START:7.1f}s] {message}{' ' + extra if extra else ''}", file=sys.stderr, flush=True)


def elapsed() -> float:
    return time.monotonic() - _START
