"""VerlSyncConfig: weightsync's settings, read from verl's own checkpoint-engine config.

verl passes `rollout.checkpoint_engine.engine_kwargs.weightsync` to the engine's constructor as
keyword arguments (with `bucket_size` and, on actor ranks, `is_master`), so the settings are
plain YAML values. No verl import here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

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
    """Bound on every wait of a sync: each RPC, the sender's outcome on the other actor ranks,
    the rollout waiting for the step to be committed on its node."""
    node_server: str | None = None
    """The rollout side: the weightsync server on this rollout worker's node (its local socket
    is looked up from it); default: the first of `servers`."""
    outcome_host: str = "127.0.0.1"
    """Where the sending actor rank's outcome store listens for the other actor ranks: an
    address of its host they can reach (set it when the actor spans hosts)."""
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
    def from_engine_kwargs(*, servers: Sequence[str] | str | None = None, transport: str = "collective",
                           token: str | None = None, mode: str = "staged", delta: bool | str = "auto",
                           timeout_s: float = 120.0, node_server: str | None = None,
                           outcome_host: str = "127.0.0.1", senders: str = "auto", receive: str = "tensors",
                           engine: str | None = None) -> VerlSyncConfig:
        """Checked: a wrong value raises WeightSyncVerlError(CONFIG_INVALID) naming it."""
        if servers is None or (not isinstance(servers, str) and not list(servers)):
            raise WeightSyncVerlError("CONFIG_INVALID", "engine_kwargs.weightsync.servers is required "
                                      "(host:port of each rollout node's weightsync server)")
        addresses = (servers,) if isinstance(servers, str) else tuple(str(s) for s in servers)
        for address in (*addresses, *([node_server] if node_server else [])):
            try:
                parse_address(address, what="server address")
            except ValueError as error:
                raise WeightSyncVerlError("CONFIG_INVALID", f"engine_kwargs.weightsync: {error}") from None
        if transport not in TRANSPORTS:
            raise WeightSyncVerlError("CONFIG_INVALID", f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if mode not in MODES:
            raise WeightSyncVerlError("CONFIG_INVALID", f"mode must be one of {MODES}, got {mode!r}")
        if isinstance(delta, str):
            delta = delta.lower()
        if delta not in DELTAS:
            raise WeightSyncVerlError("CONFIG_INVALID", f"delta must be auto, on/true or off/false, got {delta!r}")
        if senders not in SENDERS:
            raise WeightSyncVerlError("CONFIG_INVALID", f"senders must be one of {SENDERS}, got {senders!r}")
        if receive not in RECEIVES:
            raise WeightSyncVerlError("CONFIG_INVALID", f"receive must be one of {RECEIVES}, got {receive!r}")
        if engine is not None and (not isinstance(engine, str) or not engine):
            raise WeightSyncVerlError("CONFIG_INVALID", f"engine must be an engine's name, got {engine!r}")
        if not float(timeout_s) > 0:
            raise WeightSyncVerlError("CONFIG_INVALID", f"timeout_s must be positive, got {timeout_s!r}")
        return VerlSyncConfig(servers=addresses, transport=transport, token=token or None, mode=mode,  # type: ignore[arg-type]
                              delta=DELTAS[delta], timeout_s=float(timeout_s), node_server=node_server,
                              outcome_host=outcome_host, senders=senders, receive=receive,  # type: ignore[arg-type]
                              engine=engine)
