"""Security: loopback by default, bearer token, TLS and mTLS, no pickle/eval.

Three real 1-worker CPU servers, one per module-scoped fixture (token, TLS,
mTLS); every test talks real gRPC to them. Certificates are generated at test
time (tests/certs.py).
"""

from __future__ import annotations

import ast
import fcntl
import io
import ipaddress
import re
import socket
import struct
import subprocess
import sys
import time
import tokenize
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from weightsync.client.errors import WeightSyncRpcError
from weightsync.client.sdk import TlsConfig, WeightSyncClient
from weightsync.server.config import ServerConfig, config_from_args
from weightsync.v1 import weight_sync_service_pb2 as pb

from certs import Pki, make_pki
from helpers import ServerProcess, error_info, shm_segments, start_server

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token-0123456789abcdef"
SERVICE = "weightsync.v1.WeightSyncService"


# -- fixtures -------------------------------------------------------------------------
def _segments_of(pid: int) -> set[str]:
    """The /dev/shm segments a process has mapped (other test sessions may share this machine's /dev/shm)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {line.rsplit("/", 1)[1] for line in maps.splitlines() if "/dev/shm/psm_" in line}


def _run_server(tmp_path: Path, *args: str):
    server = start_server(tmp_path, *args, workers=1)
    try:
        owned = _segments_of(server.process.pid)
        assert owned, "the server should own its worker queues' segments"
        yield server
    finally:
        code = server.stop()
        assert code == 0, server.log()
    assert owned & shm_segments() == set(), "the server left shared-memory segments behind"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def token_files(tmp_path_factory) -> tuple[str, str]:
    directory = tmp_path_factory.mktemp("tokens")
    right = directory / "token"
    right.write_text(TOKEN + "\n")  # trailing newline: the server strips it
    wrong = directory / "wrong-token"
    wrong.write_text("not-the-token\n")
    return str(right), str(wrong)


@pytest.fixture(scope="module")
def token_server(tmp_path_factory, token_files) -> ServerProcess:
    yield from _run_server(tmp_path_factory.mktemp("token-server"), "--token-file", token_files[0])


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, pki) -> ServerProcess:
    yield from _run_server(
        tmp_path_factory.mktemp("tls-server"), "--tls-cert", pki.server_cert, "--tls-key", pki.server_key,
    )


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory, pki) -> ServerProcess:
    yield from _run_server(
        tmp_path_factory.mktemp("mtls-server"), "--tls-cert", pki.server_cert, "--tls-key", pki.server_key,
        "--tls-client-ca", pki.ca_cert,
    )


# -- helpers ------------------------------------------------------------------------
def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _small_state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(6)
    return {
        "layer.weight": torch.randn(16, 8, generator=g),
        "layer.bias": torch.randn(8, generator=g).to(torch.bfloat16),
        "step": torch.tensor(42, dtype=torch.int64),
    }


def _push_and_verify(client: WeightSyncClient, version: str) -> None:
    """The whole control + data path through one client: group, push, verify, delete."""
    state = _small_state_dict()
    client.create_group(timeout=30)
    try:
        result = client.push(state, version=version)
        assert result.version == version
        assert result.tensor_count == len(state)
        assert [s.version for s in result.servers] == [version]
        check = client.verify(state)
        assert check.ok, check.mismatches
        assert check.checked == len(state)
    finally:
        client.delete_group()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "weightsync.client.cli.main", *args],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )


def _assert_cli_failed_cleanly(result: subprocess.CompletedProcess, *expected: str) -> None:
    assert result.returncode != 0, result
    lines = result.stderr.strip("\n").splitlines()
    assert len(lines) == 1, f"expected exactly one stderr line, got:\n{result.stderr}"
    for text in expected:
        assert text in lines[0], lines[0]
    assert "Traceback" not in result.stderr


def _assert_unauthenticated(error: grpc.RpcError) -> None:
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error
    info = error_info(error)
    assert info.reason == "TOKEN_INVALID"
    assert info.domain == "weightsync"
    assert TOKEN not in (error.details() or "")


def _list_services(channel: grpc.Channel, metadata=()) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    responses = list(stub.ServerReflectionInfo(iter([request]), metadata=metadata, timeout=10))
    assert len(responses) == 1
    return [s.name for s in responses[0].list_services_response.service]


def _local_ipv4_addresses() -> list[str]:
    """Every IPv4 address configured on this machine's interfaces (Linux SIOCGIFADDR)."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(probe.fileno(), 0x8915, request)  # SIOCGIFADDR
            except OSError:
                continue  # no IPv4 address on this interface
            found.append(socket.inet_ntoa(answer[20:24]))
    return found


