"""WeightSyncVLLMClient: TRL's VLLMClient with the weights going through weightsync.

Generation is TRL's own code, inherited unchanged: token-id prompts to vLLM's OpenAI
server (/v1/completions). What changes is the weight path. TRL's client joins vLLM's NCCL
weight-transfer engine (CUDA only) and broadcasts every tensor with no timeout; this one
pushes them to a weightsync server as one STAGED version, and the server drives vLLM
(`--engine vllm-http=URL`): vLLM's "weightsync" backend reads the committed version from
the node's store. A sync returns once vLLM serves that version (GetServerInfo.engines),
and every wait in it is bounded by WeightSyncConfig.timeout_s.

After a failure (the server died, refused, timed out) the next sync starts over: a new
connection (and transfer group), a full push that may create every tensor, so training
resumes as soon as the server is back; vLLM, which kept serving the last version it took,
is warm-started by the restarted server's driver.
"""

from __future__ import annotations

import atexit
import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import requests
import torch
from torch import nn

from weightsync.common.logging import get_logger
from weightsync.integrations.trl.versions import require_supported_trl

require_supported_trl()  # before TRL is imported: another release fails here, saying what to install

from trl.generation.vllm_client import VLLMClient  # noqa: E402

from weightsync.client import WeightSyncClient, WeightSyncClientError  # noqa: E402
from weightsync.engine.vllm_plugin import BACKEND  # noqa: E402
from weightsync.integrations.trl.config import WeightSyncConfig  # noqa: E402
from weightsync.integrations.trl.errors import WeightSyncTrlError  # noqa: E402
from weightsync.integrations.trl.serving import find_engine, wait_serving  # noqa: E402
from weightsync.v1 import weight_sync_service_pb2 as pb  # noqa: E402

log = get_logger("weightsync.integrations.trl")

CONNECT_RETRY_SECONDS = 0.25
Layout = tuple[tuple[str, tuple[int, ...]], ...]
"""(name, shape) of each tensor of a push, in order: equal layouts have equal plans (one dtype)."""
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True, slots=True)
class SyncRecord:
    """One sync, as the trainer saw it."""

    version: str
    generation: int
    """The server's generation of the version (GetServerInfo.engines[].applied_version.generation)."""
    tensors: int
    size_bytes: int
    """What the push moved: with delta, the patches and the changed tensors."""
    dense_bytes: int
    """The synced weights' size: what a dense push moves."""
    push_seconds: float
    """From the first byte to the server's commit."""
    serve_seconds: float
    """From the commit to the server reporting that vLLM serves it."""
    commit_to_serving: float
    """The server's own measure of the same (EngineStatus.commit_to_serving)."""
    full: bool
    """A push that may create tensors (the first one on a connection)."""
    streamed: bool
    """Sent tensor by tensor with the last push's plan (the same layout), not collected first."""


