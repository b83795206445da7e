"""vLLM plugin: registers the "weightsync" weight-transfer backend, both sides.

vLLM calls `register()` in every process it starts (API server or driver,
EngineCore, each worker) through the `vllm.general_plugins` entry point that
weightsync's pyproject declares. Start vLLM with
`weight_transfer_config={"backend": "weightsync"}` (CLI:
`--weight-transfer-config '{"backend": "weightsync"}'`). A deployment that
sets VLLM_PLUGINS must list `weightsync` in it. The trainer side (vLLM's
WeightTransferTrainerFactory: engine/vllm_trainer.py) is registered under the same
name, in every process that loads vLLM's plugins (a trainer that imports vLLM's
trainer API calls `vllm.plugins.load_general_plugins()`, or register() itself).

Nothing is imported from vLLM until vLLM calls register(), so this module
is importable (and harmless) without vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

BACKEND = "weightsync"
ENGINE_MODULE = "weightsync.engine.vllm_backend"
ENGINE_CLASS = "WeightSyncEngine"
TRAINER_MODULE = "weightsync.engine.vllm_trainer"
TRAINER_CLASS = "WeightSyncTrainerEngine"


def register() -> None:
    """Register the backend with vLLM's WeightTransferEngineFactory and WeightTransferTrainerFactory;
    idempotent."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    _guard_kernel_override_scan()

    # register_engine raises ValueError on a name it already holds; a process may load the
    # plugin and also call register() itself (tests, VLLM_ENABLE_V1_MULTIPROCESSING=0).
    if BACKEND not in WeightTransferEngineFactory._registry:  # noqa: SLF001 - the factory has no public lookup
        WeightTransferEngineFactory.register_engine(BACKEND, ENGINE_MODULE, ENGINE_CLASS)
    if BACKEND not in WeightTransferTrainerFactory._registry:  # noqa: SLF001 - likewise
        WeightTransferTrainerFactory.register_engine(BACKEND, TRAINER_MODULE, TRAINER_CLASS)


def _namespace(value: Any) -> Mapping:
    """vars(value) where it is a mapping; {} where an object's __getattr__ answers for __dict__."""
    namespace = vars(value)
    return namespace if isinstance(namespace, Mapping) else {}


def _guard_kernel_override_scan() -> None:
    """vLLM's CPU build (no Triton) rebinds its kernels by scanning every module's namespace and
    calling vars(value).get("kernel") on each value with a __dict__ (vllm/triton_utils/dispatcher.py).
    llvmlite's `ffi.lib` answers any attribute, __dict__ included, with a function wrapper, so once
    numba has compiled or loaded a kernel in the process (weightsync's SDK does, for patches: a
    trainer that runs vLLM in its own process, TRL's colocate mode) every later LLM fails to start
    with AttributeError. vLLM loads the plugins just before that scan: its module-level `vars` is
    pointed at one that skips such objects (they can hold no kernel)."""
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:  # a vLLM without the scan
        return
    if getattr(dispatcher, "vars", None) is not _namespace:
        dispatcher.vars = _namespace  # a module global shadows the builtin for that module alone
