"""Process-wide logging setup for the CLI. The library never calls this; entry points do."""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog


class _CurrentStderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler that writes to whatever ``sys.stderr`` is at emit time (test capture swaps it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass


def _stderr_logger_factory(*_args: Any) -> structlog.PrintLogger:
    return structlog.PrintLogger(file=sys.stderr)


def configure_process_logging(level: str = "WARNING") -> None:
    """Send stdlib and structlog records to stderr at ``level`` as key=value lines."""
    numeric_level = getattr(logging, level)
    root = logging.getLogger()
    if not any(isinstance(handler, _CurrentStderrHandler) for handler in root.handlers):
        handler = _CurrentStderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    root.setLevel(numeric_level)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=_stderr_logger_factory,
        cache_logger_on_first_use=False,
    )
