"""vLLM plugin: registers the "weightsync" weight-transfer backend.

vLLM calls `register()` in every process it starts (API server or driver,
EngineCore, each worker) through the `vllm.general_plugins` entry point that
weightsync's pyproject declares. Start vLLM with
`weight_transfer_config={"backend": "weightsync"}` (CLI:
`--weight-transfer-config '{"backend": "weightsync"}'`). A deployment that
sets VLLM_PLUGINS must list `weightsync` in it.

Nothing is imported from vLLM until vLLM calls register(), so this module
is importable (and harmless) without vLLM.
"""

from __future__ import annotations

BACKEND = "weightsync"
ENGINE_MODULE = "weightsync.engine.vllm_backend"
ENGINE_CLASS = "WeightSyncEngine"


def register() -> None:
    """Register the backend with vLLM's WeightTransferEngineFactory; idempotent."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    # register_engine raises ValueError on a name it already holds; a process may load the
    # plugin and also call register() itself (tests, VLLM_ENABLE_V1_MULTIPROCESSING=0).
    if BACKEND not in WeightTransferEngineFactory._registry:  # noqa: SLF001 - the factory has no public lookup
        WeightTransferEngineFactory.register_engine(BACKEND, ENGINE_MODULE, ENGINE_CLASS)
