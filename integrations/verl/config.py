"""VerlSyncConfig: weightsync's settings, read from verl's own checkpoint-engine config.

verl passes `actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsync` to the engine's
constructor as keyword arguments (with `bucket_size` and, on actor ranks, `is_master`), so the
settings are plain YAML values: every key and value is checked here (CONFIG_INVALID naming it),
before anything connects. No verl import here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

from weightsync.common.address import parse_address
from weightsync.integrations.verl.errors import WeightSyncVerlError

Transport = Literal["collective", "inline", "shm"]
Mode = Literal["staged", "in_place"]
Senders = Literal["auto", "all", "one"]
Receive = Literal["tensors", "served"]
RECEIVES = ("tensors", "served")
TRANSPORTS = ("collective", "inline", "shm")
SENDERS = ("auto", "all", "one")
ALL_SEND_TRANSPORTS = ("inline", "shm", "collective")
"""What the servers run an update sent by several ranks (parts) over: every transport (COLLECTIVE since
the servers take parts over a group of every part's rank and their workers)."""
MODES = ("staged", "in_place")
DELTAS = {"auto": "auto", True: True, False: False, "on": True, "off": False}


@dataclass(frozen=True, slots=True, kw_only=True)
class VerlSyncConfig:
    """Where the actor's weights go, and how the rollout finds them."""

    servers: tuple[str, ...]
    """The weightsync servers (host:port), one per rollout node: the sending actor rank pushes
    every step to all of them."""
    transport: Transport = "collective"
    """"collective" (Gloo/NCCL: a broadcast from the sending rank, or with senders "all" each
    rank's buckets point-to-point; the group made on the first sync), "inline" (bytes in the gRPC stream), "shm" (one server on the sender's host)."""
    token: str | None = None
    """Bearer token, when the servers have --token-file."""
    mode: Mode = "staged"
    """"staged": a failed sync leaves the node's committed version whole (the rollout keeps it);
    "in_place": no shadow copy, but a failed sync leaves the store inconsistent until the next."""
    delta: bool | str = "auto"
    """As the SDK's push(delta=...): "auto" (default), True/"on", False/"off"."""
    timeout_s: float = 120.0
    """Bound on every wait of a sync, in seconds (at most a day): each RPC; the other actor ranks and
    the rollout workers waiting for the senders' outcomes give up timeout_s after the senders' last
    sign of life (each sending rank beats while it sends: a long push is waited for as long as it
    goes on); the rollout reading the commit from its node, timeout_s after it."""
    node_server: str | None = None
    """The rollout side: the weightsync server on this rollout worker's node (its local socket
    is looked up from it); default: the first of `servers`."""
    outcome_host: str = "127.0.0.1"
    """Where actor rank 0's outcome store listens for the other actor ranks and the rollout workers:
    a name or address of rank 0's host they can reach (set it when they span hosts). One that does
    not resolve, or is not rank 0's host's, is CONFIG_INVALID at once."""
    senders: Senders = "auto"
    """"all": every actor rank pushes a share of each step (its own part of one version, through
    its own NIC; weightsync.client.Part), its whole tensors with delta, its DTensor shards dense;
    Over "shm" every actor rank must be on the host of the one server (each part writes its own run
    of the server's ingress slots). Over "collective" every actor rank joins one transfer group (the
    actor ranks, then the servers' workers; created on the first sync, kept across syncs, made again
    after a failed one) and sends its buckets point-to-point; it needs torch.distributed initialized
    on every actor rank (verl's actor workers do), its world being the actor ranks.
    "one": actor rank 0 pushes everything, with delta.
    "auto" (default): "all" over "inline" (every actor NIC sends), else "one" (over "shm" no NIC is
    shared, and the ranks share the host's memory bandwidth: name "all" to have each rank write its
    own share; over "collective" rank 0's broadcast sends each byte once whatever the number of
    servers, while a part sends its share point-to-point to each server: name "all" when the actor
    ranks outnumber the servers)."""

    receive: Receive = "tensors"
    """The rollout side. "tensors" (default): receive_weights yields the committed version's tensors
    (the node's store, mapped) and verl's server adapter loads them. "served" (driver mode): the node's
    weightsync server drives the engine itself (--engine vllm-http=URL / sglang-http=URL) after each
    commit, and receive_weights yields nothing: it returns once that engine serves the step (bounded
    by timeout_s), or raises ENGINE_FAILED / VERSION_NOT_SERVED."""
    engine: str | None = None
    """Driver mode: the name of the engine the rollout waits for (GetServerInfo.engines); default: the
    node server's only driven engine."""

    @property
    def all_send(self) -> bool:
        """Every actor rank pushes its share (senders "all", or "auto" over "inline")."""
        return self.senders == "all" or (self.senders == "auto" and self.transport == "inline")

    @staticmethod
    def from_engine_kwargs(**kwargs: Any) -> VerlSyncConfig:
        """Checked: an unknown key or a wrong value raises WeightSyncVerlError(CONFIG_INVALID) naming it."""
        known = {f.name for f in fields(VerlSyncConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise _invalid(f"{', '.join(unknown)}: not a key weightsync reads; its keys are {', '.join(sorted(known))}")
        return VerlSyncConfig(
            servers=_servers(kwargs.get("servers")), transport=_choice(kwargs, "transport", TRANSPORTS),
            token=_token(kwargs.get("token")), mode=_choice(kwargs, "mode", MODES), delta=_delta(kwargs.get("delta", "auto")),
            timeout_s=_timeout(kwargs.get("timeout_s", 120.0)), node_server=_node_server(kwargs.get("node_server")),
            outcome_host=_host(kwargs.get("outcome_host", "127.0.0.1")), senders=_choice(kwargs, "senders", SENDERS),
            receive=_choice(kwargs, "receive", RECEIVES), engine=_engine(kwargs.get("engine")))


MAX_TIMEOUT_S = 86400.0
"""timeout_s at most a day: a bound longer than that bounds nothing."""


def _invalid(message: str) -> WeightSyncVerlError:
    return WeightSyncVerlError("CONFIG_INVALID", f"engine_kwargs.weightsync.{message}")


def _address(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise _invalid(f"{what} must be host:port strings, got {value!r}")
    try:
        parse_address(value, what="server address")
    except ValueError as error:
        raise _invalid(f"{what}: {error}") from None
    return value


def _servers(value: object) -> tuple[str, ...]:
    if value is None or (isinstance(value, Sequence) and not isinstance(value, str) and not value):
        raise _invalid("servers is required (host:port of each rollout node's weightsync server)")
    if isinstance(value, str):
        return (_address(value, "servers"),)
    if not isinstance(value, Sequence):  # a list from YAML (OmegaConf's ListConfig is a Sequence too)
        raise _invalid(f"servers must be a list of host:port, got {type(value).__name__}")
    return tuple(_address(item, "servers") for item in value)


def _node_server(value: object) -> str | None:
    return None if value is None else _address(value, "node_server")


def _choice(kwargs: dict[str, Any], key: str, choices: tuple[str, ...]) -> Any:
    value = kwargs.get(key, VerlSyncConfig.__dataclass_fields__[key].default)
    if not isinstance(value, str) or value not in choices:
        raise _invalid(f"{key} must be one of {choices}, got {value!r}")
    return value


def _delta(value: object) -> bool | str:
    key = value.lower() if isinstance(value, str) else value
    if not isinstance(key, bool | str) or key not in DELTAS:
        raise _invalid(f"delta must be auto, on/true or off/false, got {value!r}")
    return DELTAS[key]


def _timeout(value: object) -> float:
    try:
        seconds = float(value) if isinstance(value, int | float | str) and not isinstance(value, bool) else math.nan
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_TIMEOUT_S:  # NaN and infinity fail here too
        raise _invalid(f"timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {value!r}")
    return seconds


def _token(value: object) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not all(33 <= ord(c) <= 126 for c in value):
        raise _invalid("token must be a string of printable ASCII without spaces (the servers' bearer token), "
                       f"got a {type(value).__name__}" + (" with other characters" if isinstance(value, str) else ""))
    return value


def _host(value: object) -> str:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise _invalid(f"outcome_host must be a host name or address, got {value!r}")
    return value


def _engine(value: object) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise _invalid(f"engine must be an engine's name, got {value!r}")
    return value