def _listening_addresses(port: int) -> list[str]:
    """Local addresses of every TCP socket in LISTEN state on this port (/proc/net/tcp{,6})."""
    out = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, _, hex_port = fields[1].partition(":")
            if fields[3] != "0A" or int(hex_port, 16) != port:
                continue
            raw = bytes.fromhex(address)
            # The kernel prints each 32-bit word in host (little-endian) order.
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            ip = ipaddress.ip_address(words if width == 32 else words[:4])
            if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
                ip = ip.ipv4_mapped
            out.append(str(ip))
    return out


def _refused(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=3):
            return False
    except OSError:
        return True


# -- 1. binding ---------------------------------------------------------------------
def test_default_listen_address_is_loopback():
    assert config_from_args([], env={}).listen == "127.0.0.1:50051"
    assert ServerConfig().listen == "127.0.0.1:50051"
    # --listen (or WEIGHTSYNC_LISTEN) is the only way off loopback.
    assert config_from_args([], env={"WEIGHTSYNC_LISTEN": "0.0.0.0:1"}).listen == "0.0.0.0:1"
    assert config_from_args(["--listen", "127.0.0.1:0"], env={"WEIGHTSYNC_LISTEN": "0.0.0.0:1"}).listen == "127.0.0.1:0"


def test_loopback_server_listens_on_loopback_only(token_server):
    port = token_server.port
    assert _listening_addresses(port) == ["127.0.0.1"]
    assert not _refused("127.0.0.1", port)
    assert _refused("127.0.0.2", port)  # another loopback address: not bound either


def test_loopback_server_unreachable_on_other_local_addresses(token_server):
    others = [a for a in _local_ipv4_addresses() if not ipaddress.ip_address(a).is_loopback]
    if not others:
        pytest.skip("this machine has only loopback addresses")
    for address in others:
        assert _refused(address, token_server.port), f"server reachable on {address}"
        channel = grpc.insecure_channel(f"{address}:{token_server.port}")
        with pytest.raises(grpc.RpcError) as caught:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        channel.close()


# -- 2. bearer token ----------------------------------------------------------------
def test_missing_token_is_unauthenticated(token_server):
    with pytest.raises(grpc.RpcError) as caught:
        token_server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    _assert_unauthenticated(caught.value)


def test_unknown_method_without_token_reveals_nothing(token_server):
    channel = token_server.channel()
    try:
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary("/weightsync.v1.WeightSyncService/NoSuchMethod")(b"", timeout=10)
        _assert_unauthenticated(caught.value)
    finally:
        channel.close()


@pytest.mark.parametrize(
    "value",
    [
        "Bearer not-the-token",
        f"Bearer {TOKEN[:-1]}",  # a prefix
        f"Bearer {TOKEN}x",  # an extension
        f"Bearer {TOKEN.upper()}",
        TOKEN,  # no scheme
        f"Basic {TOKEN}",
        "Bearer ",
        "",
    ],
    ids=["wrong", "prefix", "extended", "case", "no-scheme", "basic", "empty-bearer", "empty"],
)
def test_wrong_token_is_unauthenticated(token_server, value):
    with pytest.raises(grpc.RpcError) as caught:
        token_server.stub().GetServerInfo(pb.GetServerInfoRequest(), metadata=(("authorization", value),), timeout=10)
    _assert_unauthenticated(caught.value)


def test_right_token_is_accepted(token_server):
    info = token_server.stub().GetServerInfo(pb.GetServerInfoRequest(), metadata=_bearer(TOKEN), timeout=10)
    assert [w.index for w in info.workers] == [0]


def test_streaming_methods_need_the_token(token_server):
    stub = token_server.stub()
    with pytest.raises(grpc.RpcError) as caught:
        next(iter(stub.WatchWeights(pb.WatchWeightsRequest(), timeout=10)))
    _assert_unauthenticated(caught.value)
    begin = pb.UpdateWeightsRequest(begin=pb.BeginUpdate(group_id="nope", version="v"))
    with pytest.raises(grpc.RpcError) as caught:
        next(iter(stub.UpdateWeights(iter([begin]), metadata=_bearer("wrong"), timeout=10)))
    _assert_unauthenticated(caught.value)
    # With the token, the same stream reaches the servicer (which refuses the unknown group).
    with pytest.raises(grpc.RpcError) as caught:
        next(iter(stub.UpdateWeights(iter([begin]), metadata=_bearer(TOKEN), timeout=10)))
    assert caught.value.code() != grpc.StatusCode.UNAUTHENTICATED


