"""``LookupService`` on its own: an idle engine step's wait ends when a lookup finishes, never blocks when
nothing is in flight, and a submit never waits for the worker (its 300 ms store call included)."""

from __future__ import annotations

import time
import uuid

from hybridkv.connector.scheduler.lookup_service import LookupService, LookupTask
from hybridkv.lifecycle import Geometry, GroupSpec, KeyScheme, Topology
from hybridkv.lifecycle.lookup import LookupSearch
from hybridkv.store import open_store
from hybridkv.store.breaker import CircuitBreaker
from hybridkv.testing.lifecycle_fuzz import family_hashes


def _search(num_tokens: int) -> LookupSearch:
    geometry = Geometry(
        groups=(GroupSpec.full(64, layout="mla"), GroupSpec.mamba(64)),
        topology=Topology(tp_size=8, dcp_size=8),
        prefix_match_unit=64,
    )
    scheme = KeyScheme(namespace="svc", model="m", geometry=geometry)
    return LookupSearch(scheme, tuple(family_hashes(7, num_tokens // 64)), num_tokens + 1, 0)


def _service(store_url: str) -> LookupService:
    breaker = CircuitBreaker(num_failures_to_open=3, reset_s=1.0)
    return LookupService(open_store(store_url), breaker=breaker, budget_s=5.0)


def test_wait_for_progress_returns_when_a_lookup_finishes_and_at_once_when_none_runs() -> None:
    service = _service(f"faulty+memory://svc-{uuid.uuid4().hex[:6]}?delay_ms=300")
    try:
        started = time.monotonic()
        service.wait_for_progress(5.0)
        assert time.monotonic() - started < 0.1, "waited with nothing in flight"
        task = LookupTask("r", _search(128 * 1024), (128 * 1024 + 1, 0, None))
        started = time.monotonic()
        service.submit(task)
        assert time.monotonic() - started < 0.1, "submit waited for the worker"
        service.wait_for_progress(5.0)
        waited = time.monotonic() - started
        assert task.done and task.error is None and task.search.result is not None
        # One round of a 300 ms store (nothing stored: the probe finds no boundary), not the 5 s timeout.
        assert 0.3 <= waited < 2.5, waited
        started = time.monotonic()
        service.wait_for_progress(5.0)  # finished: nothing in flight any more
        assert time.monotonic() - started < 0.1
    finally:
        service.close()
