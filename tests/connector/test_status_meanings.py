"""One store status, one meaning for a load and for a save (``connector/outcomes.py: STATUS_MEANINGS``)."""

from __future__ import annotations

import pytest
from hybridkv.connector.outcomes import STATUS_MEANINGS, SaveOutcome, load_outcome, save_outcome
from hybridkv.lifecycle.load import LoadOutcome
from hybridkv.store.base import Status


@pytest.mark.parametrize(
    ("status", "load", "save"),
    [
        (Status.OK, LoadOutcome.OK, SaveOutcome.OK),
        (Status.NOT_FOUND, LoadOutcome.MISSING, SaveOutcome.TRANSPORT_ERROR),
        (Status.CORRUPT, LoadOutcome.CORRUPT, SaveOutcome.TRANSPORT_ERROR),
        (Status.NO_SPACE, LoadOutcome.TRANSPORT_ERROR, SaveOutcome.NO_SPACE),
        (Status.TIMEOUT, LoadOutcome.TIMEOUT, SaveOutcome.TIMEOUT),
        (Status.TRANSFER_FAILED, LoadOutcome.TRANSPORT_ERROR, SaveOutcome.TRANSPORT_ERROR),
    ],
)
def test_each_status_has_one_meaning(status: Status, load: LoadOutcome, save: SaveOutcome) -> None:
    assert load_outcome(status) is load and save_outcome(status) is save


def test_only_a_definite_answer_invalidates_a_loaded_entry() -> None:
    """A slow or failed call says nothing about the entry; only "not there" and "bytes bad" do (hard rule 3)."""
    invalidating = {status for status, meaning in STATUS_MEANINGS.items() if meaning.load.invalidates}
    assert invalidating == {Status.NOT_FOUND, Status.CORRUPT}
    assert set(STATUS_MEANINGS) == set(Status)


def test_an_entry_never_read_is_not_attempted() -> None:
    assert load_outcome(None) is LoadOutcome.NOT_ATTEMPTED
    assert not LoadOutcome.NOT_ATTEMPTED.is_fault


def test_the_lifecycle_fuzzer_reads_a_get_as_the_worker_does() -> None:
    """``hybridkv.testing.fault_patterns`` keeps the load column without importing vLLM: it must not drift."""
    from hybridkv.testing.fault_patterns import STATUS_TO_LOAD_OUTCOME

    assert dict(STATUS_TO_LOAD_OUTCOME) == {
        status: meaning.load for status, meaning in STATUS_MEANINGS.items()
    }