def resolve_dtype(setting: str, served: str | None) -> torch.dtype:
    """The dtype to push: the setting, or for "auto" what vLLM serves ("torch.bfloat16", "bfloat16")."""
    name = setting if setting != "auto" else (served or "").removeprefix("torch.")
    if name not in _DTYPES:
        raise WeightSyncTrlError("DTYPE_UNKNOWN", f"vLLM reports model dtype {served!r}; set "
                                 f"WeightSyncConfig(dtype=...) to one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


class WeightSyncVLLMClient(VLLMClient):
    """A drop-in for trl.generation.vllm_client.VLLMClient (TRL 1.16) that syncs weights through weightsync.

    Takes VLLMClient's arguments (group_port is unused: no NCCL group with vLLM) and the
    WeightSyncConfig. `syncs` and `generate_seconds` record every sync and generation.
    """

    def __init__(
        self,
        base_url: str | None = None,
        host: str = "0.0.0.0",  # noqa: S104 - TRL's default, a client-side host to connect to
        server_port: int = 8000,
        group_port: int = 51216,
        connection_timeout: float = 0.0,
        *,
        weightsync: WeightSyncConfig,
    ) -> None:
        self.weightsync = weightsync
        self.version_label: Callable[[], str] | None = None
        """The label of the next version (the trainer sets it to follow its global step)."""
        self.syncs: list[SyncRecord] = []
        self.generate_seconds: list[float] = []
        self.reset_seconds: list[float] = []
        self._sdk: WeightSyncClient | None = None
        self._engine: str | None = None
        self._device = torch.device("cpu")
        self._dtype: torch.dtype | None = None
        self._full = True
        self._pending: dict[str, torch.Tensor] | None = None
        self._last_layout: Layout | None = None
        self._atexit = False
        super().__init__(base_url=base_url, host=host, server_port=server_port, group_port=group_port,
                         connection_timeout=connection_timeout)

    # -- generation: TRL's, timed ---------------------------------------------------------
    def generate(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return super().generate(*args, **kwargs)
        finally:
            self.generate_seconds.append(time.perf_counter() - started)

    # -- the weight path ---------------------------------------------------------------------
    def init_communicator(self, device: torch.device | str | int = 0) -> None:
        """Check that vLLM takes weightsync's versions and that the server drives it, then connect.

        Any device: weightsync moves the bytes (the transport picks Gloo or NCCL for COLLECTIVE)."""
        info = self.get_server_info()
        backend = (info.get("weight_transfer_config") or {}).get("backend")
        if backend != BACKEND:
            raise WeightSyncTrlError("VLLM_BACKEND_MISSING", f"the vLLM server at {self.base_url} has weight-transfer "
                                     f"backend {backend!r}: start it with VLLM_SERVER_DEV_MODE=1 and "
                                     f"--weight-transfer-config '{{\"backend\": \"{BACKEND}\"}}'")
        self._dtype = resolve_dtype(self.weightsync.dtype, (info.get("model_config") or {}).get("dtype"))
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)  # the COLLECTIVE group's NCCL communicator lives on it
        self._device = device
        self._connect()
        if not self._atexit:
            atexit.register(self.close_communicator)
            self._atexit = True

    def _connect(self, label: str = "") -> WeightSyncClient:
        config = self.weightsync
        deadline = time.monotonic() + config.timeout_s
        while True:
            sdk = WeightSyncClient(config.server, token=config.token, tls=config.tls, timeout=config.timeout_s)
            try:
                engines = self._server_engines(sdk)
                break
            except WeightSyncClientError as error:
                _close_quietly(sdk)
                # A server that is (re)starting: gRPC refuses at once for a moment after it is back
                # (the reconnect backoff of the connection to the dead one), so ask again, up to the timeout.
                if getattr(getattr(error, "code", None), "name", "") != "UNAVAILABLE" or time.monotonic() >= deadline:
                    raise _sync_error(config.server, label, "connecting", error) from None
                time.sleep(CONNECT_RETRY_SECONDS)
        try:
            self._engine = find_engine(engines, self.base_url, config.engine, config.server)
            if config.transport == "collective":
                # NCCL when the trainer is on CUDA and the server offers it, else Gloo.
                sdk.create_group(backend="auto" if self._device.type == "cuda" else "gloo", timeout=config.timeout_s)
        except WeightSyncClientError as error:
            _close_quietly(sdk)
            raise _sync_error(config.server, label, "connecting", error) from None
        except BaseException:
            _close_quietly(sdk)
            raise
        self._sdk, self._full = sdk, True
        log.info("trl_weightsync_connected", server=config.server, engine=self._engine, transport=config.transport,
                 vllm=self.base_url, dtype=str(self._dtype).removeprefix("torch."))
        return sdk

    @staticmethod
    def _server_engines(sdk: WeightSyncClient) -> list[pb.EngineStatus]:
        return list(sdk.server_info()[0].engines)

    def update_named_params(self, metadata: list[tuple[str, str, list[int]]],
                            named_params: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Push the tensors as one STAGED version and return once vLLM serves it.

        metadata: (name, dtype, shape) of each tensor, in order, as TRL announces them. When it
        repeats the last push's names and shapes, the tensors stream (one gathered and cast at a
        time); otherwise they are collected first. Raises WeightSyncTrlError; vLLM then keeps
        serving its last version."""
        if self._pending is not None:  # inside weight_update(): one version at its end
            for name, tensor in named_params:
                self._pending[name] = tensor
            return
        self._push(named_params, _layout(metadata))

    def update_named_param(self, name: str, weights: torch.Tensor) -> None:
        self.update_named_params([(name, str(weights.dtype).removeprefix("torch."), list(weights.shape))],
                                 iter([(name, weights)]))

    def update_model_params(self, model: nn.Module) -> None:
        metadata = [(name, str(p.dtype).removeprefix("torch."), list(p.shape)) for name, p in model.named_parameters()]
        self.update_named_params(metadata, ((name, param.data) for name, param in model.named_parameters()))

    @contextlib.contextmanager
    def weight_update(self):
        """Every update_named_param inside is one version, pushed when the block ends without error."""
        if self._pending is not None:
            raise RuntimeError("weight_update() blocks do not nest")
        self._pending = {}
        try:
            yield
            pending = self._pending
        finally:
            self._pending = None
        if pending:
            self._push(iter(pending.items()), None)

    def _push(self, named_params: Iterable[tuple[str, torch.Tensor]], layout: Layout | None) -> SyncRecord:
        config = self.weightsync
        if self._dtype is None:
            raise RuntimeError("init_communicator() first")
        label = self.version_label() if self.version_label is not None else f"{config.version_prefix}{len(self.syncs)}"
        dtype = self._dtype
        cast = ((name, tensor.detach().to(dtype)) for name, tensor in named_params)
        sdk = self._sdk or self._connect(label)
        full = self._full
        # The first push on a connection may create tensors (an empty or restarted store) and is
        # collected so that it is checked whole. A later one that announces the last push's layout
        # streams: the SDK sends it with the last plan, one tensor cast at a time, and aborts the
        # update if the tensors diverge from it. Any other push (a partial one) is collected.
        # With delta the SDK compares against its copy of the last sync: it needs the tensors held.
        stream = not full and config.delta is False and layout is not None and layout == self._last_layout
        tensors = cast if stream else dict(cast)
        if not stream:
            layout = tuple((name, tuple(tensor.shape)) for name, tensor in tensors.items())
        phase = "pushing"
        try:
            before = next((e for e in self._server_engines(sdk) if e.name == self._engine), None)
            started = time.perf_counter()
            result = sdk.push(tensors, version=label, mode="staged", transport=config.transport,
                              allow_new_tensors=full, bucket_size_bytes=config.bucket_size_bytes,
                              delta=config.delta)
            pushed = time.perf_counter()
            self._full, self._last_layout = False, layout
            generation = result.servers[0].generation
            phase = "waiting for vLLM to serve"
            status = wait_serving(lambda: self._server_engines(sdk), self._engine or "", generation, label,
                                  before=before, timeout=config.timeout_s)
        except (WeightSyncClientError, ValueError, TypeError) as error:
            self._drop_connection()
            raise _sync_error(config.server, label, phase, error) from None
        record = SyncRecord(version=label, generation=generation, tensors=result.tensor_count,
                            size_bytes=result.size_bytes, dense_bytes=result.dense_bytes or result.size_bytes,
                            push_seconds=pushed - started,
                            serve_seconds=time.perf_counter() - pushed,
                            commit_to_serving=status.commit_to_serving.ToTimedelta().total_seconds(), full=full,
                            streamed=stream)
        self.syncs.append(record)
        log.info("trl_weights_served", version=label, generation=generation, bytes=result.size_bytes,
                 dense_bytes=record.dense_bytes, push_s=round(record.push_seconds, 4), serve_s=round(record.serve_seconds, 4), full=full)
        return record

    def engine_status(self) -> pb.EngineStatus | None:
        """What the weightsync server reports about the vLLM it drives for TRL (GetServerInfo.engines):
        the version it serves, since when, its state; None while not connected."""
        if self._sdk is None or self._engine is None:
            return None
        return next((e for e in self._server_engines(self._sdk) if e.name == self._engine), None)

    def _drop_connection(self) -> None:
        """Forget the connection after a failure: the next sync reconnects and pushes everything."""
        sdk, self._sdk, self._full = self._sdk, None, True
        if sdk is not None:
            _close_quietly(sdk)

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's prefix cache, so no KV computed with older weights is reused.

        Runs after the sync returned, i.e. once vLLM serves the new version. (The server's
        driver also clears it when it pauses vLLM to apply a version.) vLLM answers
        success=false while blocks are held by running requests: asked again until the timeout."""
        started = time.perf_counter()
        deadline = time.monotonic() + self.weightsync.timeout_s
        answer: object = None
        while True:
            try:
                response = self.session.post(f"{self.base_url}/reset_prefix_cache", timeout=self.weightsync.timeout_s)
                answer = response.json() if response.status_code == 200 else f"HTTP {response.status_code}: " \
                                                                                f"{response.text[:300]}"
            except (requests.RequestException, ValueError) as error:
                answer = f"{type(error).__name__}: {error}"
            if isinstance(answer, dict) and answer.get("success") is True:
                self.reset_seconds.append(time.perf_counter() - started)
                return
            if time.monotonic() >= deadline:
                raise WeightSyncTrlError("PREFIX_CACHE_NOT_RESET", f"vLLM at {self.base_url} did not reset its "
                                         f"prefix cache within {self.weightsync.timeout_s:g} s (last answer: {answer})")
            time.sleep(0.1)

    def close_communicator(self) -> None:
        """Delete the transfer group (COLLECTIVE) and close the connection; idempotent."""
        self._drop_connection()


def _layout(metadata: list[tuple[str, str, list[int]]]) -> Layout | None:
    return tuple((name, tuple(shape)) for name, _, shape in metadata) if metadata else None


def _close_quietly(sdk: WeightSyncClient) -> None:
    try:
        sdk.close()
    except Exception as error:  # noqa: BLE001 - the server may be gone: nothing left to clean there
        log.warning("trl_weightsync_close_failed", error=str(error))


def _sync_error(server: str, label: str, phase: str, error: BaseException) -> WeightSyncTrlError:
    code = getattr(getattr(error, "code", None), "name", "") or ""
    reason = getattr(error, "reason", "") or ""
    unreachable = code in ("UNAVAILABLE", "DEADLINE_EXCEEDED") or reason in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    what = f"syncing {label!r}" if label else "connecting"
    return WeightSyncTrlError(
        "SERVER_UNREACHABLE" if unreachable else "PUSH_FAILED",
        f"{what} through weightsync server {server} failed while {phase} ({reason or type(error).__name__}): "
        f"{error}. vLLM keeps serving the last version it took, whole (STAGED). The next sync reconnects and "
        "pushes every tensor.", cause_reason=reason, code=code)
