"""Logging: structlog's key-value events, carried by the standard library's `logging`.

Every weightsync logger is `get_logger(name)`: a structlog logger over the stdlib logger
`name` (all under "weightsync."). A library never writes on its user's stdout: in a
trainer or an engine that configured nothing, weightsync's records go wherever the
application's `logging` setup sends them (by default: warnings and errors to stderr,
nothing else), and its handlers and levels decide. Each record's message is the event and
its fields ("push_committed version='v1' bytes=123"); the fields themselves ride along as
`record.weightsync` (a dict) for structured handlers.

The server, its workers and the command line call `configure_logging`: one handler on the
root logger renders every record (weightsync's, asyncio's, grpc's, torch's) as one JSON line
(a console line on a terminal) on stderr. The server and its workers share one stderr, so
each line is written with a single write(2) of the whole line and its newline and, on a
pipe, is at most PIPE_BUF bytes: lines of different processes never interleave.
"""

from __future__ import annotations

import datetime
import json as json_module
import logging
import os
import stat
import sys
import traceback
from typing import Any

import structlog

PIPE_BUF = 4096
"""Writes up to this size are atomic on a pipe; longer ones may interleave with other writers."""
EVENT_ATTRIBUTE = "weightsync"
"""The LogRecord attribute that holds an event's fields (a dict)."""


def _message(event: dict[str, Any]) -> str:
    fields = " ".join(f"{k}={v!r}" for k, v in event.items() if k != "event")
    return f"{event.get('event', '')} {fields}".rstrip()


def to_stdlib(_logger: Any, _method: str, event: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Last processor: the arguments of the stdlib logger's call for this event."""
    exc_info = event.pop("exc_info", None)
    fields = dict(event)
    return (_message(fields),), {"extra": {EVENT_ATTRIBUTE: fields}, "exc_info": exc_info}


_PROCESSORS: list[Any] = [structlog.stdlib.filter_by_level, structlog.contextvars.merge_contextvars, to_stdlib]


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger over `logging.getLogger(name)`, whatever structlog's global configuration."""
    return structlog.wrap_logger(logging.getLogger(name), processors=_PROCESSORS,
                                 wrapper_class=structlog.stdlib.BoundLogger, cache_logger_on_first_use=True)


# -- rendering, for processes that own their stderr -------------------------------------------
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


class LineHandler(logging.Handler):
    """Renders each record as one event line and writes it in one system call."""

    def __init__(self, fd: int, *, json: bool, pipe: bool) -> None:
        super().__init__()
        self._fd = fd
        self._pipe = pipe
        self._render = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)

    def event_of(self, record: logging.LogRecord) -> dict[str, Any]:
        fields = getattr(record, EVENT_ATTRIBUTE, None)
        event: dict[str, Any] = dict(fields) if isinstance(fields, dict) else {"event": record.getMessage()}
        event.setdefault("logger", record.name)
        event["level"] = record.levelname.lower()
        event["timestamp"] = datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat()
        if record.exc_info and record.exc_info[0] is not None:
            event["exception"] = "".join(traceback.format_exception(*record.exc_info))
        return event

    def emit(self, record: logging.LogRecord) -> None:
        try:
            event = self.event_of(record)
            if self._pipe:
                event = fit_in_one_pipe_write(None, "", event)
            data = (str(self._render(None, "", event)) + "\n").encode("utf-8", "replace")
            while data:  # a pipe may take less than asked for only past PIPE_BUF; finish the line
                written = os.write(self._fd, data)
                data = data[written:]
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


def configure_logging(level: str = "info", *, json: bool | None = None) -> None:
    """Render every log record of this process (server, worker or CLI) as event lines on stderr.

    stdout stays free for command output. weightsync's loggers log at `level`; other
    libraries' at `level` or INFO, whichever is higher."""
    if json is None:
        json = not sys.stderr.isatty()
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    fd = sys.stderr.fileno()
    handler = LineHandler(fd, json=json, pipe=json and stat.S_ISFIFO(os.fstat(fd).st_mode))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(numeric, logging.INFO))
    logging.getLogger("weightsync").setLevel(numeric)
    # structlog.get_logger() in the application's own code (demos, tests) takes the same road.
    structlog.configure(processors=_PROCESSORS, wrapper_class=structlog.stdlib.BoundLogger,
                        logger_factory=structlog.stdlib.LoggerFactory(), cache_logger_on_first_use=False)


def log_loop_exception(loop: Any, context: dict[str, Any]) -> None:
    """asyncio's exception handler for the server's loop: one structured line, traceback as a field."""
    error = context.get("exception")
    fields: dict[str, Any] = {"asyncio_message": context.get("message", "")}
    if error is not None:
        fields["exc_info"] = (type(error), error, error.__traceback__)
    for key in ("task", "future", "handle"):
        if key in context:
            fields[key] = repr(context[key])[:200]
    get_logger("weightsync.asyncio").error("asyncio_unhandled", **fields)
