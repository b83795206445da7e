"""Defaults both ends of a gRPC channel must agree on."""

from __future__ import annotations

DEFAULT_MAX_MESSAGE_BYTES = 32 << 20
"""Largest gRPC message the server accepts and the SDK sends or accepts (a full
plan travels in one BeginUpdate). The server's --max-message-bytes overrides
its side; the SDK's `max_message_bytes` its own."""
