"""The Mooncake breaker's half-open probe gives its slot back on every way out (issue 34, item 6).

A real ``mooncake_master`` on loopback; the faults come from a stand-in around the backend's real client (the
binding's attributes are read-only): its ``batch_is_exist`` can answer ``RPC_FAIL`` (the master down, which
opens the breaker) and its ``health_check`` -- the probe's first call -- can raise or hang. Whatever the probe
did, once the master answers again the breaker closes and calls reach the store.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import NoReturn

import pytest
from hybridkv.store import Status, open_store
from hybridkv.store.base import collect_late_calls
from hybridkv.store.framed import FramedStore
from hybridkv.store.mooncake import MooncakeBackend
from hybridkv_dev.devkit.mooncake import MooncakeMaster
from support.mooncake import RPC_TIMEOUT_MS

pytestmark = pytest.mark.mooncake

#: The breaker's open interval: short, so that the probe comes soon.
RESET_S = 0.2
#: The bound a probe past its deadline must return within: 10x the deadline (a bound, not a timing claim).
BOUND_S = 10 * RPC_TIMEOUT_MS / 1000
#: How long a hung health check waits to be released (longer than ``BOUND_S``: a probe run without the
#: deadline returns only then).
HANG_S = 3 * BOUND_S


class FaultyClient:
    """The real Mooncake client, with the faults the test sets on ``exists`` and ``health_check``."""

    def __init__(self, client: object) -> None:
        self._client = client
        #: ``batch_is_exist`` answers RPC_FAIL (-900) for every key, without reaching the master
        self.master_down = False
        #: what ``health_check`` does: "ok" (ask the master), "raise" or "hang" (until ``release``)
        self.health = "ok"
        self.release = threading.Event()
        #: ``batch_is_exist`` calls that reached the real client
        self.num_exists_calls = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._client, name)

    def health_check(self) -> int:
        if self.health == "raise":
            raise RuntimeError("health_check failed")
        if self.health == "hang":
            self.release.wait(HANG_S)
        return int(self._client.health_check())  # type: ignore[attr-defined]

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        if self.master_down:
            return [-900] * len(keys)
        self.num_exists_calls += 1
        return list(self._client.batch_is_exist(keys))  # type: ignore[attr-defined]


@pytest.fixture
def faulty(mooncake_master: MooncakeMaster) -> Iterator[tuple[FramedStore, FaultyClient]]:
    """A store with a one-failure breaker of ``RESET_S`` whose client is a ``FaultyClient``, holding one key
    ``mc/probe``, with its breaker open (the master reported down)."""
    store = open_store(mooncake_master.url(breaker_failures=1, breaker_reset_s=RESET_S))
    backend = store.backend
    assert isinstance(backend, MooncakeBackend)
    real = backend._store
    client = FaultyClient(real)
    try:
        assert store.put(["mc/probe"], [b"v"]) == [Status.OK]
        backend._store = client
        client.master_down = True
        assert store.exists(["mc/probe"]) == [Status.TRANSFER_FAILED]
        assert store.stats().extra["breaker_opens"] == 1
        client.master_down = False  # the master answers again; only the probe's health check misbehaves
        time.sleep(RESET_S * 2)  # the breaker is half-open now: the next call is the probe
        yield store, client
    finally:
        client.release.set()
        backend._store = real
        store.remove(["mc/probe"])
        store.close()


def _closes_once_healthy(store: FramedStore, client: FaultyClient) -> None:
    """With the health check fine again, an ``exists`` answers from the store within a few reset intervals
    and the breaker is closed."""
    client.health = "ok"
    client.release.set()
    calls_before = client.num_exists_calls
    deadline = time.monotonic() + BOUND_S
    answers = store.exists(["mc/probe"])
    while answers != [Status.OK] and time.monotonic() < deadline:
        time.sleep(RESET_S / 2)
        answers = store.exists(["mc/probe"])
    extra = store.stats().extra
    assert answers == [Status.OK], f"the breaker never closed after the probe: {answers}, {extra}"
    assert extra["breaker_state"] == "closed", extra
    assert client.num_exists_calls > calls_before, "calls must reach the store again"


def test_a_probe_whose_health_check_raises_gives_its_slot_back(
    faulty: tuple[FramedStore, FaultyClient],
) -> None:
    store, client = faulty
    client.health = "raise"
    with pytest.raises(RuntimeError, match="health_check failed"):
        store.exists(["mc/probe"])
    client.health = "ok"  # stats() asks health_check too
    assert store.stats().extra["breaker_opens"] == 2, "a probe that raised reopens the breaker"
    _closes_once_healthy(store, client)


def test_a_probe_whose_health_check_hangs_ends_at_the_deadline_and_gives_its_slot_back(
    faulty: tuple[FramedStore, FaultyClient],
) -> None:
    store, client = faulty
    client.health = "hang"
    start = time.monotonic()
    with collect_late_calls() as late:
        answers = store.exists(["mc/probe"])
    took_s = time.monotonic() - start
    assert took_s < BOUND_S, f"a hung probe held its caller {took_s:.1f} s (deadline {RPC_TIMEOUT_MS} ms)"
    assert answers == [Status.TIMEOUT], answers
    assert len(late) == 1, "the hung probe is a call past its deadline: its handle is handed back"
    client.health = "ok"  # stats() asks health_check too; the hung probe stays hung until released
    extra = store.stats().extra
    assert extra["breaker_opens"] == 2 and extra["num_abandoned_calls"] == 1, extra
    _closes_once_healthy(store, client)
    assert late[0].exception(timeout=BOUND_S) is None, "the released probe went on and returned"


def test_a_call_raising_timeout_error_is_a_failed_call_not_a_missed_deadline(
    faulty: tuple[FramedStore, FaultyClient],
) -> None:
    """On Python 3.11+ ``TimeoutError`` is ``concurrent.futures.TimeoutError``: a call raising it must not be
    read as the runner's expired wait (issue 34, item 8b)."""
    store, client = faulty
    _closes_once_healthy(store, client)
    backend = store.backend
    assert isinstance(backend, MooncakeBackend)

    def raises_timeout(keys: list[str]) -> NoReturn:
        raise TimeoutError("the binding's own timeout")

    client.batch_is_exist = raises_timeout  # type: ignore[method-assign]
    failures_before = store.stats().extra["breaker_failures"]
    with collect_late_calls() as late, pytest.raises(TimeoutError, match="the binding's own timeout"):
        store.exists(["mc/probe"])
    extra = store.stats().extra
    assert extra["num_abandoned_calls"] == 0, "a call that raised is not a call past its deadline"
    assert late == [], "a call that returned (by raising) hands back no late handle"
    assert extra["breaker_failures"] == failures_before + 1, extra