def test_health_is_open_without_token(token_server):
    health = health_pb2_grpc.HealthStub(token_server.channel())
    deadline = time.monotonic() + 30
    while True:
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
        if status == health_pb2.HealthCheckResponse.SERVING or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert status == health_pb2.HealthCheckResponse.SERVING
    named = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
    assert named.status == health_pb2.HealthCheckResponse.SERVING
    # A wrong token does not break the probe either.
    assert health.Check(health_pb2.HealthCheckRequest(), metadata=_bearer("wrong"), timeout=10).status == status


def test_reflection_needs_the_token(token_server):
    channel = token_server.channel()
    for metadata in ((), _bearer("wrong")):
        with pytest.raises(grpc.RpcError) as caught:
            _list_services(channel, metadata)
        _assert_unauthenticated(caught.value)
    services = _list_services(channel, _bearer(TOKEN))
    assert SERVICE in services
    assert "grpc.health.v1.Health" in services


def test_sdk_wrong_token_raises_unauthenticated(token_server):
    with WeightSyncClient(token_server.address, token="wrong", timeout=10) as client:
        with pytest.raises(WeightSyncRpcError) as caught:
            client.server_info()
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert caught.value.reason == "TOKEN_INVALID"
    assert caught.value.server == token_server.address
    with WeightSyncClient(token_server.address, timeout=10) as client:  # no token at all
        with pytest.raises(WeightSyncRpcError) as caught:
            client.server_info()
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_sdk_right_token_pushes_and_verifies(token_server):
    with WeightSyncClient(token_server.address, token=TOKEN, timeout=30) as client:
        (info,) = client.server_info()
        assert len(info.workers) == 1
        _push_and_verify(client, "token-v1")


def test_cli_token(token_server, token_files):
    right, wrong = token_files
    failed = _cli("info", "--server", token_server.address, "--token-file", wrong, "--timeout", "10")
    _assert_cli_failed_cleanly(failed, "UNAUTHENTICATED")
    assert "not-the-token" not in failed.stderr + failed.stdout
    assert "the token in --token-file is not the server's" in failed.stderr
    missing = _cli("info", "--server", token_server.address, "--timeout", "10")
    _assert_cli_failed_cleanly(missing, "UNAUTHENTICATED")
    assert "pass --token-file" in missing.stderr
    ok = _cli("info", "--server", token_server.address, "--token-file", right, "--timeout", "10")
    assert ok.returncode == 0, ok.stderr
    assert token_server.address in ok.stdout
    assert ok.stderr == ""


def test_cli_plaintext_against_tls_says_pass_tls_ca(tls_server):
    failed = _cli("info", "--server", tls_server.address, "--timeout", "5")
    _assert_cli_failed_cleanly(failed, "UNAVAILABLE")
    assert "if the server speaks TLS, pass --tls-ca" in failed.stderr


def test_token_never_reaches_the_server_log(token_server):
    # Runs after the token tests above (module order): every refused and accepted call is logged by now.
    assert TOKEN not in token_server.log()


def test_auth_and_tls_flags_fail_closed(tmp_path):
    """Misconfiguration refuses to start instead of silently serving without auth or TLS."""
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        config_from_args(["--token-file", str(empty)], env={})
    with pytest.raises(FileNotFoundError):
        config_from_args(["--token-file", str(tmp_path / "missing")], env={})
    token = tmp_path / "token"
    token.write_text(f"  {TOKEN}\n")
    assert config_from_args([], env={"WEIGHTSYNC_TOKEN_FILE": str(token)}).token == TOKEN
    assert TOKEN not in repr(config_from_args(["--token-file", str(token)], env={}))
    with pytest.raises(ValueError):
        config_from_args(["--tls-cert", "server.pem"], env={})  # no key
    with pytest.raises(ValueError):
        config_from_args(["--tls-key", "server.key"], env={})  # no cert
    with pytest.raises(ValueError):
        config_from_args(["--tls-client-ca", "ca.pem"], env={})  # mTLS without TLS


# -- 3. constant-time compare ----------------------------------------------------------
def test_interceptor_uses_constant_time_compare():
    source = (REPO / "server" / "rpc" / "interceptors.py").read_text()
    assert "hmac.compare_digest" in source
    calls = [
        node for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "compare_digest"
        and isinstance(node.func.value, ast.Name) and node.func.value.id == "hmac"
    ]
    assert calls, "the token check must call hmac.compare_digest (constant time)"


