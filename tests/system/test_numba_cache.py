"""The numba kernels' cache (common/numba_cache.py): one folder per numba version, numpy version and
interpreter, so that the virtualenvs of one checkout (.venv's numba 0.68, the engine venvs' 0.65) stop
overwriting each other's kernels; and a server compiles them ahead, in a child process while its workers
start, and serves once it is done, so that a server with an empty cache takes its first pushes, patched
too, like any other, and no worker compiles (its heartbeat would stop). A process that exits while
the kernels warm up in its background thread exits cleanly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from weightsync.client import WeightSyncClient
from weightsync.common.numba_cache import cache_folder_name, cache_root, compiled_key

from helpers import local_checksums, server_checksums, start_server

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PYTHON = ROOT / ".venv-engine" / "bin" / "python"


@pytest.mark.parametrize(("numba", "numpy", "tag", "folder"), [
    ("0.68.1", "2.4.6", "cpython-311", "numba-0.68.1-numpy-2.4.6-cpython-311"),
    ("0.65.0", "2.4.6", "cpython-311", "numba-0.65.0-numpy-2.4.6-cpython-311"),
    ("0.65.0", "2.3.5", "cpython-311", "numba-0.65.0-numpy-2.3.5-cpython-311"),
    ("0.68.1", "2.4.6", "cpython-312", "numba-0.68.1-numpy-2.4.6-cpython-312"),
    ("0.68.1", "2.4.6", None, "numba-0.68.1-numpy-2.4.6-no-cache-tag"),
    ("0.69.0rc1+g12/ab", "2.4.6", "pypy311", "numba-0.69.0rc1_g12_ab-numpy-2.4.6-pypy311"),
])
def test_each_numba_numpy_and_interpreter_has_a_folder_of_its_own(numba, numpy, tag, folder):
    assert cache_folder_name(numba, numpy, tag) == folder


def test_the_folders_go_under_numba_cache_dir_else_beside_the_sources_else_in_the_user_wide_cache(tmp_path):
    source = tmp_path / "common"

    def user_wide() -> Path:
        return Path("/home/u/.cache/numba")

    assert cache_root({"NUMBA_CACHE_DIR": "/tmp/nc"}, source, user_wide, lambda p: True) == Path("/tmp/nc")
    assert cache_root({}, source, user_wide, lambda p: True) == source / "__pycache__" / "numba"
    assert cache_root({"NUMBA_CACHE_DIR": ""}, source, user_wide, lambda p: False) == Path("/home/u/.cache/numba")


def test_the_marker_names_the_sources_stamps_and_the_cpu():
    stamps = {"patch_jit.py": (1, 10), "ws64_host.py": (2, 20)}
    key = compiled_key(stamps, "znver4", "+avx2,+sse2")
    assert key == compiled_key(dict(reversed(stamps.items())), "znver4", "+avx2,+sse2")  # order does not matter
    assert len({key,
                compiled_key({**stamps, "ws64_host.py": (3, 20)}, "znver4", "+avx2,+sse2"),  # a source edited
                compiled_key({**stamps, "ws64_host.py": (2, 21)}, "znver4", "+avx2,+sse2"),
                compiled_key(stamps, "skylake", "+avx2,+sse2"),  # another CPU
                compiled_key(stamps, "znver4", "+avx2")}) == 5


LOAD_ONE_KERNEL = """
import json
import numpy as np
from weightsync.common import ws64_host
ws64_host.ws64_host(np.arange(24, dtype=np.uint8))
stats = ws64_host._weighted_words.stats
print(json.dumps({"hits": sum(stats.cache_hits.values()), "misses": sum(stats.cache_misses.values())}))
"""


def load_one_kernel(python: Path | str, cache: Path) -> dict[str, int]:
    """A fresh process of `python` calls one cached kernel: whether numba loaded it (hit) or compiled it (miss)."""
    done = subprocess.run([str(python), "-c", LOAD_ONE_KERNEL], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NUMBA_CACHE_DIR": str(cache)}, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not ENGINE_PYTHON.exists(), reason="needs .venv-engine (make engine-install): another numba")
def test_a_process_of_another_numba_version_leaves_this_one_s_kernels_cached(tmp_path):
    """.venv (numba 0.68) compiles, the engine venv (0.65) compiles its own, and the next .venv process
    loads .venv's from the cache: before, the engine venv's index replaced .venv's and it compiled again."""
    cache = tmp_path / "numba-cache"
    engine_numba = subprocess.run([str(ENGINE_PYTHON), "-c", "import numba; print(numba.__version__)"],
                                  capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    import numba

    assert engine_numba != numba.__version__, "the test needs two numba versions"
    assert load_one_kernel(sys.executable, cache) == {"hits": 0, "misses": 1}
    assert load_one_kernel(ENGINE_PYTHON, cache) == {"hits": 0, "misses": 1}
    assert load_one_kernel(sys.executable, cache) == {"hits": 1, "misses": 0}
    assert load_one_kernel(ENGINE_PYTHON, cache) == {"hits": 1, "misses": 0}


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(512, 256, generator=g).to(torch.bfloat16), "b": torch.randn(4096, generator=g)}


