"""Server configuration: one frozen dataclass, read from flags and the environment at start-up."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from weightsync.common.address import parse_address
from weightsync.common.limits import DEFAULT_MAX_MESSAGE_BYTES
from weightsync.common.plan_validation import PlanLimits

ENV_PREFIX = "WEIGHTSYNC_"
ENGINE_SPEC_HELP = ("vllm-http=http://HOST:PORT or sglang-http=http://HOST:PORT"
                    "[?pause=retract|abort|in_place][&timeout_s=SECONDS]")
SGLANG_PAUSE_MODES = ("retract", "abort", "in_place")


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One --engine: which driver, the engine's base URL and the driver's options."""

    kind: str
    """vllm-http or sglang-http."""
    url: str
    """http(s)://HOST:PORT[/prefix], without a trailing slash or the options."""
    pause: str = "retract"
    """sglang-http: /pause_generation's mode while a version loads: retract (running requests go
    back to the queue and are recomputed on the new weights), abort (they end), in_place (they
    stay, with their KV cache of the old weights; the cache is not flushed)."""
    timeout_s: float = 300.0
    """sglang-http: longest wait for any one answer of SGLang."""


def parse_engine_spec(spec: str) -> EngineSpec:
    """KIND=URL[?options]; ValueError saying what is accepted."""
    kind, sep, rest = spec.partition("=")
    url, _, query = rest.partition("?")
    wrong = ValueError(f"--engine must be {ENGINE_SPEC_HELP}, got {spec!r}")
    if kind not in ("vllm-http", "sglang-http") or not sep or not url.startswith(("http://", "https://")) \
            or len(url.rstrip("/")) <= len("https://"):
        raise wrong
    if kind == "vllm-http":
        if query or "?" in rest:
            raise wrong
        return EngineSpec(kind, url.rstrip("/"))
    options: dict[str, str] = {}
    for item in query.split("&") if query else ():
        key, eq, value = item.partition("=")
        if not eq or key in options or key not in ("pause", "timeout_s"):
            raise ValueError(f"--engine {spec!r}: options are pause=retract|abort|in_place and timeout_s=SECONDS, "
                             f"each at most once; got {item!r}")
        options[key] = value
    pause = options.get("pause", "retract")
    if pause not in SGLANG_PAUSE_MODES:
        raise ValueError(f"--engine {spec!r}: pause must be one of {', '.join(SGLANG_PAUSE_MODES)}, got {pause!r}")
    try:
        timeout_s = float(options.get("timeout_s", "300"))
    except ValueError:
        timeout_s = float("nan")
    if not 0 < timeout_s <= 3600:
        raise ValueError(f"--engine {spec!r}: timeout_s must be seconds in (0, 3600], got {options['timeout_s']!r}")
    return EngineSpec(kind, url.rstrip("/"), pause=pause, timeout_s=timeout_s)


