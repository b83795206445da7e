"""GRPOTrainer with its vLLM server-mode client replaced by WeightSyncVLLMClient.

TRL 1.16 has no extension point for the client: GRPOTrainer.__init__ builds a
VLLMGeneration, whose _init_vllm builds `VLLMClient(base_url=..., group_port=...,
connection_timeout=...)` from the name in trl.generation.vllm_generation and at once calls
init_communicator (which refuses any device but CUDA). The seam is that name, for the
duration of our own constructor only: it is set to a factory of WeightSyncVLLMClient under a
lock and put back right after, whatever happens, and the result is checked. If a TRL release
stops building its client there, the check fails loudly (so does the version gate before it):
nothing of TRL is changed outside this constructor, and nothing breaks silently.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

from weightsync.integrations.trl.versions import (
    UnsupportedTrlVersion,
    installed_version,
    require_supported_trl,
)

require_supported_trl()  # before TRL is imported: another release fails here, saying what to install

import trl  # noqa: E402
from trl.generation import vllm_generation as _vllm_generation  # noqa: E402
from trl.generation.vllm_client import VLLMClient  # noqa: E402

from weightsync.integrations.trl.client import WeightSyncVLLMClient  # noqa: E402
from weightsync.integrations.trl.config import WeightSyncConfig  # noqa: E402

_SEAM_LOCK = threading.Lock()


@contextlib.contextmanager
def weightsync_client_factory(config: WeightSyncConfig) -> Iterator[None]:
    """While the block runs, VLLMGeneration builds WeightSyncVLLMClient(..., weightsync=config)."""
    with _SEAM_LOCK:
        original = getattr(_vllm_generation, "VLLMClient", None)
        if original is not VLLMClient:
            raise UnsupportedTrlVersion(
                f"trl.generation.vllm_generation.VLLMClient is {original!r}, not TRL's VLLMClient: this TRL "
                f"({installed_version()}) does not build its server-mode client where weightsync expects, or "
                "something else replaced it")
        _vllm_generation.VLLMClient = functools.partial(WeightSyncVLLMClient, weightsync=config)
        try:
            yield
        finally:
            _vllm_generation.VLLMClient = original


class GRPOTrainer(trl.GRPOTrainer):
    """trl.GRPOTrainer whose vLLM server mode syncs weights through weightsync.

    Takes GRPOTrainer's arguments unchanged, plus `weightsync` (default: WeightSyncConfig.from_env(),
    i.e. WEIGHTSYNC_SERVER=host:port ...). Needs GRPOConfig(use_vllm=True, vllm_mode="server"):
    generation goes to TRL's vLLM server as before; weights go to the weightsync server that
    drives it. Each sync is the version f"{version_prefix}{state.global_step}".
    """

    def __init__(self, *args, weightsync: WeightSyncConfig | None = None, **kwargs) -> None:
        grpo_args = kwargs.get("args", args[2] if len(args) > 2 else None)
        if grpo_args is None or not getattr(grpo_args, "use_vllm", False) or grpo_args.vllm_mode != "server":
            raise ValueError("weightsync.integrations.trl.GRPOTrainer syncs vLLM's weights in server mode: pass "
                             "args=GRPOConfig(use_vllm=True, vllm_mode=\"server\", ...)")
        config = weightsync if weightsync is not None else WeightSyncConfig.from_env()
        self.weightsync_config = config
        with weightsync_client_factory(config):
            super().__init__(*args, **kwargs)
        client = self.weightsync_client
        if self.accelerator.is_main_process:  # only it talks to vLLM, as in TRL
            if not isinstance(client, WeightSyncVLLMClient):
                raise UnsupportedTrlVersion(f"GRPOTrainer built a {type(client).__name__}, not the weightsync client: "
                                            f"this TRL ({installed_version()}) is not supported")
            client.version_label = lambda: f"{config.version_prefix}{self.state.global_step}"

    def sync_vllm_weights(self) -> None:
        """Sync the current weights to vLLM now, as TRL does before each generation (e.g. after the
        last step, whose update TRL never syncs): the version f"{version_prefix}{state.global_step}"."""
        self.vllm_generation.sync_weights()

    @property
    def weightsync_client(self) -> WeightSyncVLLMClient | None:
        """The client that talks to vLLM and weightsync (main process only; None elsewhere)."""
        return getattr(getattr(self, "vllm_generation", None), "vllm_client", None)


WeightSyncGRPOTrainer = GRPOTrainer
