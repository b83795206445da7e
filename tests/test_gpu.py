"""NCCL/CUDA path: the same push as the CPU tests, one switch away. Skipped without CUDA."""

from __future__ import annotations

import pytest

from weightsync.client import WeightSyncClient

from models import mixed_model

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def test_nccl_push_and_verify(tmp_path):
    import subprocess
    import sys

    ready = tmp_path / "ready.json"
    process = subprocess.Popen([sys.executable, "-m", "weightsync.server.cli", "--listen", "127.0.0.1:0",
                                "--devices", "cuda:0", "--ready-file", str(ready)])
    try:
        import json
        import time

        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        address = f"127.0.0.1:{json.loads(ready.read_text())['port']}"
        model = {k: v.cuda() for k, v in mixed_model(7).items()}
        with WeightSyncClient([address]) as client:
            client.create_group(backend="nccl", timeout=60)
            result = client.push(model, version="gpu-1", bucket_size_bytes=1 << 20)
            assert result.servers[0].generation == 1
            assert client.verify(model).ok
            result = client.push(model, version="gpu-2", mode="staged", bucket_size_bytes=1 << 20)
            assert client.verify(model).ok
    finally:
        process.terminate()
        assert process.wait(60) == 0