@dataclass(kw_only=True, slots=True, frozen=True)
class ServerConfig:
    """Everything the server needs; validated on construction."""

    listen: str = "127.0.0.1:50051"
    """host:port to bind; 127.0.0.1 unless told otherwise. Port 0 picks a free one."""
    devices: tuple[str, ...] = ("cpu", "cpu")
    """One worker per entry: "cpu" or "cuda:N"."""
    max_tensors: int = 200_000
    """Most tensors one plan may list."""
    max_plan_bytes: int = 1 << 40
    """Most bytes one update may move."""
    max_bucket_bytes: int = 4 << 30
    """Most bytes in one bucket."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest gRPC message accepted or sent (plans travel in one message)."""
    queue_capacity_bytes: int = 48 << 20
    """Ring size of each server<->worker shared-memory queue."""
    worker_memory_limit_bytes: int = 0
    """Cap on one worker's store, shadows and staging buffer; 0: no per-worker cap."""
    host_memory_limit_bytes: int = 0
    """Cap on what all CPU workers' stores and buffers hold together; 0: only MemAvailable."""
    host_memory_reserve_bytes: int = 256 << 20
    """Host memory an update must leave free (for the server, engines, the OS)."""
    ingress_slot_bytes: int = 64 << 20
    """Bytes per ingress slot: the largest SHM bucket (INLINE buckets stream through the slots). 0 disables both."""
    ingress_slot_count: int = 2
    """Ingress slots: INLINE and SHM keep this many buckets in flight."""
    transfer_timeout_seconds: float = 60.0
    """INLINE/SHM: longest wait for the client's next bytes, or for the workers to apply a bucket."""
    local_socket: str = "auto"
    """Unix socket for engines and SHM trainers; "auto": <tmpdir>/weightsync-<pid>.sock; "": none."""
    local_allow_uids: tuple[int, ...] = ()
    """Other uids the local socket serves (the server's own always)."""
    engine_lease_timeout_seconds: float = 30.0
    """Longest an update waits for engines to finish reading the bytes it would write."""
    engines: tuple[str, ...] = ()
    """Engines the server drives after each commit, as KIND=URL[?options] (parse_engine_spec; e.g.
    vllm-http=http://127.0.0.1:8000, sglang-http=http://127.0.0.1:30000?pause=abort)."""
    shutdown_grace_seconds: float = 10.0
    """SIGTERM: how long a running update may take to finish before it is aborted."""
    worker_call_timeout_seconds: float = 120.0
    """Longest a non-collective worker command may take before the worker is restarted."""
    log_level: str = "info"
    """structlog level."""
    token: str = field(default="", repr=False)
    """Bearer token required on every RPC but health; empty disables auth."""
    token_file: str = ""
    """Where the token was read from (SIGHUP reads it again)."""
    health_listen: str = ""
    """host:port of a plaintext port serving only grpc.health.v1.Health (probes when --listen has TLS)."""
    metrics_listen: str = ""
    """host:port of plaintext HTTP /metrics (Prometheus); empty: off."""
    tls_cert: str = ""
    """PEM certificate chain file; enables TLS with tls_key."""
    tls_key: str = ""
    """PEM private key file."""
    tls_client_ca: str = ""
    """PEM CA bundle: when set, clients must present a certificate it signed (mTLS)."""
    tensors: str = ""
    """A regex (Python re.search): this node stores, and receives, only the tensors whose name it
    matches (engines that span nodes by pipeline or expert parallelism); empty: every tensor."""

    def __post_init__(self) -> None:
        parse_address(self.listen, allow_port_zero=True, what="listen")
        for name in ("health_listen", "metrics_listen"):
            if getattr(self, name):
                parse_address(getattr(self, name), allow_port_zero=True, what=name.replace("_", "-"))
        if not self.devices:
            raise ValueError("at least one worker device is required")
        for device in self.devices:
            if device != "cpu" and not (device.startswith("cuda:") and device[5:].isdigit()):
                raise ValueError(f"device must be 'cpu' or 'cuda:N', got {device!r}")
        gpus = [d for d in self.devices if d != "cpu"]
        repeated = sorted({d for d in gpus if gpus.count(d) > 1})
        if repeated:
            raise ValueError(f"device {repeated[0]} is listed {gpus.count(repeated[0])} times: one worker per GPU "
                             "(NCCL refuses two ranks of a group on one GPU); list each GPU once")
        for name in ("max_tensors", "max_plan_bytes", "max_bucket_bytes", "max_message_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.queue_capacity_bytes < 1 << 16:
            raise ValueError(f"queue_capacity_bytes must be at least 65536, got {self.queue_capacity_bytes}")
        if self.queue_capacity_bytes < self.max_message_bytes + 4096:
            raise ValueError(
                f"queue_capacity_bytes ({self.queue_capacity_bytes}) must exceed max_message_bytes "
                f"({self.max_message_bytes}) so a full plan fits in one worker command"
            )
        if self.ingress_slot_bytes < 0 or (self.ingress_slot_bytes and self.ingress_slot_count < 2):
            raise ValueError(f"ingress needs slot bytes >= 0 and at least 2 slots, got {self.ingress_slot_bytes} "
                             f"x {self.ingress_slot_count}")
        for spec in self.engines:
            parse_engine_spec(spec)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mTLS) needs tls_cert and tls_key")
        try:
            re.compile(self.tensors)
        except re.error as error:
            raise ValueError(f"--tensors is not a regular expression ({error}): {self.tensors!r}") from None

    @property
    def limits(self) -> PlanLimits:
        return PlanLimits(
            max_tensors=self.max_tensors,
            max_plan_bytes=self.max_plan_bytes,
            max_bucket_bytes=self.max_bucket_bytes,
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightsync-server",
        description="Serve weight updates to per-device worker processes. "
        f"Every flag can also be set as {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}LISTEN).",
    )
    parser.add_argument("--listen", help="host:port (default 127.0.0.1:50051)")
    parser.add_argument("--devices", help="comma-separated devices, e.g. cuda:0,cuda:1")
    parser.add_argument("--workers", type=int, help="number of workers on --device")
    parser.add_argument("--device", help="device for --workers (cpu or cuda)")
    parser.add_argument("--max-tensors", type=int)
    parser.add_argument("--max-plan-bytes", type=int)
    parser.add_argument("--max-bucket-bytes", type=int)
    parser.add_argument("--max-message-bytes", type=int)
    parser.add_argument("--queue-capacity-bytes", type=int)
    parser.add_argument("--worker-memory-limit-bytes", type=int)
    parser.add_argument("--host-memory-limit-bytes", type=int)
    parser.add_argument("--host-memory-reserve-bytes", type=int)
    parser.add_argument("--ingress-slot-bytes", type=int, help="bytes per ingress slot: the largest SHM bucket (INLINE buckets stream through slots); 0 disables both")
    parser.add_argument("--ingress-slot-count", type=int)
    parser.add_argument("--transfer-timeout-seconds", type=float)
    parser.add_argument("--local-socket", help='unix socket for engines and SHM trainers ("auto", a path, or "")')
    parser.add_argument("--local-allow-uid", type=int, action="append", help="another uid the local socket serves")
    parser.add_argument("--engine-lease-timeout-seconds", type=float)
    parser.add_argument("--engine", action="append",
                        help=f"an engine to drive after each commit: {ENGINE_SPEC_HELP} (repeatable)")
    parser.add_argument("--shutdown-grace-seconds", type=float)
    parser.add_argument("--log-level")
    parser.add_argument("--token-file", help="file holding the bearer token clients must send (SIGHUP re-reads it)")
    parser.add_argument("--health-listen", help="host:port of a plaintext health-only gRPC port (for probes)")
    parser.add_argument("--metrics-listen", help="host:port of Prometheus /metrics (plaintext HTTP)")
    parser.add_argument("--tls-cert")
    parser.add_argument("--tls-key")
    parser.add_argument("--tls-client-ca")
    parser.add_argument("--tensors", metavar="REGEX",
                        help="store and receive only the tensors whose name matches (re.search); default: all")
    return parser


