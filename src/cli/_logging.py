"""Process-wide logging setup for the CLI. The library never calls this; entry points do."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_process_logging(level: str = "WARNING") -> None:
    """Send stdlib and structlog records to stderr at ``level`` as key=value lines."""
    numeric_level = getattr(logging, level)
    logging.basicConfig(stream=sys.stderr, level=numeric_level, format="%(levelname)s %(name)s: %(message)s")
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
