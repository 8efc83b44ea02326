"""The scheduler's step trace (``step_trace: true``): one DEBUG log event per scheduler step.

Where a hit request's time to first token goes is a matter of scheduler steps: vLLM asks the connector for
a waiting request's external tokens while it schedules a step (``get_num_new_matched_tokens``), sends the
load jobs with that step (``build_connector_meta``), learns that a load finished from a step's output
(``update_connector_output``) and schedules the request in the step after. Each event
(:attr:`~hybridkv.connector.log_events.ConnectorLogEvent.STEP`) is logged when a step's connector message is
built, that is once vLLM has scheduled the step and before it runs, with:

- ``step``: the step's index (from 0, one per ``build_connector_meta`` call, empty steps included);
- ``monotonic``: ``time.monotonic()`` then (seconds), the clock of the audit log's ``monotonic`` field, so
  the two join; ``wall``: ``time.time()`` at the same moment;
- ``tokens``: tokens vLLM scheduled in the step;
- ``asked_again``: requests whose lookup answered "ask again" (``None``: still searching) while the step
  was scheduled; ``hits``: requests answered a hit then; ``scheduled``: requests scheduled for the first
  time in the step (vLLM's new requests of the step); ``loads``: requests whose load job the step sends;
- ``loads_done``: requests whose load every rank reported in the step outputs taken since the previous
  event, and ``output_monotonic``: when the last of those outputs was taken (``None``: none since).

Off (the default), the hooks cost one attribute test per call. The event is logged at DEBUG: a process
that configures structlog above DEBUG drops it (``vllm serve`` does not configure structlog: there it
prints).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import structlog
from hybridkv.connector.log_events import ConnectorLogEvent

if TYPE_CHECKING:
    from hybridkv.connector.metadata import HybridStoreMetadata
    from vllm.v1.core.sched.output import SchedulerOutput

__all__ = ["StepTrace"]

log = structlog.get_logger(__name__)


class StepTrace:
    """What one scheduler step did for hits, gathered between two ``build_connector_meta`` calls."""

    def __init__(self) -> None:
        self.step = 0
        self._asked_again: list[str] = []
        self._hits: list[str] = []
        self._loads_done: list[str] = []
        self._output_monotonic: float | None = None

    def answered(self, request_id: str, num_external: int | None) -> None:
        """A lookup's answer to vLLM during the step being scheduled (``None``: ask again)."""
        if num_external is None:
            self._asked_again.append(request_id)
        elif num_external > 0:
            self._hits.append(request_id)

    def output(self, loads_done: Iterable[str]) -> None:
        """A step's output taken (``update_connector_output``); ``loads_done``: the requests whose load every
        rank has now reported."""
        self._loads_done.extend(loads_done)
        self._output_monotonic = time.monotonic()

    def emit(self, so: SchedulerOutput, meta: HybridStoreMetadata) -> None:
        """Log this step's event (see the module) and start gathering the next step's."""
        log.debug(
            ConnectorLogEvent.STEP,
            step=self.step,
            monotonic=time.monotonic(),
            wall=time.time(),
            tokens=so.total_num_scheduled_tokens,
            asked_again=self._asked_again,
            hits=self._hits,
            scheduled=[nr.req_id for nr in so.scheduled_new_reqs],
            loads=[job.req_id for job in meta.loads],
            loads_done=self._loads_done,
            output_monotonic=self._output_monotonic,
        )
        self.step += 1
        self._asked_again, self._hits, self._loads_done = [], [], []
        self._output_monotonic = None
