"""WeightSyncConfig: where TRL's weights go, and how, instead of vLLM's NCCL engine.

Given to the trainer (`GRPOTrainer(..., weightsync=WeightSyncConfig(...))`) or read from the
environment when it is not (`WEIGHTSYNC_SERVER=host:port`, ...), so that switching a script
to weightsync is its import line alone. No TRL import here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from weightsync.client.types import TlsConfig
from weightsync.common.address import parse_address
from weightsync.common.layout import DEFAULT_BUCKET_BYTES

Transport = Literal["collective", "inline", "shm"]
TRANSPORTS = ("collective", "inline", "shm")
DELTAS = {"auto": "auto", "on": True, "off": False}
"""WEIGHTSYNC_DELTA's words for WeightSyncConfig.delta."""
DTYPES = ("auto", "bfloat16", "float16", "float32")
ENV_PREFIX = "WEIGHTSYNC_"


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightSyncConfig:
    """How the trainer's weights reach the vLLM that TRL generates with."""

    server: str
    """The weightsync server (host:port) started with `--engine vllm-http=<the vLLM URL TRL uses>`."""
    transport: Transport = "collective"
    """"collective" (a Gloo/NCCL broadcast: a trainer on another host), "shm" (the server's
    shared memory: trainer and server on one host), "inline" (bytes in the gRPC stream: through
    proxies). Every push is STAGED: vLLM gets all of a step's weights or none of them."""
    timeout_s: float = 120.0
    """Bound on each wait of a sync: the transfer group's timeout, every RPC, and vLLM taking up
    the committed version. A dead server or engine is an error within it, never a hang."""
    token: str | None = None
    """Bearer token, when the server has --token-file."""
    tls: TlsConfig | None = None
    engine: str | None = None
    """Name of the engine in GetServerInfo.engines that serves TRL's generations; by default the
    server's vllm-http engine whose URL is TRL's vLLM server."""
    dtype: str = "auto"
    """Cast to this before pushing; "auto": the dtype vLLM serves (its /server_info), so the
    bytes pushed are the bytes vLLM holds."""
    version_prefix: str = "step-"
    """Each sync is the version f"{version_prefix}{trainer.state.global_step}"."""
    bucket_size_bytes: int = DEFAULT_BUCKET_BYTES
    delta: Literal["auto"] | bool = "auto"
    """What each sync sends (the SDK's push(delta=...)): "auto" only what changed since the last
    sync where that pays (the SDK keeps a copy of the last synced weights: the model's size again,
    on the weights' device); False every weight, streamed tensor by tensor once the layout is
    known (an FSDP trainer never holds the whole cast model at once); True patches wherever smaller."""

    def __post_init__(self) -> None:
        parse_address(self.server, what="weightsync server address")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.bucket_size_bytes <= 0:
            raise ValueError(f"bucket_size_bytes must be positive, got {self.bucket_size_bytes!r}")
        if self.delta not in ("auto", True, False):
            raise ValueError(f"delta must be 'auto', True or False, got {self.delta!r}")

    @staticmethod
    def from_env(environ: Mapping[str, str] | None = None) -> WeightSyncConfig:
        """WEIGHTSYNC_SERVER (required), WEIGHTSYNC_TRANSPORT, WEIGHTSYNC_TIMEOUT_S, WEIGHTSYNC_TOKEN,
        WEIGHTSYNC_ENGINE, WEIGHTSYNC_DTYPE, WEIGHTSYNC_DELTA (auto, on, off); ValueError naming the
        variable that is wrong."""
        env = os.environ if environ is None else environ
        server = env.get(ENV_PREFIX + "SERVER", "").strip()
        if not server:
            raise ValueError(f"{ENV_PREFIX}SERVER is not set: give the trainer weightsync=WeightSyncConfig(server="
                             "'host:port') or set it to the weightsync server that drives TRL's vLLM")
        fields: dict = {"server": server}
        for name, key in (("transport", "TRANSPORT"), ("token", "TOKEN"), ("engine", "ENGINE"),
                          ("dtype", "DTYPE")):
            value = env.get(ENV_PREFIX + key, "").strip()
            if value:
                fields[name] = value
        delta = env.get(ENV_PREFIX + "DELTA", "").strip()
        if delta:
            if delta not in DELTAS:
                raise ValueError(f"{ENV_PREFIX}DELTA must be one of {', '.join(DELTAS)}, got {delta!r}")
            fields["delta"] = DELTAS[delta]
        timeout = env.get(ENV_PREFIX + "TIMEOUT_S", "").strip()
        if timeout:
            try:
                fields["timeout_s"] = float(timeout)
            except ValueError:
                raise ValueError(f"{ENV_PREFIX}TIMEOUT_S must be a number of seconds, got {timeout!r}") from None
        try:
            return WeightSyncConfig(**fields)
        except ValueError as error:
            raise ValueError(f"from the {ENV_PREFIX}* environment: {error}") from None
