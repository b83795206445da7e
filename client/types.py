"""What the SDK takes and returns: plain frozen dataclasses."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsConfig:
    """TLS for the gRPC channels. Paths to PEM files."""

    ca_cert: str | None = None
    """CA bundle that signed the server certificate; None uses the system roots."""
    client_cert: str | None = None
    """Client certificate chain, for mutual TLS."""
    client_key: str | None = None
    """Client private key, for mutual TLS."""
    server_name: str | None = None
    """Override the name checked against the server certificate."""


@dataclass(frozen=True, slots=True)
class StoreGeneration:
    """A committed generation of one server's store: the generation counts within its store epoch
    (a restarted server's store has a new epoch and counts again from 0)."""

    store_epoch: int
    generation: int


@dataclass(frozen=True, slots=True)
class ServerOutcome:
    """What one server reported for a push."""

    server: str
    version: str
    generation: int
    size_bytes: int
    seconds: float
    fast_path_buckets: int
    store_epoch: int = 0
    """The store the generation counts in (WeightVersion.store_epoch)."""

    @property
    def committed(self) -> StoreGeneration:
        return StoreGeneration(self.store_epoch, self.generation)


@dataclass(frozen=True, slots=True)
class PushResult:
    """A committed push."""

    version: str
    tensor_count: int
    bucket_count: int
    size_bytes: int
    """Bytes the trainer sent to each server (one copy per node, whatever its worker count)."""
    seconds: float
    """From push() call to the last Committed."""
    plan_reused: bool
    zero_copy_buckets: int
    """Buckets broadcast straight from the caller's storage (flat parameters)."""
    servers: tuple[ServerOutcome, ...]
    bytes_sent: int = 0
    """Bytes this push put on the link to each server: with delta, the patches and the changed
    tensors, less what compressing buckets of patches saved (compressed_bytes)."""
    dense_bytes: int = 0
    """What the whole model, dense, would have moved (0 when not known: a streamed push)."""
    compressed_bytes: int = 0
    """Plan bytes that went as zstd frames (buckets of patches on a slow Gloo link), before compression."""

    @property
    def gigabytes_per_second(self) -> float:
        return self.size_bytes / self.seconds / 1e9 if self.seconds else 0.0


@dataclass(frozen=True, slots=True)
class PushProgress:
    """Reported to the progress callback after each bucket is on its way."""

    bucket: int
    bucket_count: int
    bytes_sent: int
    total_bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class TensorMismatch:
    """A tensor whose checksum in a server's store differs from the local one."""

    server: str
    name: str
    local: int
    remote: int | None
    """None when the server does not hold the tensor."""


@dataclass(frozen=True, slots=True)
class VerifyResult:
    checked: int
    """Tensors compared, per server (its one node store)."""
    mismatches: tuple[TensorMismatch, ...]

    @property
    def ok(self) -> bool:
        return not self.mismatches
