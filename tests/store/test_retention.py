"""Retention (``Store.retain``, ``hybridkv.store.retention``): retained entries go last, within a budget, on
the memory store and on the file store (where the retention is a file's mtime, so every process sharing the
directory honours it)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hybridkv.store import open_store
from hybridkv.store.base import Status
from hybridkv.store.framed import FramedStore
from hybridkv.store.quotas import write_quotas

VALUE = 100_000
#: Capacity for ten framed values; the retention budget (half of it) holds five.
CAPACITY = 10 * VALUE + 5000


#: Opens a store of ``CAPACITY`` with the given quotas (namespace -> bytes).
StoreFactory = Callable[[dict[str, int]], FramedStore]


def _memory(quotas: dict[str, int] | None = None) -> FramedStore:
    text = ",".join(f"{namespace}:{size}" for namespace, size in (quotas or {}).items())
    return open_store(
        f"memory://retain-{uuid.uuid4().hex}?capacity={CAPACITY}" + (f"&quotas={text}" * bool(text))
    )


@pytest.fixture(params=["memory", "file"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    if request.param == "memory":
        return _memory

    def file_store(quotas: dict[str, int] | None = None) -> FramedStore:
        store = open_store(f"file://{tmp_path}/store?capacity={CAPACITY}")
        write_quotas(tmp_path / "store", quotas or {})
        return store

    return file_store


def _value(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, VALUE, dtype=np.uint8)


def _present(store: FramedStore, keys: list[str]) -> list[bool]:
    return [status is Status.OK for status in store.exists(keys)]


def _flood(store: FramedStore, count: int, start: int = 0) -> list[str]:
    keys = [f"flood/{index}" for index in range(start, start + count)]
    for index, key in enumerate(keys):
        assert store.put([key], [_value(1000 + start + index)]) == [Status.OK]
    return keys


def test_retained_entries_outlive_a_flood_and_read_back_exact(make_store: StoreFactory) -> None:
    store = make_store({})
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


def test_retention_is_bounded_by_half_the_capacity(make_store: StoreFactory) -> None:
    """Eight retained entries, room for five protected: the five expiring last survive the flood, puts never
    fail because of retention."""
    store = make_store({})
    retained = [f"retained/{index}" for index in range(8)]
    store.put(retained, [_value(index) for index in range(8)])
    now = time.time()
    for index, key in enumerate(retained):
        assert store.retain([key], now + 600 + index) == [Status.OK]
    _flood(store, 30)
    assert _present(store, retained) == [False] * 3 + [True] * 5
    store.close()


def test_a_released_or_expired_entry_is_ordinary_again(make_store: StoreFactory) -> None:
    store = make_store({})
    keys = ["session/released", "session/expiring", "session/kept"]
    store.put(keys, [_value(index) for index in range(3)])
    assert store.retain(keys[1:2], time.time() + 0.2) == [Status.OK]
    assert store.retain([keys[0], keys[2]], time.time() + 600) == [Status.OK, Status.OK]
    assert store.retain(keys[:1], 0.0) == [Status.OK]  # released
    time.sleep(0.3)  # the second one's retention has ended (a loaded machine only sleeps longer)
    _flood(store, 30)
    assert _present(store, keys) == [False, False, True]
    if "num_retained" in store.stats().extra:  # the memory store counts them
        assert store.stats().extra["num_retained"] == 1
    store.close()


def test_a_tenant_at_its_quota_evicts_its_unretained_entries_first(make_store: StoreFactory) -> None:
    store = make_store({"agent": 4 * VALUE + 2000})
    keys = [f"hkv1/agent/fp/g0/tp0/dcp0/{index:02x}" for index in range(4)]
    store.put(keys, [_value(index) for index in range(4)])
    assert store.retain(keys[:1], time.time() + 600) == [Status.OK]  # the oldest, retained
    store.put(["hkv1/agent/fp/g0/tp0/dcp0/ff"], [_value(9)])
    present = _present(store, keys)
    # The retained one stays; the tenant's oldest unretained ones went (the memory store evicts what the put
    # needs, the file store down to 90 % of the quota).
    assert present[0] and not present[1] and present[3], present
    assert present in ([True, False, True, True], [True, False, False, True]), present
    store.close()


def test_retention_yields_to_the_quota(make_store: StoreFactory) -> None:
    """The conformance machine's shrunk case, at this file's sizes: a tenant retains its one entry, then puts
    one that fits its quota only without it. The quota is a hard bound: the put lands (it is not refused for
    the retention), the retained entry goes, the tenant ends within its quota."""
    quota = VALUE + VALUE // 2
    store = make_store({"t2": quota})
    retained, newer = "hkv1/t2/fp/g0/tp0/dcp0/01", "hkv1/t2/fp/g0/tp0/dcp0/02"
    small = _value(1)[: VALUE * 6 // 10]  # within half the quota, but not beside the newer entry
    assert store.put([retained], [small]) == [Status.OK]
    assert store.retain([retained], time.time() + 600) == [Status.OK]
    assert store.put([newer], [_value(2)]) == [Status.OK]
    assert _present(store, [retained, newer]) == [False, True]
    assert store.stats().extra["tenants"]["t2"]["usage_bytes"] <= quota
    store.close()


def test_a_retained_entry_survives_its_tenants_puts_that_fit_beside_it(make_store: StoreFactory) -> None:
    """The other side of the rule: while the tenant's retained bytes fit half its quota and each put fits
    the quota beside them, the tenant's puts evict its ordinary entries and the retained one stays."""
    store = make_store({"t2": 3 * VALUE + 3000})
    retained = "hkv1/t2/fp/g0/tp0/dcp0/00"
    assert store.put([retained], [_value(0)]) == [Status.OK]
    assert store.retain([retained], time.time() + 600) == [Status.OK]
    for index in range(1, 8):
        key = f"hkv1/t2/fp/g0/tp0/dcp0/{index:02x}"
        assert store.put([key], [_value(index)]) == [Status.OK]
        assert _present(store, [retained, key]) == [True, True], index
    assert store.stats().extra["tenants"]["t2"]["usage_bytes"] <= 3 * VALUE + 3000
    store.close()


def test_another_process_sharing_the_directory_honours_a_retention(tmp_path: Path) -> None:
    """The file store's retention lives on disk: one store object retains, another (as another engine on
    the host would) floods the directory, and the retained entries are still there."""
    url = f"file://{tmp_path}/store?capacity={CAPACITY}"
    first, second = open_store(url), open_store(url)
    session = [f"session/{index}" for index in range(3)]
    first.put(session, [_value(index) for index in range(3)])
    assert first.retain(session, time.time() + 600) == [Status.OK] * 3
    _flood(second, 30)
    assert all(_present(second, session)), "the other store object evicted a retained entry"
    first.close()
    second.close()


def test_stores_that_cannot_retain_say_so() -> None:
    chaos = open_store(f"faulty+memory://retain-{uuid.uuid4().hex}?get_fail=0.5&seed=3")
    chaos.put(["k"], [b"x"])
    assert chaos.supports_retention and chaos.retain(["k", "absent"], time.time() + 60) == [
        Status.OK,
        Status.NOT_FOUND,
    ]
    chaos.close()
