"""Read leases on a real ``mooncake_master`` at capacity: what lookups pin, and for how long (issue 35, item 5).

Mooncake grants a read lease (``--default_kv_lease_ttl``) on the objects a call touches; a leased object cannot
be removed without ``force`` and eviction skips it. In the wheel this project uses
(``mooncake-transfer-engine-non-cuda`` 0.3.13.post1) ``batch_is_exist`` -- every hybridkv lookup and every save's
dedup -- leases like a read does (so does every other probe the binding has: ``get_size``, ``get_replica_desc``,
``batch_get_session_start``; it has no ``batch_probe_key``). What these tests hold:

- a lookup flood over the hot entries of a full store leaves eviction the rest: puts go on succeeding, and the
  probed entries stay;
- a flood over *every* entry (exists or reads) holds puts off (``NO_SPACE``, never an error) only while it runs:
  once it stops, puts succeed again within the lease.

The first test pins the fact itself: should a future wheel probe without a lease, it fails, and
docs/operations.md ("Read leases") and the parity list in the note must say so.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from hybridkv.store import Status, open_store
from hybridkv.store.framed import FramedStore
from hybridkv.store.mooncake import MooncakeBackend
from support.mooncake import RPC_TIMEOUT_MS, SuiteMaster, assert_loopback_only_namespace

pytestmark = pytest.mark.mooncake

#: The master's read lease: long enough to tell apart from the flood's cadence (and to outlast a flood thread
#: descheduled on a loaded 2-core box), short for the runtime.
LEASE_S = 2.0
#: Mooncake's smallest segment: 64 values of ``VALUE_BYTES`` (plus hybridkv's frame headers) fill it.
SEGMENT = "16MiB"
VALUE_BYTES = 256 << 10
#: How long each flood runs while puts go on, and the gap between those puts.
FLOOD_S = 2.0
PUT_GAP_S = 0.02
#: Mooncake's codes for "removed" and "leased" (``OBJECT_HAS_LEASE``), from a remove without ``force``.
REMOVED, HAS_LEASE = 0, -706
#: Slack over the lease for a loaded 2-core box (a bound, not a timing claim).
SLACK_S = 4.0


@pytest.fixture
def full_store(tmp_path: Path) -> Iterator[tuple[FramedStore, list[str]]]:
    """A master of the test's own (lease ``LEASE_S``), one client whose segment is the whole pool, filled
    until the master refuses a put; yields the store and the keys it holds."""
    assert_loopback_only_namespace()
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(RPC_TIMEOUT_MS))
    master = SuiteMaster(tmp_path / "master.log", lease_ttl=f"{int(LEASE_S * 1000)}ms", client_ttl_s=3)
    master.start()
    try:
        store = open_store(master.url(segment=SEGMENT, timeout_ms=5000))
        try:
            keys: list[str] = []
            for i in range(1000):
                key = f"fill/{i}"
                [status] = store.put([key], [_value()])
                if status is Status.NO_SPACE:
                    break
                assert status is Status.OK, f"fill put {key}: {status}"
                keys.append(key)
            assert status is Status.NO_SPACE, f"a {SEGMENT} segment took {len(keys)} values without filling"
            yield store, keys
        finally:
            store.close()
    finally:
        master.stop()


def _value() -> np.ndarray:
    return np.full(VALUE_BYTES, 7, np.uint8)


def _raw_remove(store: FramedStore, key: str) -> int:
    """Mooncake's own ``remove`` without ``force``: ``HAS_LEASE`` while ``key`` is leased."""
    backend = store.backend
    assert isinstance(backend, MooncakeBackend)
    return int(backend._store.remove(key, False))


def _puts_during(
    store: FramedStore, flood: Callable[[], object], prefix: str, stored: list[str] | None = None
) -> list[Status]:
    """Run ``flood`` back to back on a thread for ``FLOOD_S`` while putting new keys every ``PUT_GAP_S``;
    the statuses of those puts. A key that is stored joins ``stored`` (what a flood over every entry reads)."""
    stop = threading.Event()
    rounds = [0]

    def run() -> None:
        while not stop.is_set():
            flood()
            rounds[0] += 1

    thread = threading.Thread(target=run, name="lease-flood")
    thread.start()
    statuses: list[Status] = []
    try:
        time.sleep(0.1)
        end = time.monotonic() + FLOOD_S
        while time.monotonic() < end:
            key = f"{prefix}/{len(statuses)}"
            [status] = store.put([key], [_value()])
            statuses.append(status)
            if status is Status.OK and stored is not None:
                stored.append(key)
            time.sleep(PUT_GAP_S)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive(), "the flood did not stop"
    assert rounds[0] > 10, f"the flood ran only {rounds[0]} rounds in {FLOOD_S} s"
    return statuses


