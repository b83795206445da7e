"""Where weightsync's numba kernels are cached, and compiling them ahead, in a child process.

One cache folder per numba version, numpy version and interpreter. numba keeps one index file per
kernel and drops (then overwrites) an index written by another numba version; by default it keeps
them beside the sources, which every virtualenv of a checkout shares: .venv (numba 0.68) and the
engine venvs (0.65) overwrote each other's kernels, so every process compiled them again (31-44 s on
a loaded host, against 0.9 s to load them). The folder is kernel_cache_dir(): under NUMBA_CACHE_DIR
when it is set, else beside the sources (__pycache__/numba), else in numba's user-wide cache; numba
itself then adds a subfolder per source folder. Only the kernels decorated with cached_njit go
there (numba's own setting, config.CACHE_DIR, is set while each is decorated and put back): other
libraries' numba caches stay where they were.

Compiling takes tens of seconds and holds the interpreter's lock in long stretches (seen: 0.6 s on an
idle host; ten times that at load 10-24), long enough for a worker's heartbeat thread to miss its
bound, and a push that needs a kernel meanwhile waits for it. So nothing that serves compiles:
compile_ahead() runs a child process (`python -m weightsync.common.numba_cache`) that compiles every
kernel into the cache and leaves a marker (compiled_marker) naming what it compiled for, the sources'
stamps and the host CPU, as numba's own cache keys them; with the marker there it exits at once. The
server runs it while its workers start and serves once it ended (server/workers/supervisor.py); a worker
loads its kernels once the marker is there (wait_compiled; about a second). Children of several
servers take turns on a lock on the folder, so they compile once between them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

KERNEL_SOURCES = ("patch_jit.py", "patch_jit_check.py", "ws64_host.py")
"""The modules (in this folder) whose kernels are cached_njit's: a change to any compiles them all again."""
COMPILE_AHEAD_SECONDS = 600.0
"""The most a server's start waits for the kernels to compile (then it serves, and a kernel compiles where it
is first used, as without this), and a worker for the marker. A compile takes 13-45 s on 2 cores, over 90 s
at load 40; what is compiled stays cached kernel by kernel, so a start cut short (the manifests' startupProbe
allows 120 s; their /tmp, an emptyDir, outlives the container) resumes where it stopped."""
MARKER_POLL_SECONDS = 0.2
LOCK_NAME = "compile.lock"
_decorating = threading.Lock()


def cache_folder_name(numba_version: str, numpy_version: str, cache_tag: str | None) -> str:
    """The folder of one numba version's kernels for one interpreter (sys.implementation.cache_tag, e.g.
    "cpython-311") and numpy version: what numba's index does not tell apart."""
    name = f"numba-{numba_version}-numpy-{numpy_version}-{cache_tag or 'no-cache-tag'}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def cache_root(environment: Mapping[str, str], source_dir: Path, user_wide: Callable[[], Path],
               writable: Callable[[Path], bool]) -> Path:
    """Where the per-version folders go: NUMBA_CACHE_DIR if set; else source_dir/__pycache__/numba when
    that can be written (numba's own first choice, beside the sources); else numba's user-wide cache."""
    if environment.get("NUMBA_CACHE_DIR"):
        return Path(environment["NUMBA_CACHE_DIR"])
    in_tree = source_dir / "__pycache__" / "numba"
    return in_tree if writable(in_tree) else user_wide()


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK | os.X_OK)


def _user_wide() -> Path:
    from numba.misc.appdirs import user_cache_dir

    return Path(user_cache_dir(appname="numba", appauthor=False))


@lru_cache(maxsize=1)
def kernel_cache_dir() -> Path:
    """This process's folder for weightsync's kernels (module docstring); read once."""
    import numba
    import numpy

    root = cache_root(os.environ, Path(__file__).parent, _user_wide, _writable)
    return root / cache_folder_name(numba.__version__, numpy.__version__, sys.implementation.cache_tag)


