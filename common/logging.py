"""structlog set up in one place: JSON lines when not a TTY, console otherwise.

The server and its workers share one stderr. Each line is written with a
single write(2) of the whole line and its newline, so lines of different
processes never interleave inside a line (print() issues the text and the
newline as two writes: another process's line could land between them).
"""

from __future__ import annotations

import json as json_module
import logging
import os
import stat
import sys
from typing import Any

import structlog

PIPE_BUF = 4096
"""Writes up to this size are atomic on a pipe; longer ones may interleave with other writers."""


def fit_in_one_pipe_write(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
    """Shorten the longest string fields of an event whose JSON line would not fit PIPE_BUF."""
    line = json_module.dumps(event, default=repr)
    excess = len(line.encode("utf-8")) + 1 - PIPE_BUF
    if excess <= 0:
        return event
    fields = sorted((k for k, v in event.items() if isinstance(v, str)), key=lambda k: -len(event[k]))
    for key in fields:
        value = event[key]
        keep = max(64, len(value) - excess - 64)
        if keep < len(value):
            event[key] = f"{value[:keep]}...[{len(value) - keep} chars cut]"
            excess -= len(value) - keep - 32
        if excess <= 0:
            break
    event["truncated"] = True
    return event


class LineLogger:
    """A structlog logger that writes each rendered event as one line, in one system call."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def msg(self, message: str) -> None:
        data = (message + "\n").encode("utf-8", "replace")
        while data:  # a pipe may take less than asked for only past PIPE_BUF; finish the line
            written = os.write(self._fd, data)
            data = data[written:]

    log = debug = info = warn = warning = error = critical = exception = fatal = msg


class LineLoggerFactory:
    def __init__(self, stream: Any = None) -> None:
        self._fd = (stream or sys.stderr).fileno()

    def __call__(self, *args: Any) -> LineLogger:
        return LineLogger(self._fd)


def configure_logging(level: str = "info", *, json: bool | None = None) -> None:
    """Configure structlog for this process (server, worker or CLI).

    Logs go to stderr so stdout stays free for command output.
    """
    if json is None:
        json = not sys.stderr.isatty()
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
    ]
    if json:
        if stat.S_ISFIFO(os.fstat(sys.stderr.fileno()).st_mode):
            processors.append(fit_in_one_pipe_write)  # several processes share this pipe
        processors.append(structlog.processors.JSONRenderer())
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=LineLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    # asyncio ("exception was never retrieved"), grpc and torch log through the standard library:
    # their records, tracebacks included, become one structlog line each, not free text.
    root = logging.getLogger()
    root.handlers[:] = [StructlogBridge()]
    root.setLevel(max(numeric, logging.INFO))


class StructlogBridge(logging.Handler):
    """A standard-library handler that re-emits each record as one structlog event."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            logger = structlog.get_logger(record.name)
            fields: dict[str, Any] = {"logger": record.name}
            if record.exc_info and record.exc_info[0] is not None:
                fields["exc_info"] = record.exc_info
            method = getattr(logger, record.levelname.lower(), logger.error)
            method(record.getMessage(), **fields)
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


def log_loop_exception(loop: Any, context: dict[str, Any]) -> None:
    """asyncio's exception handler for the server's loop: one structured line, traceback as a field."""
    error = context.get("exception")
    fields: dict[str, Any] = {"asyncio_message": context.get("message", "")}
    if error is not None:
        fields["exc_info"] = (type(error), error, error.__traceback__)
    for key in ("task", "future", "handle"):
        if key in context:
            fields[key] = repr(context[key])[:200]
    structlog.get_logger("weightsync.asyncio").error("asyncio_unhandled", **fields)
