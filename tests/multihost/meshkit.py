"""weightsync on a netns mesh: certificates for the node addresses, servers, and the trainer.

    with Cluster(tmp_dir) as cluster:        # mesh + mTLS PKI + a server per node + the trainer
        cluster.trainer.call("create_group", timeout=10)
        cluster.trainer.call("push", seed=1, version="v1", mode="staged")

Used by the tests (conftest.py) and by demo.py. Everything started here runs inside a mesh
namespace and is stopped (servers: SIGTERM, checked for exit 0) when the cluster closes; the
mesh then kills whatever is left and removes the namespaces.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from netns import Host, Mesh

from weightsync.common.ownership import bucket_owners
from weightsync.engine.client import EngineClient

HERE = Path(__file__).resolve().parent
TRAINER_SCRIPT = HERE / "trainer.py"
SERVER_PORT = 50051
NODES = ("node-a", "node-b")

# The tests' settings, in seconds: every group's collective timeout, the SDK's per-RPC timeout,
# the servers' INLINE transfer timeout, and the slack allowed on 2 loaded cores for "within the
# timeout" assertions. The transfer timeout (--transfer-timeout-seconds) is how long a server
# waits for a client's next bytes, counted from its last complete bucket; it is what ends the
# update of a node cut off mid-INLINE-push (nothing else tells it the trainer gave up), so it is
# scaled down like the rest (the default, 60 s), and kept above the SDK's timeout, so that the
# SDK gives up on the silent node before the healthy one, which it stops feeding meanwhile, gives
# up on the SDK (see test_inline_cut_names_the_silent_node for the other order).
GROUP_TIMEOUT = 5.0
RPC_TIMEOUT = 6.0
TRANSFER_TIMEOUT = 10.0
MARGIN = 4.0

MEASURED: dict[str, object] = {}
"""What the tests measured; conftest.py prints it at the end of the run."""


# -- what a node should hold ---------------------------------------------------------------------
def owned_bytes(bucket_sizes: list[int], workers: int) -> list[int]:
    """Bytes each worker of a node receives when a plan has these buckets: each bucket goes to its
    one owner (common/ownership.py), so the workers' shares add up to the bytes pushed, once."""
    shares = [0] * workers
    for size, owner in zip(bucket_sizes, bucket_owners(bucket_sizes, workers), strict=True):
        shares[owner] += size
    return shares


def read_store(socket_path: str, name: str = "multihost-check") -> tuple[str, dict[str, torch.Tensor]]:
    """The committed version and a copy of every tensor of a node's store, read through its local
    socket as an engine reads them (the memfd arenas, mapped read-only; the lease released at once)."""
    with EngineClient(socket_path=socket_path, name=name, timeout=30) as engine:
        snapshot = engine.acquire(wait=30)
        try:
            return snapshot.version.version, {n: t.clone() for n, t in snapshot.tensors.items()}
        finally:
            snapshot.release(applied=False)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


# -- mTLS material: one server certificate per node, its mesh IP as the SAN ----------------------
@dataclass(frozen=True)
class MeshPki:
    ca_cert: str
    client_cert: str
    client_key: str
    servers: dict[str, tuple[str, str]]
    """role -> (certificate, key)"""


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "weightsync multihost tests"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _sign(subject: str, issuer: x509.Name, public_key, signing_key, *, ca: bool = False,
          server_ip: str | None = None, client: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer).public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
    )
    if server_ip is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(server_ip))]),
                                        critical=False)
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    if client:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return builder.sign(signing_key, hashes.SHA256())


def _write_cert(path: Path, cert: x509.Certificate) -> str:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> str:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    return str(path)


