"""weightsync as vLLM's trainer-side weight-transfer backend: a trainer switches by its init info alone.

vLLM 0.32's trainer API (vllm.distributed.weight_transfer):

    from vllm.distributed.weight_transfer import (HTTPVLLMWeightSyncClient, ModuleSource,
                                                  WeightTransferTrainerFactory)
    from weightsync.engine.vllm_trainer import WeightSyncTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(servers=["node1:50051"], rank=0),
        client=HTTPVLLMWeightSyncClient("http://node1:8000"), source=ModuleSource(model))
    for step in training:
        ...
        engine.send_weights()

vLLM is started with `--weight-transfer-config '{"backend": "weightsync"}'` (the worker side,
engine/vllm_backend.py); the plugin (engine/vllm_plugin.py) registers both sides under "weightsync".

trainer_init (every trainer rank): the ranks that push get an SDK client; rank 0 asks vLLM to
attach every one of its ranks to the node's store (init_weight_transfer_engine with the
server's local socket, which rank 0 looks up over gRPC, TLS and token included).

send_weights (every trainer rank), one version:
  1. push: the source's tensors go through the SDK to every server and are committed. One
     trainer (trainer_ranks 1): rank 0 pushes the whole model; the other ranks iterate the
     source alongside (iterating is a collective for FSDP's full_tensor()), as vLLM's contract
     says. A sharded trainer (trainer_ranks N): every rank is a part (client/parts/part.py) and
     pushes what it holds (its WeightSource's held names; DTensors as their local boxes).
  2. rank 0 has vLLM load the committed version: start_weight_update, then update_weights
     {"phase": "prepare"} (each vLLM rank pins it and stages it beside the live model while
     vLLM keeps generating; rank 0 waits until each rank's engine record leaves APPLYING),
     update_weights {"phase": "apply"} (the swap: vLLM's pause), finish_weight_update(label).
     prepare=False: one update_weights that loads in the pause.

Failures are WeightSyncTransferError with a machine-readable reason: the push's own
(SERVER_UNREACHABLE, TENSOR_SHAPE_MISMATCH, ...), vLLM's refusal of the version
(TENSOR_NOT_IN_MODEL, VERSION_GONE, ...: vLLM keeps serving what it served), ENGINE_UNREACHABLE
(vLLM does not answer), PREPARE_TIMEOUT. The next send_weights starts over: it attaches vLLM
again where vLLM restarted (or the server did) and loads every tensor into a restarted vLLM.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from weightsync.client import Part, TlsConfig, WeightSyncClient
from weightsync.client.errors import WeightSyncClientError
from weightsync.common.address import parse_address
from weightsync.common.logging import get_logger
from weightsync.engine.vllm_plugin import BACKEND
from weightsync.v1 import weight_sync_service_pb2 as pb

log = get_logger("weightsync.engine.vllm_trainer")

TRANSPORTS = ("inline", "shm", "collective")
MODES = ("in_place", "staged")
READY_POLL_SECONDS = 0.01
_REASON = re.compile(r"\b([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+): ")
RECONNECT_REASONS = frozenset({"NOT_INITIALIZED", "SERVER_UNREACHABLE", "NOT_ATTACHED", "CONNECTION_CLOSED"})
"""vLLM's answers that mean its ranks are not attached to the node's current server (vLLM or the server
restarted): rank 0 attaches them again and asks once more."""


class WeightSyncTransferError(RuntimeError):
    """A send_weights that did not leave vLLM serving the pushed version. `reason` is machine-readable;
    `pushed` says whether the servers committed it (vLLM then still serves the version before)."""

    def __init__(self, reason: str, message: str, *, pushed: bool) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.detail = message
        self.pushed = pushed


@dataclass
class WeightSyncTrainerInitInfo(TrainerInitInfo):
    """The trainer side of the "weightsync" backend (WeightTransferTrainerFactory.trainer_init)."""

    backend: ClassVar[str] = BACKEND

    servers: list[str] = field(default_factory=list)
    """The weightsync servers (host:port) every version goes to: one per inference node."""
    engine_server: str = ""
    """The server on vLLM's node (one of `servers`; default the first): vLLM's ranks read its store."""
    token: str = ""
    """The servers' bearer token, if they have one (vLLM's ranks attach with it too)."""
    tls: TlsConfig | None = None
    """TLS for the gRPC channels (client/types.py: TlsConfig)."""
    transport: str = "inline"
    """How the bytes travel: "inline" (any network), "shm" (the trainer on the server's host),
    "collective" (a Gloo/NCCL group; one trainer only: trainer_init creates it)."""
    delta: bool | str = "auto"
    """Send only what changed since the last commit (client/delta/base.py): "auto", True or False."""
    mode: str = "in_place"
    """"in_place" or "staged" (an aborted push leaves the committed weights untouched)."""
    trainer_ranks: int = 1
    """1: rank 0 alone pushes the whole model. N > 1: the trainer is sharded in N ranks and each
    pushes its part (client/parts/part.py); every rank calls trainer_init and send_weights."""
    part_group: Any = None
    """With trainer_ranks > 1: a torch.distributed group of exactly those ranks (client/parts/part.py's
    Part.group), or None (the parts then agree through the servers alone)."""
    engine_name: str = "vllm"
    """The name vLLM's ranks attach as (NAME, NAME:tp1, ...: GetServerInfo.engines). prepare needs one."""
    prepare: bool = True
    """Stage each version in vLLM's ranks while vLLM serves, so that vLLM's pause is a swap; False:
    one update_weights call loads it (the pause then holds the load)."""
    allow_new_tensors: bool = True
    """Let the servers' stores take names they do not hold yet (vLLM checks every name against its
    model anyway); False: a push with a new name fails at the servers."""
    version_prefix: str = "step"
    """Versions are labelled PREFIX-N (N counts this engine's sends from 1); vLLM reports the label."""
    timeout_s: float = 300.0
    """Bound of every wait: a push's RPCs, vLLM staging a version."""

    def __post_init__(self) -> None:
        if isinstance(self.servers, str):
            self.servers = [self.servers]
        if not self.servers:
            raise ValueError("WeightSyncTrainerInitInfo.servers needs at least one weightsync server (host:port)")
        for address in self.servers:
            parse_address(address, what="WeightSyncTrainerInitInfo.servers")
        self.engine_server = self.engine_server or self.servers[0]
        if self.engine_server not in self.servers:
            raise ValueError(f"engine_server {self.engine_server!r} must be one of servers {self.servers}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.delta not in (True, False, "auto"):
            raise ValueError(f"delta must be True, False or 'auto', got {self.delta!r}")
        if isinstance(self.trainer_ranks, bool) or not isinstance(self.trainer_ranks, int) or self.trainer_ranks < 1:
            raise ValueError(f"trainer_ranks must be an integer >= 1, got {self.trainer_ranks!r}")
        if not 0 <= self.rank < self.trainer_ranks and self.trainer_ranks > 1:
            raise ValueError(f"rank {self.rank} is not one of the {self.trainer_ranks} trainer ranks")
        if self.trainer_ranks > 1 and self.transport == "collective":
            raise ValueError("a sharded trainer pushes its parts over inline or shm (transport), not collective")
        if self.prepare and not self.engine_name:
            raise ValueError("prepare needs an engine_name: rank 0 watches each vLLM rank's record by it")
        if not isinstance(self.timeout_s, int | float) or not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number, got {self.timeout_s!r}")

    @property
    def pushes(self) -> bool:
        """This rank pushes: rank 0 of a single trainer, every rank of a sharded one."""
        return self.trainer_ranks > 1 or self.rank == 0


class WeightSyncTrainerEngine(TrainerWeightTransferEngine[WeightSyncTrainerInitInfo]):
    """vLLM's trainer-side engine over weightsync (the module's docstring)."""

    init_info_cls = WeightSyncTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, info: WeightSyncTrainerInitInfo,
                 sdk: WeightSyncClient | None) -> None:
        super().__init__(client=client, source=source, is_sender=info.is_sender)
        self.info = info
        self.sdk = sdk
        self.sends = itertools.count(1)
        self.served_generation = -1
        """The generation vLLM serves as far as this engine knows (-1: unknown: load every tensor)."""
        self.served_epoch: int | None = None
        """The store epoch served_generation counts in (a restarted server's store starts a new one)."""
        self.attached = False
        self.last_pause_s = 0.0
        """The last apply call as rank 0 saw it (the HTTP round trip included)."""

    @classmethod
    def trainer_init(cls, init_info: WeightSyncTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> WeightSyncTrainerEngine:
        if source is None:
            raise ValueError("the weightsync trainer backend needs a WeightSource (e.g. ModuleSource(model))")
        sdk = None
        if init_info.pushes:
            part = Part(init_info.rank, init_info.trainer_ranks, init_info.part_group) \
                if init_info.trainer_ranks > 1 else None
            sdk = WeightSyncClient(init_info.servers, token=init_info.token or None, tls=init_info.tls,
                                   timeout=init_info.timeout_s, part=part)
        engine = cls(client=client, source=source, info=init_info, sdk=sdk)
        try:
            if init_info.transport == "collective" and init_info.rank == 0:
                sdk.create_group()
            if engine.is_sender:
                engine._attach()
        except BaseException:
            engine.shutdown()
            raise
        return engine

    # -- one version ------------------------------------------------------------------------------
    def send_weights(self) -> None:
        label = f"{self.info.version_prefix}-{next(self.sends)}"
        tensors = self._tensors()
        if self.sdk is None:
            return  # a rank of a single trainer: it iterated the source alongside rank 0
        try:
            result = self.sdk.push(tensors, version=label, transport=self.info.transport, mode=self.info.mode,
                                   delta=self.info.delta, allow_new_tensors=self.info.allow_new_tensors,
                                   part_key=self._part_key(label))
        except WeightSyncClientError as error:
            raise WeightSyncTransferError(getattr(error, "reason", "") or "PUSH_FAILED", str(error),
                                          pushed=False) from error
        if not self.is_sender:
            return
        outcome = next(s for s in result.servers if s.server == self.info.engine_server)
        if outcome.store_epoch != self.served_epoch:  # another store (the server restarted): vLLM needs every tensor
            self.served_generation, self.served_epoch = -1, outcome.store_epoch
        self._load(label, outcome.generation)

    def _part_key(self, label: str) -> str | None:
        """Parts without a group agree on each push's key by counting: every rank sends the same
        versions in the same order (with a group, rank 0 draws one and shares it)."""
        return label if self.info.trainer_ranks > 1 and self.info.part_group is None else None

    def _tensors(self) -> dict:
        """What this rank pushes: the whole source (rank 0 of a single trainer), its held part (a
        sharded trainer's rank), or nothing (another rank of a single trainer: it iterates alongside)."""
        source = self.source
        if not self.info.pushes:
            for _ in source:
                pass
            return {}
        held = source.held_names() if self.info.trainer_ranks > 1 else None
        held = None if held is None else set(held)
        return {name: tensor for name, tensor in source
                if tensor is not None and (held is None or name in held)}

    def _load(self, label: str, generation: int) -> None:
        """Have vLLM serve `generation` as `label` (rank 0); attach again once if vLLM or the server restarted."""
        for attempt in (0, 1):
            try:
                if not self.attached:
                    self._attach()
                self._drive(label, generation)
                return
            except WeightSyncTransferError as error:
                if attempt or error.reason not in RECONNECT_REASONS:
                    if error.reason in ("ENGINE_UNREACHABLE", *RECONNECT_REASONS):
                        self.attached = False  # the next send attaches vLLM again first
                    raise
                log.info("vllm_reattach", reason=error.reason, detail=error.detail[:300])
                self.attached = False

    def _attach(self) -> None:
        try:
            info = self.sdk.server_info()[self.info.servers.index(self.info.engine_server)]
        except WeightSyncClientError as error:
            raise WeightSyncTransferError(getattr(error, "reason", "") or "SERVER_UNREACHABLE", str(error),
                                          pushed=False) from error
        if not info.local_socket:
            raise WeightSyncTransferError("LOCAL_SOCKET_DISABLED", f"{self.info.engine_server} has no local socket "
                                          "(--local-socket): vLLM's ranks cannot read its store", pushed=False)
        self._call("init_weight_transfer_engine", self.client.init_weight_transfer_engine,
                   {"local_socket": info.local_socket, "engine_name": self.info.engine_name,
                    "token": self.info.token}, pushed=False)
        self.attached = True
        self.served_generation = -1  # a new or restarted vLLM: it serves its own weights until loaded

    def _drive(self, label: str, generation: int) -> None:
        client = self.client
        self._call("start_weight_update", client.start_weight_update)
        try:
            update = {"generation": generation, "since_generation": self.served_generation,
                      "wait_s": min(30.0, self.info.timeout_s)}
            if self.info.prepare:
                started = self._prepare_and_apply(update, generation)
            else:
                started = time.monotonic()
                self._call("update_weights", client.update_weights, update)
            self.last_pause_s = time.monotonic() - started
        except WeightSyncTransferError as error:
            if error.reason == "PREPARE_TIMEOUT":  # the session is still open in vLLM: close it
                self._quietly(client.finish_weight_update)
            raise
        self._call("finish_weight_update", client.finish_weight_update, label)
        self.served_generation = generation

    def _prepare_and_apply(self, update: dict, generation: int) -> float:
        """Prepare, wait until staged, apply; once more if vLLM's ranks no longer held the preparation at the
        apply (vLLM attached again, its hold ran out: vLLM's failed call ended its session). The apply's start."""
        client = self.client
        for attempt in (0, 1):
            self._call("update_weights", client.update_weights, {**update, "phase": "prepare",
                                                                  "hold_s": self.info.timeout_s})
            self._wait_staged(generation)
            started = time.monotonic()
            try:
                self._call("update_weights", client.update_weights, {**update, "phase": "apply"})
                return started
            except WeightSyncTransferError as error:
                if attempt or error.reason != "NOT_PREPARED":
                    raise
                log.warning("vllm_not_prepared", generation=generation)
                self._call("start_weight_update", client.start_weight_update)
        raise AssertionError("unreachable")

    def _wait_staged(self, generation: int) -> None:
        """Until no rank of this vLLM is APPLYING (each staged the version, or failed: the apply says why)."""
        index = self.info.servers.index(self.info.engine_server)
        deadline = time.monotonic() + self.info.timeout_s
        while True:
            engines = self.sdk.server_info()[index].engines
            ranks = [e for e in engines if rank_of(e.name, self.info.engine_name)]
            if ranks and all(e.state != pb.ENGINE_STATE_APPLYING for e in ranks):
                return
            if time.monotonic() > deadline:
                raise WeightSyncTransferError("PREPARE_TIMEOUT", f"vLLM's ranks did not stage generation {generation} "
                                              f"within {self.info.timeout_s:g} s", pushed=True)
            time.sleep(READY_POLL_SECONDS)

    def _call(self, what: str, call: Callable, argument: Any = None, *, pushed: bool = True) -> None:
        try:
            call() if argument is None else call(argument)
        except Exception as error:  # noqa: BLE001 - any client's failure, typed here
            raise engine_failure(what, error, pushed=pushed) from error

    @staticmethod
    def _quietly(call: Callable) -> None:
        try:
            call()
        except Exception as error:  # noqa: BLE001 - closing after a failure: the failure is what is raised
            log.warning("vllm_cleanup_failed", error=repr(error)[:300])

    def shutdown(self) -> None:
        sdk, self.sdk = self.sdk, None
        if sdk is not None:
            sdk.close()


def rank_of(record: str, engine_name: str) -> bool:
    """Whether an engine record is one of the vLLM ranks attached as `engine_name` (engine/vllm_ranks.py's
    rank_engine_name: NAME, NAME:tpR, NAME:ppPtpR)."""
    if record == engine_name:
        return True
    rest = record[len(engine_name) + 1:] if record.startswith(engine_name + ":") else ""
    return re.fullmatch(r"(pp\d+)?tp\d+", rest) is not None


def engine_failure(what: str, error: BaseException, *, pushed: bool) -> WeightSyncTransferError:
    """A failed call of vLLM's weight-sync client as a typed error: the reason vLLM's answer names (a
    weightsync reason from its ranks), else ENGINE_UNREACHABLE (no answer) or ENGINE_CALL_FAILED."""
    response = getattr(error, "response", None)
    body = getattr(response, "text", "") or ""
    text = f"{error}; {body}" if body else str(error)
    found = _REASON.findall(body or str(error))
    if found:
        reason = found[0]
    elif response is None and isinstance(error, OSError):  # no answer: refused, reset, timed out
        reason = "ENGINE_UNREACHABLE"
    else:
        reason = "ENGINE_CALL_FAILED"
    return WeightSyncTransferError(reason, f"vLLM's {what}: {text[:2000]}", pushed=pushed)
