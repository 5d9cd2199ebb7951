"""structlog, configured once: JSON in production, readable on a terminal.

The request id of the RPC being served is bound through contextvars by the RPC
wrapper in `hpd_common.rpc`, so every log line inside a handler carries it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_configured = False


class _Stderr:
    """Where log lines go: the process's stderr as it is at each write (not the stream it
    was when logging was configured), and a line that cannot be written (the stream closed,
    its reader gone) is dropped and counted instead of raising into the caller. A service's
    background loop that logs its own failure must not die because its log pipe did."""

    dropped = 0

    def write(self, text: str) -> int:
        try:
            return sys.stderr.write(text)
        except (OSError, ValueError):  # EPIPE, "I/O operation on closed file"
            _Stderr.dropped += 1
            return 0

    def flush(self) -> None:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            _Stderr.dropped += 1


def configure_logging(level: str = "info", json_logs: bool | None = None) -> None:
    """Configures structlog and the stdlib root logger; later calls only change the level."""
    global _configured
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    if json_logs is None:
        json_logs = not sys.stderr.isatty()
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json_logs
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr)
    _configured = True


def get_logger(name: str) -> Any:
    """A structlog logger with `component` bound, lazily: safe to call at import time."""
    return structlog.get_logger(component=name)