def make_mesh_pki(directory: Path, node_ips: dict[str, str]) -> MeshPki:
    """A CA, a client certificate for the trainer, and per node a server certificate whose only
    SAN is that node's IP: a server is only trusted at its own mesh address."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _sign("multihost test CA", _name("multihost test CA"), ca_key.public_key(), ca_key, ca=True)
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _sign("trainer", ca.subject, client_key.public_key(), ca_key, client=True)
    servers = {}
    for role, ip in node_ips.items():
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _sign(role, ca.subject, key.public_key(), ca_key, server_ip=ip)
        servers[role] = (_write_cert(directory / f"{role}.pem", cert), _write_key(directory / f"{role}.key", key))
    return MeshPki(
        ca_cert=_write_cert(directory / "ca.pem", ca),
        client_cert=_write_cert(directory / "trainer.pem", client),
        client_key=_write_key(directory / "trainer.key", client_key),
        servers=servers,
    )


# -- a server in a node's namespace -------------------------------------------------------------
@dataclass
class MeshServer:
    host: Host
    process: subprocess.Popen
    log_path: Path

    @property
    def address(self) -> str:
        return f"{self.host.ip}:{SERVER_PORT}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
            return -9


def start_mesh_server(mesh: Mesh, role: str, pki: MeshPki, directory: Path, workers: int = 2,
                      transfer_timeout: float | None = TRANSFER_TIMEOUT) -> MeshServer:
    host = mesh.host(role)
    ready = directory / f"{role}.ready.json"
    log_path = directory / f"{role}.log"
    cert, key = pki.servers[role]
    argv = [sys.executable, "-m", "weightsync.server.cli", "--listen", f"{host.ip}:{SERVER_PORT}",
            "--workers", str(workers), "--device", "cpu", "--ready-file", str(ready),
            "--tls-cert", cert, "--tls-key", key, "--tls-client-ca", pki.ca_cert,
            # A path the tests (root namespace: unix sockets cross network namespaces) open to map the store.
            "--local-socket", str(directory / f"{role}.sock")]
    if transfer_timeout is not None:  # None: the server's default
        argv += ["--transfer-timeout-seconds", f"{transfer_timeout:g}"]
    with open(log_path, "wb") as log:
        process = mesh.popen(host, argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return MeshServer(host, process, log_path)


def wait_ready(server: MeshServer, directory: Path, timeout: float = 90.0) -> None:
    ready = directory / f"{server.host.role}.ready.json"
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.host.role}: server exited {server.process.returncode}:\n{server.log()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.host.role}: server not ready in {timeout:g} s:\n{server.log()[-3000:]}")
        time.sleep(0.05)
    assert json.loads(ready.read_text())["port"] == SERVER_PORT


# -- the trainer in the trainer's namespace --------------------------------------------------------
class TrainerError(AssertionError):
    pass


@dataclass
class Trainer:
    """trainer.py inside the trainer namespace: one JSON command in, one JSON answer out."""

    process: subprocess.Popen
    stderr_path: Path
    events: queue.Queue = field(default_factory=queue.Queue)

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                self.events.put(json.loads(line))
            except ValueError:
                continue
        self.events.put({"event": "exit"})

    def send(self, op: str, **fields: object) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.process.stdin.flush()

    def expect(self, *events: str, wait: float = 60.0) -> dict:
        """The next event; it must be one of `events` (an "error" or an exit fails, with stderr)."""
        try:
            got = self.events.get(timeout=wait)
        except queue.Empty:
            raise TrainerError(f"trainer: no {events} within {wait:g} s\n{self.stderr()}") from None
        if got["event"] not in events:
            raise TrainerError(f"trainer answered {got} while {events} was expected\n{self.stderr()}")
        return got

    def call(self, op: str, *, expect: str | tuple[str, ...] | None = None, wait: float = 60.0, **fields) -> dict:
        """Send a command and return its answer (`wait`: seconds to wait for it; other keyword
        arguments are the command's fields)."""
        self.send(op, **fields)
        wanted = (expect,) if isinstance(expect, str) else expect or (_ANSWERS[op],)
        return self.expect(*wanted, wait=wait)

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.send("quit")
                self.process.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(10)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


_ANSWERS = {"info": "info", "groups": "groups", "create_group": "group", "delete_group": "deleted",
            "delete_group_id": "deleted_id", "checksums": "checksums",
            "push": "pushed", "verify": "verified", "rtt": "rtt", "probe_without_client_cert": "probe",
            "quit": "bye"}


def start_trainer(mesh: Mesh, servers: list[MeshServer], pki: MeshPki, directory: Path,
                  rpc_timeout: float = 15.0) -> Trainer:
    stderr_path = directory / "trainer.err"
    argv = [sys.executable, str(TRAINER_SCRIPT), "--servers", ",".join(s.address for s in servers),
            "--ca", pki.ca_cert, "--cert", pki.client_cert, "--key", pki.client_key,
            "--rpc-timeout", str(rpc_timeout)]
    with open(stderr_path, "wb") as err:
        process = mesh.popen(mesh.host("trainer"), argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                             text=True, bufsize=1)
    trainer = Trainer(process, stderr_path)
    trainer.expect("started", wait=60)
    return trainer


# -- all of it ----------------------------------------------------------------------------------
@dataclass
class Cluster:
    """A mesh, its PKI, one 2-worker CPU server per node and the trainer; closes all of it."""

    directory: Path
    rpc_timeout: float = 15.0
    transfer_timeout: float | None = TRANSFER_TIMEOUT
    """The servers' --transfer-timeout-seconds (None: their default)."""
    mesh: Mesh = field(default_factory=Mesh)
    pki: MeshPki | None = None
    servers: dict[str, MeshServer] = field(default_factory=dict)
    trainer: Trainer | None = None
    startup_seconds: float = 0.0
    exit_codes: dict[str, int] = field(default_factory=dict)

    def __enter__(self) -> Cluster:
        started = time.monotonic()
        self.mesh.__enter__()
        try:
            self.pki = make_mesh_pki(self.directory / "pki", {r: self.mesh.host(r).ip for r in NODES})
            for role in NODES:  # both start at once: each takes seconds (workers import torch)
                self.servers[role] = start_mesh_server(self.mesh, role, self.pki, self.directory,
                                                       transfer_timeout=self.transfer_timeout)
            for server in self.servers.values():
                wait_ready(server, self.directory)
            self.trainer = start_trainer(self.mesh, list(self.servers.values()), self.pki, self.directory,
                                         self.rpc_timeout)
        except BaseException:
            self.close()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            if self.trainer is not None:
                self.trainer.close()
            for role, server in self.servers.items():
                self.exit_codes[role] = server.stop()
        finally:
            self.mesh.close()

    @property
    def store_port_peers(self) -> dict[str, list[tuple[str, int, str, int, str]]]:
        return {role: self.mesh.tcp_sockets(role) for role in self.mesh.hosts}
