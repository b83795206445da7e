"""Which TRL releases the integration supports, checked before anything of TRL is used.

The integration rests on what TRL 1.16 does in server mode: GRPOTrainer builds a
VLLMGeneration, which builds its client from the name `VLLMClient` in
trl.generation.vllm_generation and calls init_communicator, update_named_params,
reset_prefix_cache and close_communicator on it. Another minor release may change any
of that, so it is refused with a message that says what to install, rather than
half-working. Pure functions: testable without TRL installed.
"""

from __future__ import annotations

import re

SUPPORTED = ((1, 16), (1, 16))
"""Inclusive range of (major, minor) releases; every patch release of them is accepted."""
TESTED = "1.16.0"
"""The version tests/engines/test_trl_grpo.py runs against (pinned by `make engine-install`)."""


class UnsupportedTrlVersion(ImportError):
    """TRL is missing or a release the integration does not support."""


def parse(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a release or pre/post/dev/local release; None if not a version."""
    match = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        return None
    return int(match[1]), int(match[2]), int(match[3] or 0)


def supported_range() -> str:
    low, high = SUPPORTED
    return f">={low[0]}.{low[1]}.0,<{high[0]}.{high[1] + 1}"


def problem(version: str | None) -> str | None:
    """Why `version` of TRL cannot be used (None: it can)."""
    install = f"pip install 'weightsync[trl]' (trl{supported_range()}; tested with trl=={TESTED})"
    if version is None:
        return f"weightsync.integrations.trl needs TRL, which is not installed: {install}"
    parsed = parse(version)
    if parsed is None or not (SUPPORTED[0] <= parsed[:2] <= SUPPORTED[1]):
        return (f"weightsync.integrations.trl supports TRL {supported_range()}, found trl {version}: its GRPOTrainer "
                f"may build and call its vLLM client differently. {install}")
    return None


def installed_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("trl")
    except metadata.PackageNotFoundError:
        return None


def require_supported_trl() -> str:
    """The installed TRL's version; raises UnsupportedTrlVersion naming what to install."""
    version = installed_version()
    message = problem(version)
    if message is not None:
        raise UnsupportedTrlVersion(message)
    assert version is not None
    return version
