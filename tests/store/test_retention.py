"""Retention (``Store.retain``, ``hybridkv.store.retention``): retained entries go last, within a budget."""

from __future__ import annotations

import time
import uuid

import numpy as np
from hybridkv.store import open_store
from hybridkv.store.base import Status
from hybridkv.store.framed import FramedStore

VALUE = 100_000
#: Capacity for ten framed values; the retention budget (half of it) holds five.
CAPACITY = 10 * VALUE + 5000


def _memory(params: str = "") -> FramedStore:
    return open_store(f"memory://retain-{uuid.uuid4().hex}?capacity={CAPACITY}{params}")


def _value(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, VALUE, dtype=np.uint8)


def _present(store: FramedStore, keys: list[str]) -> list[bool]:
    return [status is Status.OK for status in store.exists(keys)]


def _flood(store: FramedStore, count: int, start: int = 0) -> list[str]:
    keys = [f"flood/{index}" for index in range(start, start + count)]
    for index, key in enumerate(keys):
        assert store.put([key], [_value(1000 + start + index)]) == [Status.OK]
    return keys


def test_retained_entries_outlive_a_flood_and_read_back_exact() -> None:
    store = _memory()
    session = [f"session/{index}" for index in range(3)]
    store.put(session, [_value(index) for index in range(3)])
    assert store.retain([*session, "absent"], time.time() + 600) == [Status.OK] * 3 + [Status.NOT_FOUND]
    flood = _flood(store, 30)
    assert all(_present(store, session)), "a retained entry was evicted while ordinary ones remained"
    assert sum(_present(store, flood)) <= 7, "the flood kept more entries than the capacity holds"
    destination = np.empty(VALUE, dtype=np.uint8)
    assert store.get_into([session[1]], [destination]) == [Status.OK]
    assert np.array_equal(destination, _value(1))
    store.close()


def test_retention_is_bounded_by_half_the_capacity() -> None:
    """Eight retained entries, room for five protected: the five expiring last survive the flood, puts never
    fail because of retention."""
    store = _memory()
    retained = [f"retained/{index}" for index in range(8)]
    store.put(retained, [_value(index) for index in range(8)])
    now = time.time()
    for index, key in enumerate(retained):
        assert store.retain([key], now + 600 + index) == [Status.OK]
    _flood(store, 30)
    assert _present(store, retained) == [False] * 3 + [True] * 5
    store.close()


def test_a_released_or_expired_entry_is_ordinary_again() -> None:
    store = _memory()
    keys = ["session/released", "session/expiring", "session/kept"]
    store.put(keys, [_value(index) for index in range(3)])
    assert store.retain(keys[1:2], time.time() + 0.2) == [Status.OK]
    assert store.retain([keys[0], keys[2]], time.time() + 600) == [Status.OK, Status.OK]
    assert store.retain(keys[:1], 0.0) == [Status.OK]  # released
    time.sleep(0.3)  # the second one's retention has ended (a loaded machine only sleeps longer)
    _flood(store, 30)
    assert _present(store, keys) == [False, False, True]
    assert store.stats().extra["num_retained"] == 1
    store.close()


def test_a_tenant_at_its_quota_evicts_its_unretained_entries_first() -> None:
    store = _memory(f"&quotas=agent:{4 * VALUE + 2000}")
    keys = [f"hkv1/agent/fp/g0/tp0/dcp0/{index:02x}" for index in range(4)]
    store.put(keys, [_value(index) for index in range(4)])
    assert store.retain(keys[:1], time.time() + 600) == [Status.OK]  # the oldest, retained
    store.put(["hkv1/agent/fp/g0/tp0/dcp0/ff"], [_value(9)])
    assert _present(store, keys) == [True, False, True, True]
    store.close()


def test_stores_that_cannot_retain_say_so(tmp_path: object) -> None:
    file_store = open_store(f"file://{tmp_path}/store?capacity=64MiB")
    file_store.put(["k"], [b"x"])
    assert not file_store.supports_retention
    assert file_store.retain(["k"], time.time() + 60) == [Status.TRANSFER_FAILED]
    file_store.close()
    chaos = open_store(f"faulty+memory://retain-{uuid.uuid4().hex}?get_fail=0.5&seed=3")
    chaos.put(["k"], [b"x"])
    assert chaos.supports_retention and chaos.retain(["k", "absent"], time.time() + 60) == [
        Status.OK,
        Status.NOT_FOUND,
    ]
    chaos.close()
