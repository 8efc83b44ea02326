"""The audit trail's receiving end: what the machine emits one record per transition to.

Record (one dict per transition; the JSON-lines sink writes one JSON object per line)::

    {"event": "hit_found", "request_id": "r1", "wave": null, "src": "LOOKUP", "dst": "PARTIAL_HIT",
     "trigger": "lookup_hit", "boundary": 160, "num_computed_tokens": 0,
     "groups": [{"group": 0, "hit_tokens": 160, "blocks": 5}, ...], "detail": null, "monotonic": 12.5}

Sinks never touch structlog's global configuration: each wraps its own logger
(``structlog.wrap_logger``) with its own processors. ``MemoryAuditSink`` keeps the records in memory;
the production sink (a file) and the replay that checks a log live in ``hybridkv.audit``.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any, Self

import structlog

__all__ = ["RECORD_KEYS", "AuditSink", "MemoryAuditSink"]

#: Keys of every record besides ``event``.
RECORD_KEYS = (
    "request_id",
    "wave",
    "src",
    "dst",
    "trigger",
    "boundary",
    "num_computed_tokens",
    "groups",
    "detail",
    "monotonic",
)


class AuditSink:
    """Receives one structlog record per transition through a dedicated logger.

    Args:
        logger: a structlog bound logger built for this sink (e.g. with ``structlog.wrap_logger``),
            or any object with an ``info(event, **fields)`` method.
    """

    def __init__(self, logger: Any) -> None:
        self._logger = logger

    def emit(self, event: str, **fields: Any) -> None:
        self._logger.info(event, **fields)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every record emitted so far is delivered; False if ``timeout_s`` ran out first.
        This sink hands records to its logger synchronously: always True."""
        return True

    def close(self) -> None:
        """Release the sink's resources. Idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class MemoryAuditSink(AuditSink):
    """Keeps the records as dicts (tests, benchmarks); ``records`` is in emission order."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

        def capture(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> Any:
            self.records.append(dict(event_dict))
            raise structlog.DropEvent

        super().__init__(
            structlog.wrap_logger(
                structlog.ReturnLogger(),
                processors=[capture],
                wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
            )
        )
