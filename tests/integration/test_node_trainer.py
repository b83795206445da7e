"""A trainer in another language. examples/node (Node.js, @grpc/grpc-js) pushes a real
safetensors file over INLINE to a real server, with WS64 computed in JavaScript.

The bytes the node store holds are read back through the engine hand-off (the store mapped
read-only) and compared with the file's tensors exactly; versions are checked by label and
generation. Every refused or abandoned update is followed by a normal one, checked the same
way. `make test` installs examples/node's pinned packages (npm ci) first.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weightsync.client import TlsConfig, WeightSyncClient
from weightsync.common.checksum import ws64
from weightsync.engine import EngineClient
from weightsync.v1 import weight_sync_service_pb2 as pb

from certs import make_pki
from helpers import ServerProcess, running_server

NODE_DIR = Path(__file__).resolve().parents[2] / "examples" / "node"
NODE = shutil.which("node")
TOKEN = "node-trainer-token-0123456789"
BUCKET_BYTES = 1 << 20
# Not a multiple of 8: chunk boundaries split WS64 words, and every bucket takes several chunks.
CHUNK_BYTES = 300_001
# Smaller than the largest bucket (1.6 MB): the server streams it through its slots in pieces.
SLOT_BYTES = 512 << 10

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(NODE is None, reason="node (Node.js) is not on PATH"),
]

Model = dict[str, torch.Tensor]


def model(seed: int) -> Model:
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


def run_trainer(server: ServerProcess | str, path: Path, version: str, *extra: str) -> subprocess.CompletedProcess:
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.fail(f"{NODE_DIR}/node_modules is missing: run `npm ci` in examples/node (make test does)")
    address = server if isinstance(server, str) else server.address
    return subprocess.run([NODE, str(NODE_DIR / "trainer.js"), "--server", address, "--file", str(path),
                           "--version", version, "--bucket-bytes", str(BUCKET_BYTES),
                           "--chunk-bytes", str(CHUNK_BYTES), "--json", *extra],
                          capture_output=True, text=True, timeout=120)


def summary(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def refusal(result: subprocess.CompletedProcess) -> tuple[str, dict]:
    """The error line on stderr and the {"error": ...} JSON on stdout of a refused push."""
    assert result.returncode == 1, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0], json.loads(result.stdout)["error"]


def published(server: ServerProcess) -> tuple[str, int, int]:
    info = server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    return info.current_version.version, info.current_version.generation, info.store_state


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8) if tensor.numel() else tensor


def held_by_the_store(server: ServerProcess, tensors: Model) -> str:
    """The node's store, mapped read-only as an engine maps it, holds exactly these bytes; returns the label."""
    with EngineClient(server=server.address, name="") as engine, engine.acquire() as snapshot:
        assert set(snapshot.tensors) == set(tensors)
        for name, tensor in tensors.items():
            held = snapshot.tensors[name]
            assert (held.dtype, held.shape) == (tensor.dtype, tensor.shape), name
            assert torch.equal(raw_bytes(held), raw_bytes(tensor)), name
        return snapshot.version.version


def assert_holds(server: ServerProcess, tensors: Model, version: str, generation: int) -> None:
    assert published(server) == (version, generation, pb.STORE_STATE_CONSISTENT)
    assert held_by_the_store(server, tensors) == version


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("node-trainer"), "--ingress-slot-bytes", str(SLOT_BYTES)) as server:
        yield server


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[Path, Model]]:
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for seed, label in enumerate(("v1", "v2", "v3", "v4"), start=1):
        tensors = model(seed)
        save_file(tensors, str(root / f"{label}.safetensors"), metadata={"format": "pt"})
        out[label] = (root / f"{label}.safetensors", tensors)
    return out


