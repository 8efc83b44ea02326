"""What a store status means for the entry of a load and of a save: one mapping, imported by the worker
(``hybridkv.connector.metadata`` re-exports it) and by the lifecycle fuzzer (``hybridkv.testing``), so this
module imports no vLLM."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import NamedTuple

from hybridkv.lifecycle.load import LoadOutcome
from hybridkv.store.base import Status

__all__ = ["STATUS_MEANINGS", "SaveOutcome", "StatusMeaning", "load_outcome", "save_outcome"]


class SaveOutcome(enum.Enum):
    """What happened to one entry of a save job on one rank.

    Only ``OK`` (written, or already present: puts are insert-if-absent) lets the scheduler publish the
    block. ``DROPPED``: never sent to the store (the rank's in-flight budget was full, its staging pool
    stayed exhausted, or it was asleep) -- a job every rank dropped entirely is a dropped wave, not a
    failed one.
    """

    OK = "ok"
    NO_SPACE = "no_space"
    TIMEOUT = "timeout"
    TRANSPORT_ERROR = "transport_error"
    DROPPED = "dropped"


class StatusMeaning(NamedTuple):
    """What one store status means for the entry of a load and for the entry of a save."""

    load: LoadOutcome
    save: SaveOutcome


#: The one mapping from a store call's per-key :class:`Status` to the worker's outcomes. Only
#: ``NOT_FOUND`` and ``CORRUPT`` are definite load faults (they invalidate the entry, hard rule 3); a
#: ``put`` answers neither, so for a save they read as transport errors. Every ``Status`` has a row.
STATUS_MEANINGS: Mapping[Status, StatusMeaning] = {
    Status.OK: StatusMeaning(LoadOutcome.OK, SaveOutcome.OK),
    Status.NOT_FOUND: StatusMeaning(LoadOutcome.MISSING, SaveOutcome.TRANSPORT_ERROR),
    Status.CORRUPT: StatusMeaning(LoadOutcome.CORRUPT, SaveOutcome.TRANSPORT_ERROR),
    Status.NO_SPACE: StatusMeaning(LoadOutcome.TRANSPORT_ERROR, SaveOutcome.NO_SPACE),
    Status.TIMEOUT: StatusMeaning(LoadOutcome.TIMEOUT, SaveOutcome.TIMEOUT),
    Status.TRANSFER_FAILED: StatusMeaning(LoadOutcome.TRANSPORT_ERROR, SaveOutcome.TRANSPORT_ERROR),
}
assert set(STATUS_MEANINGS) == set(Status), (
    f"store statuses without a meaning: {set(Status) - set(STATUS_MEANINGS)}"
)


def load_outcome(status: Status | None) -> LoadOutcome:
    """The outcome of one planned entry of a load: ``None`` (never read) is ``NOT_ATTEMPTED``."""
    return LoadOutcome.NOT_ATTEMPTED if status is None else STATUS_MEANINGS[status].load


def save_outcome(status: Status) -> SaveOutcome:
    """The outcome of one entry of a save job's ``put``."""
    return STATUS_MEANINGS[status].save
