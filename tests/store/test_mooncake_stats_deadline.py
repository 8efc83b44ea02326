"""``stats()`` of a Mooncake store answers within its deadline when the master hangs (issue 37, leftover).

A real ``mooncake_master`` on loopback; the hang comes from a stand-in around the backend's real client
whose ``health_check`` -- the one master call ``stats()`` makes -- blocks until released. ``stats()`` (what
``hybridkv store stats`` and ``describe`` read) returns within a bound, saying that the master did not
answer, instead of holding its caller as long as the master does.
"""

from __future__ import annotations

import threading
import time

import pytest
from hybridkv.store import open_store
from hybridkv.store.mooncake import MooncakeBackend
from hybridkv_dev.devkit.mooncake import MooncakeMaster
from support.mooncake import RPC_TIMEOUT_MS

pytestmark = pytest.mark.mooncake

#: The bound ``stats()`` must return within: 10x the deadline (a bound, not a timing claim).
BOUND_S = 10 * RPC_TIMEOUT_MS / 1000
#: How long the hung health check waits to be released: far past the bound.
HANG_S = 3 * BOUND_S


class HungHealthCheck:
    """The real Mooncake client, whose ``health_check`` hangs until ``release`` is set."""

    def __init__(self, client: object) -> None:
        self._client = client
        self.release = threading.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self._client, name)

    def health_check(self) -> int:
        self.release.wait(HANG_S)
        return int(self._client.health_check())  # type: ignore[attr-defined]


def test_stats_on_a_hung_master_answers_within_the_deadline(mooncake_master: MooncakeMaster) -> None:
    store = open_store(mooncake_master.url())
    backend = store.backend
    assert isinstance(backend, MooncakeBackend)
    real = backend._store
    hung = HungHealthCheck(real)
    try:
        assert store.stats().extra["health_check"] == 0, "the master answers before the hang"
        backend._store = hung
        start = time.monotonic()
        extra = store.stats().extra
        took_s = time.monotonic() - start
        assert took_s < BOUND_S, f"stats() held its caller {took_s:.1f} s (deadline {RPC_TIMEOUT_MS} ms)"
        assert extra["health_check"] == f"no answer within {backend.timeout_ms} ms", extra
        assert extra["num_abandoned_calls"] == 1, extra
        assert extra["breaker_state"] == "closed", "stats() is no call of the breaker's"
    finally:
        hung.release.set()
        backend._store = real
        store.close()