def test_javascript_ws64_equals_python(tmp_path):
    samples = {
        "empty": b"",
        "short": bytes(range(5)),
        "three_rows": bytes((i * 37) & 0xFF for i in range(512 * 8 * 3 + 13)),
        "ones": b"\xff" * (8 * 1025),
        # 4-row blocks (the fast loop), then a partial row and a partial word
        "random": os.urandom(512 * 8 * 11 + 4099),
    }
    for name, raw in samples.items():
        (tmp_path / name).write_bytes(raw)
    result = subprocess.run([NODE, str(NODE_DIR / "lib" / "ws64.js"), *(str(tmp_path / n) for n in samples)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    for name, raw in samples.items():
        expected = str(ws64(torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)))
        assert got[str(tmp_path / name)] == dict.fromkeys(("fast", "fast_unaligned", "pieces", "reference"), expected), name


def test_push_versions_abandon_then_push_again(node, files):
    base = published(node)[1]  # the module's node: another test may have pushed first
    path, tensors = files["v1"]
    first = summary(run_trainer(node, path, "v1", "--allow-new-tensors"))
    assert (first["aborted"], first["version"], first["generation"]) == (False, "v1", base + 1)
    assert (first["tensors"], first["buckets"], first["tensorsVerified"]) == (8, 3, 8)
    assert first["bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert first["chunks"] > first["buckets"]  # several chunks per bucket
    assert_holds(node, tensors, "v1", base + 1)

    path, tensors = files["v2"]
    second = summary(run_trainer(node, path, "v2", "--mode", "in_place", "--tensor-checksums"))
    assert (second["version"], second["generation"], second["fastPathBuckets"]) == ("v2", base + 2, 3)
    assert_holds(node, tensors, "v2", base + 2)

    # A STAGED update abandoned once 1 of its 3 buckets was applied: nothing changes, by the
    # trainer's own check too. First with an `abort` message, then by cancelling the call.
    path3, _ = files["v3"]
    aborted = summary(run_trainer(node, path3, "v3", "--abort-after-buckets", "1"))
    assert aborted == {"aborted": True, "abortBy": "abort", "bucketsSent": 1, "bucketsApplied": 1, "status": "ABORTED",
                       "reason": "ABORTED_BY_CLIENT", "unchanged": True, "version": "v2", "generation": base + 2,
                       "storeState": "STORE_STATE_CONSISTENT"}
    assert_holds(node, tensors, "v2", base + 2)
    cancelled = summary(run_trainer(node, path3, "v3", "--abort-after-buckets", "2", "--abort-by", "cancel"))
    assert (cancelled["status"], cancelled["bucketsApplied"], cancelled["unchanged"]) == ("CANCELLED", 2, True)
    assert_holds(node, tensors, "v2", base + 2)

    # The next normal push lands exactly.
    path, tensors = files["v3"]
    third = summary(run_trainer(node, path, "v3"))
    assert (third["version"], third["generation"]) == ("v3", base + 3)
    assert_holds(node, tensors, "v3", base + 3)


def test_a_wrong_bucket_checksum_is_refused_and_changes_nothing(node, files):
    path, previous = files["v3"]  # a version of its own first: the module's node may still be empty
    summary(run_trainer(node, path, "v3", "--allow-new-tensors"))
    label, generation, _ = published(node)
    path, tensors = files["v4"]
    line, error = refusal(run_trainer(node, path, "v4-bad", "--corrupt-checksum-bucket", "1"))
    assert line.startswith("error: DATA_LOSS BUCKET_CHECKSUM_MISMATCH: bucket 1 arrived with WS64 "), line
    assert (error["code"], error["reason"], error["metadata"]["bucket"]) == ("DATA_LOSS", "BUCKET_CHECKSUM_MISMATCH", "1")
    assert_holds(node, previous, label, generation)

    assert summary(run_trainer(node, path, "v4"))["generation"] == generation + 1
    assert_holds(node, tensors, "v4", generation + 1)


def test_an_unknown_dtype_is_refused_before_anything_is_sent(node, tmp_path):
    before = published(node)
    header = json.dumps({"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    path = tmp_path / "complex.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    line, error = refusal(run_trainer(node, path, "complex", "--allow-new-tensors"))
    assert line == f'error: {path}: tensor "x" has dtype C64, which weightsync does not carry'
    assert error == {"message": line.removeprefix("error: ")}
    assert published(node) == before


def test_a_bad_token_is_refused_and_the_right_one_works_over_tls(tmp_path, files):
    pki = make_pki(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with running_server(tmp_path, "--token-file", str(token_file), "--tls-cert", pki.server_cert,
                        "--tls-key", pki.server_key, workers=1) as server:
        path, tensors = files["v1"]
        tls = ("--ca", pki.ca_cert, "--server-name", "localhost", "--allow-new-tensors")
        for token in ("not-the-token", None):
            line, error = refusal(run_trainer(server, path, "v1", *tls, *(("--token", token) if token else ())))
            assert line == "error: UNAUTHENTICATED TOKEN_INVALID: missing or invalid bearer token"
            assert (error["code"], error["reason"]) == ("UNAUTHENTICATED", "TOKEN_INVALID")
        pushed = summary(run_trainer(server, path, "v1", *tls, "--token", TOKEN))
        assert (pushed["version"], pushed["generation"], pushed["tensorsVerified"]) == ("v1", 1, len(tensors))
        with WeightSyncClient(server.address, token=TOKEN, tls=TlsConfig(ca_cert=pki.ca_cert), timeout=30) as client:
            info = client.server_info()[0]
            assert (info.current_version.version, info.current_version.generation) == ("v1", 1)
            verified = client.verify(tensors)
            assert (verified.ok, verified.checked) == (True, len(tensors))


def test_a_hand_written_file_with_misaligned_and_tiny_tensors(tmp_path):
    """Offsets no writer of safetensors would pick: a bucket is cut wherever a tensor would sit
    misaligned, a 3-byte bucket is padded to 8, a hole between tensors travels as padding."""
    tensors = {
        "a": torch.tensor([1, 2, 250], dtype=torch.uint8),
        "b": torch.tensor([1.5, -2.25], dtype=torch.float32),
        "c": torch.tensor([-7], dtype=torch.int16),
        "d": torch.tensor(3.125, dtype=torch.float64),
    }
    places = {"a": 0, "b": 3, "c": 11, "d": 16}  # bytes 13..16 are a hole
    data = bytearray(24)
    header = {}
    for name, tensor in tensors.items():
        raw = tensor.numpy().tobytes()
        data[places[name]:places[name] + len(raw)] = raw
        dtype = {torch.uint8: "U8", torch.float32: "F32", torch.int16: "I16", torch.float64: "F64"}[tensor.dtype]
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [places[name], places[name] + len(raw)]}
    encoded = json.dumps(header).encode()
    path = tmp_path / "odd.safetensors"
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + bytes(data))
    with running_server(tmp_path, workers=2) as server:
        pushed = summary(run_trainer(server, path, "odd", "--tensor-checksums"))
        assert (pushed["generation"], pushed["buckets"], pushed["bytes"], pushed["tensorsVerified"]) == (1, 3, 8 + 10 + 8, 4)
        assert_holds(server, tensors, "odd", 1)


def test_a_server_that_stores_a_subset_gets_only_the_buckets_holding_its_tensors(tmp_path, files):
    """--tensors on the server: the trainer announces the other buckets without their bytes
    (UpdateReady.not_stored_buckets), and checks only what the server stores."""
    path, tensors = files["v1"]
    subset = {n: t for n, t in tensors.items() if n.startswith("layers.")}
    with running_server(tmp_path, "--ingress-slot-bytes", str(SLOT_BYTES), "--tensors", r"^layers\.") as server:
        pushed = summary(run_trainer(server, path, "v1", "--allow-new-tensors"))
        assert (pushed["version"], pushed["tensors"], pushed["tensorsVerified"]) == ("v1", 8, len(subset))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        assert sum(t.numel() * t.element_size() for t in subset.values()) <= pushed["bytes"] < total
        assert_holds(server, subset, "v1", 1)
