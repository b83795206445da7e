"""Issue 11: a trainer in another language. examples/node (Node.js, @grpc/grpc-js) pushes a real
safetensors file over INLINE to a real server, with WS64 computed in JavaScript.

The bytes each worker holds are read back through the engine hand-off (the store mapped
read-only) and compared with the file's tensors exactly; versions are checked by label and
generation. `make test` installs examples/node's pinned packages (npm ci) first.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weightsync.common.checksum import ws64
from weightsync.engine import EngineClient
from weightsync.v1 import weight_sync_service_pb2 as pb

from helpers import running_server

NODE_DIR = Path(__file__).resolve().parents[1] / "examples" / "node"
NODE = shutil.which("node")
TOKEN = "node-trainer-token-0123456789"

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(NODE is None, reason="node (Node.js) is not on PATH"),
]


def model(seed: int) -> dict[str, torch.Tensor]:
    """Several dtypes, odd sizes, one tensor larger than a bucket, one empty."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(301, 67, generator=g),
        "layers.0.attn.q.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "layers.0.norm.weight": torch.randn(67, generator=g).to(torch.float16),
        "layers.0.mlp.up.weight": torch.randn(400_003, generator=g),
        "positions": torch.randint(-(2**40), 2**40, (13,), generator=g, dtype=torch.int64),
        "mask": torch.rand(9, generator=g) > 0.5,
        "scale": torch.randn(1, generator=g).to(torch.float64),
        "empty": torch.zeros(0, 5),
    }


def run_trainer(server, path: Path, version: str, *extra: str) -> subprocess.CompletedProcess:
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail(f"{NODE_DIR}/node_modules is missing: run `npm ci` there (make test does)")
    return subprocess.run([NODE, str(NODE_DIR / "trainer.js"), "--server", server.address, "--file", str(path),
                           "--version", version, "--bucket-bytes", str(1 << 20), "--json", *extra],
                          capture_output=True, text=True, timeout=120)


def summary(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def held_by_every_worker(server, tensors: dict[str, torch.Tensor], workers: int = 2) -> str:
    """Each worker's store, mapped read-only, holds exactly these bytes; returns the version label."""
    labels = set()
    for worker in range(workers):
        with EngineClient(server=server.address, name="", worker=worker) as engine, engine.acquire() as snapshot:
            labels.add(snapshot.version.version)
            for name, tensor in tensors.items():
                held = snapshot.tensors[name]
                assert (held.dtype, held.shape) == (tensor.dtype, tensor.shape), name
                assert torch.equal(held.view(torch.uint8) if held.numel() else held,
                                   tensor.view(torch.uint8) if tensor.numel() else tensor), f"worker {worker}: {name}"
    assert len(labels) == 1
    return labels.pop()


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("node-trainer")) as server:
        yield server


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for seed, label in enumerate(("v1", "v2", "v3", "v4"), start=1):
        tensors = model(seed)
        save_file(tensors, str(root / f"{label}.safetensors"), metadata={"format": "pt"})
        out[label] = (root / f"{label}.safetensors", tensors)
    return out


def test_javascript_ws64_equals_python(tmp_path):
    samples = {"empty": b"", "short": bytes(range(5)), "rows": bytes((i * 37) & 0xFF for i in range(512 * 8 * 3 + 13)),
               "ones": b"\xff" * (8 * 1025)}
    for name, raw in samples.items():
        (tmp_path / name).write_bytes(raw)
    result = subprocess.run([NODE, str(NODE_DIR / "lib" / "ws64.js"), *(str(tmp_path / n) for n in samples)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    for name, raw in samples.items():
        expected = str(ws64(torch.frombuffer(bytearray(raw), dtype=torch.uint8)) if raw else ws64(torch.empty(0, dtype=torch.uint8)))
        assert got[str(tmp_path / name)] == {"fast": expected, "fast_unaligned": expected, "reference": expected}, name


def test_push_versions_abort_then_push_again(node, files):
    path, tensors = files["v1"]
    first = summary(run_trainer(node, path, "v1", "--allow-new-tensors"))
    assert (first["aborted"], first["version"], first["generation"], first["verifiedWorkers"]) == (False, "v1", 1, 2)
    assert (first["tensors"], first["buckets"]) == (8, 3)
    assert held_by_every_worker(node, tensors) == "v1"

    path, tensors = files["v2"]
    second = summary(run_trainer(node, path, "v2", "--mode", "in_place", "--tensor-checksums"))
    assert (second["version"], second["generation"]) == ("v2", 2)
    assert held_by_every_worker(node, tensors) == "v2"

    # A STAGED update aborted after one of three buckets: nothing changes, by the trainer's own check too.
    path3, _ = files["v3"]
    aborted = summary(run_trainer(node, path3, "v3", "--abort-after-buckets", "1"))
    assert (aborted["aborted"], aborted["bucketsSent"], aborted["unchanged"]) == (True, 1, True)
    assert (aborted["version"], aborted["generation"], aborted["storeState"]) == ("v2", 2, "STORE_STATE_CONSISTENT")
    assert held_by_every_worker(node, tensors) == "v2"

    # The next normal push lands exactly.
    path, tensors = files["v3"]
    third = summary(run_trainer(node, path, "v3"))
    assert (third["version"], third["generation"]) == ("v3", 3)
    assert held_by_every_worker(node, tensors) == "v3"


def test_a_wrong_bucket_checksum_is_refused_and_changes_nothing(node, files):
    before = node.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10).current_version
    path, _ = files["v4"]
    refused = run_trainer(node, path, "v4-bad", "--corrupt-checksum-bucket", "1")
    assert refused.returncode == 1
    assert refused.stderr.startswith("error: DATA_LOSS BUCKET_CHECKSUM_MISMATCH: bucket 1 arrived with WS64 "), refused.stderr
    previous = {"v1": files["v1"][1], "v2": files["v2"][1], "v3": files["v3"][1]}[before.version]
    assert held_by_every_worker(node, previous) == before.version

    path, tensors = files["v4"]
    assert summary(run_trainer(node, path, "v4"))["generation"] == before.generation + 1
    assert held_by_every_worker(node, tensors) == "v4"


def test_a_bad_token_is_refused_and_the_right_one_works(tmp_path, files):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with running_server(tmp_path, "--token-file", str(token_file), workers=1) as server:
        path, tensors = files["v1"]
        refused = run_trainer(server, path, "v1", "--allow-new-tensors", "--token", "not-the-token")
        assert refused.returncode == 1
        assert refused.stderr.startswith("error: UNAUTHENTICATED "), refused.stderr
        missing = run_trainer(server, path, "v1", "--allow-new-tensors")
        assert missing.stderr.startswith("error: UNAUTHENTICATED "), missing.stderr
        pushed = summary(run_trainer(server, path, "v1", "--allow-new-tensors", "--token", TOKEN))
        assert (pushed["version"], pushed["generation"], pushed["verifiedWorkers"]) == ("v1", 1, 1)


def test_an_unknown_dtype_is_refused_before_anything_is_sent(node, tmp_path):
    header = json.dumps({"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    path = tmp_path / "complex.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    result = run_trainer(node, path, "complex", "--allow-new-tensors")
    assert result.returncode == 1
    assert result.stderr.strip() == f'error: {path}: tensor "x" has dtype C64, which weightsync does not carry'