# -- 4. TLS and mTLS ------------------------------------------------------------------
def _sdk_error(address: str, tls: TlsConfig | None) -> WeightSyncRpcError:
    with WeightSyncClient(address, tls=tls, timeout=10) as client:
        with pytest.raises(WeightSyncRpcError) as caught:
            client.server_info()
    return caught.value


def test_tls_client_trusting_the_ca_pushes_and_verifies(tls_server, pki):
    with WeightSyncClient(tls_server.address, tls=TlsConfig(ca_cert=pki.ca_cert), timeout=30) as client:
        _push_and_verify(client, "tls-v1")


def test_tls_server_name_localhost(tls_server, pki):
    with WeightSyncClient(f"localhost:{tls_server.port}", tls=TlsConfig(ca_cert=pki.ca_cert), timeout=10) as client:
        (info,) = client.server_info()
    assert len(info.workers) == 1


def test_tls_refuses_plaintext_client(tls_server):
    assert _sdk_error(tls_server.address, None).code == grpc.StatusCode.UNAVAILABLE


def test_tls_client_trusting_another_ca_fails(tls_server, pki):
    assert _sdk_error(tls_server.address, TlsConfig(ca_cert=pki.other_ca_cert)).code == grpc.StatusCode.UNAVAILABLE


def test_tls_client_with_wrong_server_name_fails(tls_server, pki):
    tls = TlsConfig(ca_cert=pki.ca_cert, server_name="not-the-server.example")
    assert _sdk_error(tls_server.address, tls).code == grpc.StatusCode.UNAVAILABLE


def test_mtls_refuses_client_without_certificate(mtls_server, pki):
    assert _sdk_error(mtls_server.address, TlsConfig(ca_cert=pki.ca_cert)).code == grpc.StatusCode.UNAVAILABLE


def test_mtls_refuses_client_certificate_from_another_ca(mtls_server, pki):
    tls = TlsConfig(ca_cert=pki.ca_cert, client_cert=pki.other_client_cert, client_key=pki.other_client_key)
    assert _sdk_error(mtls_server.address, tls).code == grpc.StatusCode.UNAVAILABLE


def test_mtls_refuses_plaintext_client(mtls_server):
    assert _sdk_error(mtls_server.address, None).code == grpc.StatusCode.UNAVAILABLE


def test_mtls_client_with_right_certificate_pushes_and_verifies(mtls_server, pki):
    tls = TlsConfig(ca_cert=pki.ca_cert, client_cert=pki.client_cert, client_key=pki.client_key)
    with WeightSyncClient(mtls_server.address, tls=tls, timeout=30) as client:
        _push_and_verify(client, "mtls-v1")


def test_mtls_cli(mtls_server, pki):
    common = ("info", "--server", mtls_server.address, "--tls-ca", pki.ca_cert, "--timeout", "10")
    failed = _cli(*common)
    _assert_cli_failed_cleanly(failed, "UNAVAILABLE")
    ok = _cli(*common, "--tls-cert", pki.client_cert, "--tls-key", pki.client_key)
    assert ok.returncode == 0, ok.stderr
    assert mtls_server.address in ok.stdout


# -- 5. no pickle, no unsafe torch.load, no eval/exec ----------------------------------
SCANNED = ("server", "gpu_worker", "client", "common")

# Matched against code with comments and string literals removed.
FORBIDDEN_TEXT = {
    "import pickle": re.compile(r"\bimport\s+(c|_)?pickle\b|\bfrom\s+(c|_)?pickle\b"),
    "pickle.": re.compile(r"pickle\."),
    "cPickle": re.compile(r"cPickle"),
    "eval(": re.compile(r"(?<![\w.])eval\s*\("),
    "exec(": re.compile(r"(?<![\w.])exec\s*\("),
    "marshal.loads": re.compile(r"\bmarshal\.loads?\b"),
    "allow_pickle=True": re.compile(r"allow_pickle\s*=\s*True"),
    "multiprocessing.Queue": re.compile(r"\bmultiprocessing\.(Simple|Joinable)?Queue\b"),
    "mp.Queue": re.compile(r"\bmp\.(Simple|Joinable)?Queue\b"),
    "multiprocessing.Pipe/Manager": re.compile(r"\b(multiprocessing|mp)\.(Pipe|Manager)\b"),
    "Pipe(": re.compile(r"(?<!\w)Pipe\s*\("),
    "Manager(": re.compile(r"(?<!\w)Manager\s*\("),
}
PICKLING_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "shelve"}
MP_PICKLING = {"Queue", "SimpleQueue", "JoinableQueue", "Pipe", "Manager"}
THREAD_QUEUES = {"asyncio", "queue", "janus"}


