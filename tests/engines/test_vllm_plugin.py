"""The weightsync vLLM plugin keeps vLLM's CPU kernel-override scan working in a process where
numba has compiled weightsync's patch kernels (a trainer that runs vLLM itself).
It registers both sides of the backend, the worker's and the trainer's, idempotently."""

from __future__ import annotations

import builtins

import pytest

pytest.importorskip("vllm")

from vllm.triton_utils import dispatcher  # noqa: E402

from weightsync.common import patch_kernels  # noqa: E402
from weightsync.engine import vllm_plugin  # noqa: E402


def test_the_kernel_scan_survives_llvmlite_once_the_plugin_is_registered(monkeypatch):
    patch_kernels.warm_up()  # what the SDK does on a thread: llvmlite's ffi.lib is now in sys.modules
    monkeypatch.setattr(dispatcher, "vars", builtins.vars, raising=False)
    with pytest.raises(AttributeError):  # the control: vLLM 0.32's scan on its own
        dispatcher._rebind_kernels([])
    vllm_plugin.register()
    assert dispatcher.vars is vllm_plugin._namespace
    dispatcher._rebind_kernels([])  # no error: llvmlite's objects are skipped

    class Owner:  # a JIT warmup owner still has its kernel found and rebound
        def __init__(self) -> None:
            self.kernel = original

    def original() -> None: ...

    def wrapper() -> None: ...

    import sys
    import types

    module = types.ModuleType("weightsync_test_kernel_owner")
    module.owner = Owner()
    sys.modules[module.__name__] = module
    try:
        dispatcher._rebind_kernels([(original, wrapper)])
        assert module.owner.kernel is wrapper
    finally:
        del sys.modules[module.__name__]


def test_register_puts_both_sides_of_weightsync_in_vllms_registries_once():
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # the entry point, as vLLM loads it in each of its processes
    vllm_plugin.register()  # and again by hand: no "already registered"
    assert WeightTransferEngineFactory._registry["weightsync"]().__name__ == "WeightSyncEngine"
    trainer = WeightTransferTrainerFactory._registry["weightsync"]()
    assert trainer.__name__ == "WeightSyncTrainerEngine"
    from weightsync.engine.vllm_trainer import WeightSyncTrainerInitInfo

    assert WeightSyncTrainerInitInfo.backend == "weightsync" and trainer.init_info_cls is WeightSyncTrainerInitInfo