def _seconds_until_a_put_succeeds(store: FramedStore, prefix: str) -> float:
    start = time.monotonic()
    for i in range(100_000):
        [status] = store.put([f"{prefix}/{i}"], [_value()])
        took = time.monotonic() - start
        if status is Status.OK:
            return took
        assert status is Status.NO_SPACE, f"put after the flood: {status}"
        if took > LEASE_S + SLACK_S:
            break
        time.sleep(0.01)
    pytest.fail(f"no put succeeded within {LEASE_S + SLACK_S} s after the flood stopped (lease {LEASE_S} s)")


def test_exists_and_reads_lease_puts_do_not(full_store: tuple[FramedStore, list[str]]) -> None:
    """``exists`` leases the entries it finds, as ``get_into`` does; a put leaves its entry unleased; a lease
    ends after the master's TTL."""
    store, keys = full_store
    probed, read, untouched = keys[-3:]
    assert store.exists([probed]) == [Status.OK]
    assert store.get_into([read], [bytearray(VALUE_BYTES)]) == [Status.OK]
    assert _raw_remove(store, untouched) == REMOVED, "a put must take no lease"
    assert _raw_remove(store, read) == HAS_LEASE, "get_into must lease what it reads"
    assert _raw_remove(store, probed) == HAS_LEASE, (
        "exists no longer leases in this Mooncake wheel: lookups no longer pin the store -- update "
        "docs/operations.md (Read leases) and the parity list of issue 35"
    )
    deadline = time.monotonic() + LEASE_S + SLACK_S
    pending = {probed, read}
    while pending and time.monotonic() < deadline:
        time.sleep(0.1)
        pending = {key for key in pending if _raw_remove(store, key) != REMOVED}
    assert not pending, f"still leased {LEASE_S + SLACK_S} s after one call (lease {LEASE_S} s): {pending}"


def test_a_lookup_flood_on_hot_entries_leaves_eviction_room(
    full_store: tuple[FramedStore, list[str]],
) -> None:
    """Lookups that find half the entries over and over (a hot prefix): puts into the full store go on
    succeeding, eviction takes the entries nobody looks up, and the looked-up ones stay."""
    store, keys = full_store
    hot, cold = keys[: len(keys) // 2], keys[len(keys) // 2 :]
    # The fill's last (refused) put wakes the master's eviction, which may take the oldest entries before the
    # first lookup leases them: the hot set is what the first lookup finds, and from then on it is leased.
    found = store.exists(hot)
    hot = [key for key, status in zip(hot, found, strict=True) if status is Status.OK]
    assert len(hot) >= len(keys) // 4, (
        f"eviction took {len(found) - len(hot)} of {len(found)} before any lookup"
    )
    statuses = _puts_during(store, lambda: store.exists(hot), "new")
    assert set(statuses) <= {Status.OK, Status.NO_SPACE}, statuses
    num_ok = statuses.count(Status.OK)
    assert num_ok >= len(statuses) // 2, (
        f"a lookup flood on hot entries starved puts: {num_ok}/{len(statuses)}"
    )
    assert store.exists(hot) == [Status.OK] * len(hot), "entries looked up within the lease were evicted"
    assert Status.NOT_FOUND in store.exists(cold), "no entry nobody looked up was evicted to make room"


@pytest.mark.parametrize("op", ["exists", "get_into"])
def test_a_flood_over_every_entry_holds_puts_off_only_for_the_lease(
    full_store: tuple[FramedStore, list[str]], op: str
) -> None:
    """Lookups (or reads) of every entry in the store, back to back: nothing is evictable, puts answer
    ``NO_SPACE`` (never an error, so saves are dropped, not held); once the flood stops, puts succeed again
    within the lease."""
    store, keys = full_store
    stored = list(keys)
    destinations = [bytearray(VALUE_BYTES) for _ in range(len(keys) + 64)]

    def flood() -> None:
        current = stored[-len(destinations) :]
        if op == "exists":
            store.exists(current)
        else:
            store.get_into(current, destinations[: len(current)])

    statuses = _puts_during(store, flood, "new", stored)
    assert set(statuses) <= {Status.OK, Status.NO_SPACE}, statuses
    num_refused = statuses.count(Status.NO_SPACE)
    assert num_refused >= len(statuses) // 2, (
        f"{op} of every entry no longer keeps them from eviction ({num_refused}/{len(statuses)} puts refused): "
        f"update docs/operations.md (Read leases)"
    )
    took = _seconds_until_a_put_succeeds(store, "after")
    assert took <= LEASE_S + SLACK_S, took