def _code_only(source: str) -> str:
    """The source with comments and string literals (docstrings included) blanked out, in place."""
    lines = source.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    chars = list(source)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (tokenize.COMMENT, tokenize.STRING):
            continue
        begin = starts[token.start[0] - 1] + token.start[1]
        end = starts[token.end[0] - 1] + token.end[1]
        for i in range(begin, end):
            if chars[i] != "\n":
                chars[i] = " "
    return "".join(chars)


def _is_true(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_constructs(source: str) -> list[str]:
    """Every forbidden construct in one module's source, as "line: what"."""
    found = []
    for line in _code_only(source).splitlines():
        for what, pattern in FORBIDDEN_TEXT.items():
            if pattern.search(line):
                found.append(f"{what!r} in: {line.strip()}")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PICKLING_MODULES:
                    found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            root = node.module.split(".")[0]
            if root in PICKLING_MODULES:
                found.append(f"{node.lineno}: from {node.module} import ...")
            if root == "multiprocessing" and {a.name for a in node.names} & MP_PICKLING:
                found.append(f"{node.lineno}: from {node.module} import {[a.name for a in node.names]}")
            if root == "torch" and any(a.name == "load" for a in node.names):
                found.append(f"{node.lineno}: from torch import load")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "load" and isinstance(func.value, ast.Name) \
                    and func.value.id == "torch":
                if not any(k.arg == "weights_only" and _is_true(k.value) for k in node.keywords):
                    found.append(f"{node.lineno}: torch.load without weights_only=True")
            elif isinstance(func, ast.Attribute) and func.attr in MP_PICKLING \
                    and not (isinstance(func.value, ast.Name) and func.value.id in THREAD_QUEUES):
                found.append(f"{node.lineno}: {ast.unparse(func)}() (a multiprocessing queue pickles)")
            elif isinstance(func, ast.Name) and func.id in ("eval", "exec", "__import__"):
                found.append(f"{node.lineno}: {func.id}()")
    return found


def _scanned_files() -> list[Path]:
    files = [
        path for folder in SCANNED for path in sorted((REPO / folder).rglob("*.py"))
        if "_pb2" not in path.name and ".venv" not in path.parts
    ]
    return files


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "import cPickle as p",
        "from pickle import loads",
        "import cloudpickle",
        "x = cloudpickle.loads(b)",
        "obj = eval(text)",
        "exec(code)",
        "import marshal\nmarshal.loads(b)",
        "import torch\ntorch.load(path)",
        "import torch\ntorch.load(path, weights_only=False)",
        "import multiprocessing\nq = multiprocessing.Queue()",
        "import multiprocessing as mp\nq = mp.Queue()",
        "import multiprocessing as mp\nq = mp.get_context('spawn').SimpleQueue()",
        "ctx = get_ctx()\nq = ctx.Queue()",
        "from multiprocessing import Pipe\na, b = Pipe()",
        "from multiprocessing import (\n    Manager,\n)",
        "m = Manager()",
        "import numpy as np\nnp.load(f, allow_pickle=True)",
    ],
)
def test_scanner_catches_unsafe_constructs(snippet):
    assert unsafe_constructs(snippet), snippet


def test_scanner_allows_safe_constructs():
    safe = '''
"""No pickle. crosses the boundary; never eval(x) or torch.load(p)."""
import asyncio
import queue
import torch
from multiprocessing import shared_memory
# pickle.loads would be bad; so would mp.Queue() and Pipe()
q = asyncio.Queue()
r = queue.Queue(maxsize=3)
model.eval()
w = torch.load(path, weights_only=True, map_location="cpu")
t = ast.literal_eval("1")
s = "exec(x)"
'''
    assert unsafe_constructs(safe) == []


def test_no_pickle_eval_or_unsafe_load_in_sources():
    files = _scanned_files()
    assert {p.relative_to(REPO).parts[0] for p in files} == set(SCANNED)
    assert len(files) >= 10
    problems = []
    for path in files:
        for problem in unsafe_constructs(path.read_text(encoding="utf-8")):
            problems.append(f"{path.relative_to(REPO)}: {problem}")
    assert problems == [], "\n".join(problems)