def cached_njit(**options: Any) -> Callable[[F], F]:
    """numba.njit(cache=True, **options), cached in kernel_cache_dir(). numba decides a kernel's cache
    folder when it is decorated (its locator reads config.CACHE_DIR then), so the setting holds only
    for that moment."""
    from numba import config, njit

    def decorate(function: F) -> F:
        with _decorating:
            before = config.CACHE_DIR
            config.CACHE_DIR = str(kernel_cache_dir())
            try:
                return njit(cache=True, **options)(function)
            finally:
                config.CACHE_DIR = before

    return decorate


# -- compiling ahead ----------------------------------------------------------------------------------
def compiled_key(stamps: Mapping[str, tuple[int, int]], cpu_name: str, cpu_features: str) -> str:
    """What a marker names: the kernels' sources (name -> (mtime in ns, size), as numba stamps them) and the
    host CPU (numba keys a compiled kernel by its name and features)."""
    text = "\n".join([*(f"{name} {mtime} {size}" for name, (mtime, size) in sorted(stamps.items())),
                      cpu_name, cpu_features])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def compiled_marker() -> Path:
    """The file compile_ahead leaves once every kernel is compiled for these sources on this CPU."""
    from llvmlite import binding

    here = Path(__file__).parent
    stamps = {}
    for name in KERNEL_SOURCES:
        stat = (here / name).stat()
        stamps[name] = (stat.st_mtime_ns, stat.st_size)
    key = compiled_key(stamps, binding.get_host_cpu_name(), binding.get_host_cpu_features().flatten())
    return kernel_cache_dir() / f"compiled-{key}"


async def compile_ahead(timeout: float = COMPILE_AHEAD_SECONDS) -> bool:
    """The kernels compiled into the cache by a child process (module docstring), at most `timeout` seconds:
    then, or when cancelled, the child is killed (what it compiled stays cached). True if it succeeded."""
    from weightsync.common.logging import get_logger

    log = get_logger("weightsync.numba_cache")
    child = await asyncio.create_subprocess_exec(sys.executable, "-m", "weightsync.common.numba_cache",
                                                 stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                                                 stderr=asyncio.subprocess.PIPE)
    try:
        _, stderr = await asyncio.wait_for(child.communicate(), timeout)
    except TimeoutError:
        log.warning("kernels_compile_ahead_timed_out", timeout_s=timeout)
        return False
    finally:
        if child.returncode is None:
            child.kill()
            await asyncio.shield(child.wait())
    if child.returncode != 0:
        log.warning("kernels_compile_ahead_failed", returncode=child.returncode,
                    stderr=stderr.decode(errors="replace")[-2000:])
    return child.returncode == 0


def wait_compiled(timeout: float = COMPILE_AHEAD_SECONDS) -> bool:
    """Wait (sleeping, not holding the interpreter's lock) until the marker is there, at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    marker = compiled_marker()
    while not marker.exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(MARKER_POLL_SECONDS)
    return True


def _compile_here() -> None:
    """The child's work: under the folder's lock, unless another child compiled meanwhile, call every kernel
    once (each compiles into the cache), then leave the marker."""
    folder = kernel_cache_dir()
    if compiled_marker().exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK_NAME, "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when this process dies
        marker = compiled_marker()
        if marker.exists():
            return
        from weightsync.common import patch_kernels
        from weightsync.common.ws64_host import warm_up as warm_up_ws64

        patch_kernels.warm_up()
        warm_up_ws64()
        partial = marker.with_name(f"{marker.name}.{os.getpid()}")
        partial.write_text("compiled\n")
        os.replace(partial, marker)


if __name__ == "__main__":
    # The module the kernels' decorators read (this file runs as __main__, a second copy of it).
    from weightsync.common import numba_cache

    with contextlib.suppress(KeyboardInterrupt):
        numba_cache._compile_here()
