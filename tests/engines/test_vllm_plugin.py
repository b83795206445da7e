"""The weightsync vLLM plugin keeps vLLM's CPU kernel-override scan working in a process where
numba has compiled weightsync's patch kernels (a trainer that runs vLLM itself)."""

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
