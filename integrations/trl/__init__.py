"""weightsync.integrations.trl: TRL's GRPOTrainer (vLLM server mode) trains through weightsync.

    pip install 'weightsync[trl]'          # trl 1.16.x; vLLM on the trainer too, as TRL needs

The one line that changes in a TRL script:

    from weightsync.integrations.trl import GRPOTrainer      # was: from trl import GRPOTrainer

with WEIGHTSYNC_SERVER=host:port in the environment (or GRPOTrainer(..., weightsync=
WeightSyncConfig(server=..., transport=...))). vLLM runs as TRL documents it, with the
"weightsync" weight-transfer backend instead of "nccl"; a weightsync server drives it:

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "weightsync"}' ...
    weightsync-server --engine vllm-http=http://127.0.0.1:8000 ...

The names below that need TRL are imported on first use, after the TRL version is checked
(versions.py): any other release raises UnsupportedTrlVersion, an ImportError saying what to
install. The config, version and serving modules import without TRL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightsync.integrations.trl.config import WeightSyncConfig
from weightsync.integrations.trl.errors import WeightSyncTrlError
from weightsync.integrations.trl.versions import (
    SUPPORTED,
    TESTED,
    UnsupportedTrlVersion,
    require_supported_trl,
    supported_range,
)

if TYPE_CHECKING:
    from weightsync.integrations.trl.client import SyncRecord, WeightSyncVLLMClient
    from weightsync.integrations.trl.trainer import (
        GRPOTrainer,
        WeightSyncGRPOTrainer,
        weightsync_client_factory,
    )

_NEED_TRL = {
    "GRPOTrainer": "trainer",
    "WeightSyncGRPOTrainer": "trainer",
    "weightsync_client_factory": "trainer",
    "SyncRecord": "client",
    "WeightSyncVLLMClient": "client",
}


def __getattr__(name: str):
    module = _NEED_TRL.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    require_supported_trl()  # before anything of TRL is imported
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "SUPPORTED",
    "TESTED",
    "GRPOTrainer",
    "SyncRecord",
    "UnsupportedTrlVersion",
    "WeightSyncConfig",
    "WeightSyncGRPOTrainer",
    "WeightSyncTrlError",
    "WeightSyncVLLMClient",
    "supported_range",
    "weightsync_client_factory",
]