def config_from_args(argv: Sequence[str] | None, env: Mapping[str, str] | None = None) -> ServerConfig:
    """Flags win over environment variables, which win over defaults."""
    env = os.environ if env is None else env
    args = build_parser().parse_args(argv)

    def pick(flag: str) -> str | None:
        value = getattr(args, flag)
        if value is not None:
            return str(value)
        return env.get(ENV_PREFIX + flag.upper())

    values: dict[str, object] = {}
    if (listen := pick("listen")) is not None:
        values["listen"] = listen
    devices = pick("devices")
    workers = pick("workers")
    device = pick("device") or "cpu"
    if devices and workers:
        raise ValueError("give either --devices or --workers/--device, not both")
    if devices:
        values["devices"] = tuple(d.strip() for d in devices.split(",") if d.strip())
    elif workers:
        count = int(workers)
        if count < 1:
            raise ValueError(f"--workers must be at least 1, got {count}")
        values["devices"] = tuple(
            device if device == "cpu" else f"cuda:{i}" for i in range(count)
        ) if device in ("cpu", "cuda") else tuple(device for _ in range(count))
    for name, cast in (
        ("max_tensors", int),
        ("max_plan_bytes", int),
        ("max_bucket_bytes", int),
        ("max_message_bytes", int),
        ("queue_capacity_bytes", int),
        ("worker_memory_limit_bytes", int),
        ("host_memory_limit_bytes", int),
        ("host_memory_reserve_bytes", int),
        ("ingress_slot_bytes", int),
        ("ingress_slot_count", int),
        ("transfer_timeout_seconds", float),
        ("engine_lease_timeout_seconds", float),
        ("shutdown_grace_seconds", float),
    ):
        raw = pick(name)
        if raw is not None:
            values[name] = cast(raw)
    if (level := pick("log_level")) is not None:
        values["log_level"] = level
    if (path := pick("local_socket")) is not None:
        values["local_socket"] = path
    if args.local_allow_uid:
        values["local_allow_uids"] = tuple(args.local_allow_uid)
    elif env.get(ENV_PREFIX + "LOCAL_ALLOW_UID"):
        values["local_allow_uids"] = tuple(int(u) for u in env[ENV_PREFIX + "LOCAL_ALLOW_UID"].split(","))
    if args.engine:
        values["engines"] = tuple(args.engine)
    elif env.get(ENV_PREFIX + "ENGINE"):
        values["engines"] = tuple(e.strip() for e in env[ENV_PREFIX + "ENGINE"].split(",") if e.strip())
    token_file = pick("token_file")
    if token_file:
        values["token"] = read_token(token_file)
        values["token_file"] = token_file
    for name in ("health_listen", "metrics_listen"):
        if (raw := pick(name)) is not None:
            values[name] = raw
    for name in ("tls_cert", "tls_key", "tls_client_ca", "tensors"):
        if (raw := pick(name)) is not None:
            values[name] = raw
    return ServerConfig(**values)  # type: ignore[arg-type]


def read_token(path: str) -> str:
    """The bearer token in a token file (--token-file; read again at each SIGHUP reload)."""
    with open(path, encoding="utf-8") as handle:
        token = handle.read().strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def check_devices(devices: tuple[str, ...]) -> None:
    """Fail fast, before binding, when a device does not exist on this host."""
    cuda = [d for d in devices if d.startswith("cuda")]
    if not cuda:
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for device in cuda:
        index = int(device.split(":", 1)[1])
        if index >= count:
            have = f"{count} CUDA device(s)" if count else "no CUDA (torch sees no GPU)"
            raise ValueError(
                f"device {device} does not exist: this host has {have}; on a CPU host use --workers N --device cpu"
            )


def max_chunk_bytes(config: ServerConfig) -> int:
    """Largest BucketChunk payload: a message's limit minus room for its other fields."""
    return max(1, config.max_message_bytes - (64 << 10))