def test_a_server_with_an_empty_cache_compiles_before_it_serves_and_takes_its_first_patched_push(tmp_path):
    """The kernels compile in a child process of the server while its workers start (the marker is there once
    the server is ready), so no worker's heartbeat stops and no push waits for a compile: the first push, and
    the first patched one, commit (no WORKER_UNAVAILABLE, no WORKER_TIMEOUT) and read back bit for bit."""
    cache = tmp_path / "numba-cache"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    server = start_server(tmp_path, workers=2, env=env)
    try:
        marker = subprocess.run([sys.executable, "-c", "from weightsync.common import numba_cache; "
                                 "print(numba_cache.compiled_marker())"], env=env, capture_output=True, text=True,
                                timeout=120, check=True).stdout.strip()
        assert Path(marker).parent.parent == cache and Path(marker).exists()
        current = model()
        with WeightSyncClient(server.address) as client:
            client.push(current, version="v0", transport="inline", allow_new_tensors=True, delta=True)
            changed = {n: t.clone() for n, t in current.items()}
            changed["w"].view(-1)[::997] += 1
            patched = client.push(changed, version="v1", transport="inline", delta=True)
            assert patched.bytes_sent < patched.dense_bytes / 10  # a patch went
            assert client.verify(changed).ok
        assert server_checksums(server) == [local_checksums(changed)]
        log = server.log()
        assert "worker_unresponsive" not in log and "WORKER_TIMEOUT" not in log, log[-3000:]
    finally:
        assert server.stop() == 0, server.log()[-3000:]


SPINNING_WARM_UP = """
import sys, time, torch
from weightsync.common import patch_kernels as pk
def spin(itemsizes, *, should_stop):  # a warm-up that is always inside a torch op
    x = torch.zeros(4096)
    while not should_stop():
        y = x.clone()
        y[3] = 1
pk.warm_up = spin
pk.warm_up_in_background()
time.sleep(0.3)
print("done")
"""

REAL_WARM_UP = """
import sys
from weightsync.common import patch_kernels as pk
pk.warm_up_in_background()
print("done")
"""


def test_a_process_that_exits_during_the_warm_up_exits_cleanly(tmp_path):
    """A daemon thread still inside a torch op when the interpreter finalizes aborts the process
    (pthread_exit unwinding through torch's noexcept GIL guard: SIGABRT after the script's last
    line); the warm-up is stopped and joined at exit instead."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}  # empty: the real one compiles
    for script in (SPINNING_WARM_UP, REAL_WARM_UP):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, env=env)
        assert (done.returncode, done.stdout, done.stderr) == (0, "done\n", "")
