"""Quotas per tenant (namespace): a tenant at its quota evicts its own oldest entries, never another's.

The conformance machine (tests/store/test_fuzz.py, ``quotas=``) checks the rules on random call sequences;
these tests pin the scenarios an operator relies on, on the memory store and the file store."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hybridkv.cli import main
from hybridkv.key_grammar import namespace_of
from hybridkv.store import StoreError, open_store
from hybridkv.store.base import Status, find_layer
from hybridkv.store.file import FileBackend
from hybridkv.store.framed import FramedStore
from hybridkv.store.quotas import (
    OTHER_TENANTS,
    parse_quotas,
    read_quotas,
    tenant_counters_of,
    write_quotas,
)

VALUE = 40_000
#: Room for four framed values of tenant ``agent``; ``flood`` may hold two.
QUOTAS = {"agent": 4 * VALUE + 2000, "flood": 2 * VALUE + 1000}

StoreFactory = Callable[[dict[str, int]], FramedStore]


def _memory(quotas: dict[str, int]) -> FramedStore:
    text = ",".join(f"{namespace}:{size}" for namespace, size in quotas.items())
    return open_store(f"memory://quota-{uuid.uuid4().hex}?quotas={text}")


@pytest.fixture(params=["memory", "file"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    if request.param == "memory":
        return _memory

    def file_store(quotas: dict[str, int]) -> FramedStore:
        store = open_store(f"file://{tmp_path}/store?capacity=64MiB")
        write_quotas(tmp_path / "store", quotas)
        return store

    return file_store


def _value(seed: int, size: int = VALUE) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _keys(namespace: str, count: int, start: int = 0) -> list[str]:
    return [f"hkv1/{namespace}/fp/g0/tp0/dcp0/{index:04x}" for index in range(start, start + count)]


def _present(store: FramedStore, keys: list[str]) -> list[bool]:
    return [status is Status.OK for status in store.exists(keys)]


def _tenants(store: FramedStore) -> dict[str, dict[str, int]]:
    tenants = store.stats().extra["tenants"]
    assert isinstance(tenants, dict)
    return tenants


def test_a_flooding_tenant_evicts_only_its_own_entries(make_store: StoreFactory) -> None:
    store = make_store(QUOTAS)
    agent_keys = _keys("agent", 4)
    assert store.put(agent_keys, [_value(i) for i in range(4)]) == [Status.OK] * 4
    other_keys = _keys("no-quota", 3)
    store.put(other_keys, [_value(10 + i) for i in range(3)])
    flood_keys = _keys("flood", 12)
    for index, key in enumerate(flood_keys):  # one put per call: each may evict the flood's older ones
        assert store.put([key], [_value(100 + index)]) == [Status.OK]
    assert all(_present(store, agent_keys)), "the flood evicted another tenant's entries"
    assert all(_present(store, other_keys)), "the flood evicted entries of a namespace without a quota"
    flood_present = _present(store, flood_keys)
    assert flood_present[-1] and not any(flood_present[:8]), (
        f"the flood tenant should keep only its newest entries, kept {flood_present}"
    )
    tenants = _tenants(store)
    assert tenants["flood"]["usage_bytes"] <= QUOTAS["flood"]
    assert tenants["flood"]["num_quota_evicted"] >= 10
    assert tenants["agent"]["num_quota_evicted"] == 0
    destination = np.empty(VALUE, dtype=np.uint8)
    assert store.get_into([agent_keys[0]], [destination]) == [Status.OK]
    assert np.array_equal(destination, _value(0))
    store.close()


def test_inside_a_tenant_the_least_recently_used_entry_goes_first(make_store: StoreFactory) -> None:
    store = make_store(QUOTAS)
    keys = _keys("agent", 4)
    for index, key in enumerate(keys):
        store.put([key], [_value(index)])
    # A read of the oldest entry makes the second oldest the tenant's least recently used. (The file
    # store's LRU clock is a file's mtime, refreshed at most once a second: age the files to see it.)
    _age_files(store, keys)
    assert store.exists([keys[0]]) == [Status.OK]
    store.put(_keys("agent", 1, start=100), [_value(100)])
    present = _present(store, keys)
    # The file store evicts down to 90 % of the quota (one pass per 10 % written), so it may take the
    # third oldest too; the entry just read and the newest stay.
    assert present[0] and not present[1] and present[3], f"kept {present}"
    store.close()


def _age_files(store: FramedStore, keys: list[str]) -> None:
    """Give a file store's files distinct mtimes in key order, all older than the touch interval."""
    layout = getattr(store._backend, "layout", None)
    if layout is None:
        return
    now = time.time()
    for index, key in enumerate(keys):
        stamp = now - 100 + index
        os.utime(layout.path_of(key), (stamp, stamp))


def test_a_value_larger_than_the_quota_is_refused_and_counted(make_store: StoreFactory) -> None:
    store = make_store(QUOTAS)
    kept = _keys("flood", 2)
    store.put(kept, [_value(1), _value(2)])
    [too_big] = _keys("flood", 1, start=50)
    assert store.put([too_big], [_value(3, QUOTAS["flood"] + 1)]) == [Status.NO_SPACE]
    assert store.exists([too_big]) == [Status.NOT_FOUND]
    assert all(_present(store, kept)), "a refused put evicted the tenant's entries"
    assert _tenants(store)["flood"]["num_refused_puts"] == 1
    store.close()


def test_removing_entries_gives_their_bytes_back_to_the_tenant(make_store: StoreFactory) -> None:
    store = make_store(QUOTAS)
    keys = _keys("flood", 2)
    store.put(keys, [_value(1), _value(2)])
    assert store.remove(keys) == [Status.OK, Status.OK]
    assert _tenants(store)["flood"]["usage_bytes"] == 0
    fresh = _keys("flood", 2, start=10)
    store.put(fresh, [_value(3), _value(4)])
    assert all(_present(store, fresh))
    assert _tenants(store)["flood"]["num_quota_evicted"] == 0
    store.close()


def test_file_store_processes_share_the_directory_quotas(tmp_path: Path) -> None:
    """Two handles (as two engines) on one directory: quotas written after both opened apply to both, and
    the tenant's bytes are counted across them."""
    url = f"file://{tmp_path}/store?capacity=64MiB"
    first, second = open_store(url), open_store(url)
    write_quotas(tmp_path / "store", {"flood": QUOTAS["flood"]})
    keys = _keys("flood", 6)
    for index, key in enumerate(keys):
        (first if index % 2 else second).put([key], [_value(index)])
    assert _present(first, keys)[:3] == [False] * 3
    assert _tenants(first)["flood"]["usage_bytes"] <= QUOTAS["flood"]
    write_quotas(tmp_path / "store", {})  # dropped: no tenant bookkeeping, nothing evicted any more
    more = _keys("flood", 4, start=20)
    second.put(more, [_value(20 + i) for i in range(4)])
    assert all(_present(first, more))
    assert "tenants" not in first.stats().extra
    first.close()
    second.close()


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("quotas=agent", "is not NAMESPACE:SIZE"),
        ("quotas=agent:64m", "ambiguous"),
        ("quotas=a/b:1MiB", "is not a namespace"),
        ("quotas=agent:0", "must be > 0"),
        ("quotas=agent:1MiB,agent:2MiB", "two quotas"),
        ("capacity=1MiB&quotas=agent:2MiB", "above the store's capacity"),
    ],
)
def test_bad_memory_quotas_are_refused_naming_the_parameter(query: str, named: str) -> None:
    with pytest.raises(StoreError, match="parameter quotas=") as error:
        open_store(f"memory://bad-{uuid.uuid4().hex}?{query}")
    assert named in str(error.value)


def test_quota_command_sets_reads_and_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/store?capacity=1GiB"
    open_store(url).close()
    assert main(["store", "quota", url, "--set", "team-a=100MiB", "--set", "team-b=1MB"]) == 0
    assert "team-b     1000000B" in capsys.readouterr().out
    assert read_quotas(tmp_path / "store") == {"team-a": 100 << 20, "team-b": 10**6}
    assert main(["store", "quota", url, "--clear", "team-b", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["tenants"]) == {"team-a"}
    for bad, message in [
        (["--set", "team-a=2GiB"], "above the store's capacity"),
        (["--set", "team a=1GiB"], "is not a namespace"),
        (["--set", "team-a"], "expected NS=SIZE"),
        (["--clear", "nobody"], "has no quota to clear"),
    ]:
        assert main(["store", "quota", url, *bad]) == 2
        assert message in capsys.readouterr().err
    assert read_quotas(tmp_path / "store") == {"team-a": 100 << 20}, "a refused change wrote the quotas"
    assert main(["store", "quota", f"memory://x-{uuid.uuid4().hex}"]) == 2
    assert "part of its URL" in capsys.readouterr().err
    assert main(["store", "quota", "mooncake://127.0.0.1:1"]) == 2
    assert "knows no tenants" in capsys.readouterr().err
    assert main(["store", "quota", f"file://{tmp_path}/absent"]) == 2
    assert not (tmp_path / "absent").exists(), "the quota command created a store"


def test_a_quota_file_that_is_not_json_keeps_the_last_quotas(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store?capacity=64MiB"
    store = open_store(url)
    write_quotas(tmp_path / "store", {"flood": QUOTAS["flood"]})
    keys = _keys("flood", 3)
    store.put(keys[:1], [_value(0)])
    (tmp_path / "store" / "quotas.json").write_text("{not json")
    store.put(keys[1:], [_value(1), _value(2)])
    assert _present(store, keys) == [False, True, True], "the last quotas read were not enforced"
    store.close()


def test_parsing_helpers() -> None:
    assert namespace_of("hkv1/team-a/fp/g0/tp0/dcp0/ab") == "team-a"
    assert namespace_of("other/team-a/x") is None
    assert namespace_of("hkv1/") is None
    assert parse_quotas(" a:1KiB , b:2KB ,") == {"a": 1024, "b": 2000}
    assert parse_quotas("") == {}


#: A store holding eight framed values; the agent's five leave room for three more.
_SMALL_CAPACITY = 8 * (VALUE + 200)


@pytest.fixture(params=["memory", "file"])
def make_small_store(request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    """Stores of ``_SMALL_CAPACITY`` with ``quotas``: capacity eviction can reach another tenant."""
    if request.param == "memory":

        def memory_store(quotas: dict[str, int]) -> FramedStore:
            text = ",".join(f"{namespace}:{size}" for namespace, size in quotas.items())
            return open_store(f"memory://quota-{uuid.uuid4().hex}?capacity={_SMALL_CAPACITY}&quotas={text}")

        return memory_store

    def file_store(quotas: dict[str, int]) -> FramedStore:
        store = open_store(f"file://{tmp_path}/store?capacity={_SMALL_CAPACITY}")
        write_quotas(tmp_path / "store", quotas)
        return store

    return file_store


def test_a_batch_larger_than_the_quota_keeps_its_newest_and_evicts_no_other_tenant(
    make_small_store: StoreFactory,
) -> None:
    """One put of more bytes than the tenant's whole quota (each value within it): the tenant keeps the
    batch's newest values that fit, as if they had been put one by one, and the store does not grow past
    what the quota allows -- so the agent's entries, in a store that had room for the quota, stay."""
    store = make_small_store({"flood": QUOTAS["flood"]})
    agent_keys = _keys("agent", 5)
    assert store.put(agent_keys, [_value(i) for i in range(5)]) == [Status.OK] * 5
    flood_keys = _keys("flood", 4)
    assert store.put(flood_keys, [_value(100 + i) for i in range(4)]) == [Status.OK] * 4
    assert all(_present(store, agent_keys)), (
        f"a put of a tenant past its quota evicted another tenant's entries: {_present(store, agent_keys)}"
    )
    assert _present(store, flood_keys) == [False, False, True, True]
    flood = _tenants(store)["flood"]
    assert flood["usage_bytes"] <= QUOTAS["flood"]
    assert flood["num_quota_evicted"] == 2
    destination = np.empty(VALUE, dtype=np.uint8)
    assert store.get_into([flood_keys[3]], [destination]) == [Status.OK]
    assert np.array_equal(destination, _value(103))
    store.close()


def test_capacity_evictions_are_counted_per_tenant(make_small_store: StoreFactory) -> None:
    """A full store evicts least recently used first across tenants (quotas do not change that): each
    tenant's counters say how many of its entries went so, the rest of the store's under ``_other``."""
    store = make_small_store({"flood": QUOTAS["flood"]})
    flood_keys = _keys("flood", 2)
    store.put(flood_keys, [_value(i) for i in range(2)])
    _age_files(store, flood_keys)
    agent_keys = _keys("agent", 7)
    assert store.put(agent_keys, [_value(10 + i) for i in range(7)]) == [Status.OK] * 7
    num_flood_gone = _present(store, flood_keys).count(False)
    assert num_flood_gone >= 1, "the full store evicted none of its oldest entries"
    counters = tenant_counters_of(store)
    assert set(counters) == {"flood", OTHER_TENANTS}
    assert counters["flood"].num_capacity_evicted == num_flood_gone
    assert counters["flood"].num_quota_evicted == 0
    assert counters["flood"].usage_bytes == _tenants(store)["flood"]["usage_bytes"]
    assert counters[OTHER_TENANTS].num_capacity_evicted == 0
    assert _tenants(store)["flood"]["num_capacity_evicted"] == num_flood_gone
    _age_files(store, agent_keys)
    more = _keys("other-agent", 4)
    store.put(more, [_value(20 + i) for i in range(4)])
    num_agent_gone = _present(store, agent_keys).count(False)
    assert num_agent_gone >= 1
    counters = tenant_counters_of(store)
    assert counters[OTHER_TENANTS].num_capacity_evicted == num_agent_gone
    assert counters[OTHER_TENANTS].quota_bytes == 0
    num_bytes = store.stats().num_bytes
    assert num_bytes is not None
    assert counters[OTHER_TENANTS].usage_bytes == num_bytes - counters["flood"].usage_bytes
    store.close()


def test_tenant_counters_of_a_store_without_quotas_is_empty(tmp_path: Path) -> None:
    assert tenant_counters_of(_memory({})) == {}
    assert tenant_counters_of(open_store(f"file://{tmp_path}/s?capacity=1MiB")) == {}
    assert tenant_counters_of(object()) == {}


# -- accounting that must not drift low (issue 34, item 7) -------------------------------------------------


def test_a_quota_set_on_a_tenant_that_holds_data_applies_at_the_next_put(tmp_path: Path) -> None:
    """A tenant holding about four times its quota when the quota is set is within it after the next put, of any
    tenant: the tenants' estimates are rebuilt from the files once the quotas change, not started at 0."""
    directory = tmp_path / "store"
    store = open_store(f"file://{directory}?capacity=64MiB")
    live = _keys("flood", 8)
    assert store.put(live, [_value(i) for i in range(8)]) == [Status.OK] * 8
    write_quotas(directory, {"flood": QUOTAS["flood"]})
    assert _tenants(store)["flood"]["usage_bytes"] > 3 * QUOTAS["flood"]
    other = _keys("agent", 1)
    assert store.put(other, [_value(20)]) == [Status.OK]
    flood = _tenants(store)["flood"]
    assert flood["usage_bytes"] <= QUOTAS["flood"], (
        f"tenant holds {flood['usage_bytes']} bytes after a put, quota {QUOTAS['flood']}"
    )
    assert flood["num_quota_evicted"] >= 6
    more = _keys("flood", 4, start=10)
    for index, key in enumerate(more):  # its own puts keep it there
        store.put([key], [_value(30 + index)])
        assert _tenants(store)["flood"]["usage_bytes"] <= QUOTAS["flood"]
    store.close()


def test_a_tenant_pass_keeps_another_process_reservation_for_a_put_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two handles on one directory (as two engines): the first reserves its entry and is stopped before it
    publishes; the second's puts pass the quota and run the tenant's pass, which must count the first's
    reservation -- else, once the first publishes, the estimate is one entry low and the tenant passes its
    quota without any eviction."""
    directory = tmp_path / "store"
    url = f"file://{directory}?capacity=64MiB"
    first, second = open_store(url), open_store(url)
    quota = QUOTAS["agent"]  # four entries
    write_quotas(directory, {"agent": quota})
    backend = find_layer(first, FileBackend)
    assert backend is not None
    publishing, release = threading.Event(), threading.Event()
    real_publish = backend.writer._publish

    def stopped_publish(*args: Any) -> Any:
        publishing.set()
        assert release.wait(30), "never released"
        return real_publish(*args)

    monkeypatch.setattr(backend.writer, "_publish", stopped_publish)
    in_flight = threading.Thread(target=first.put, args=(_keys("agent", 1, start=100), [_value(100)]))
    in_flight.start()
    try:
        assert publishing.wait(30), "the first put never reached its publish"
        for index, key in enumerate(_keys("agent", 4)):  # the fourth passes the quota: the tenant's pass
            assert second.put([key], [_value(index)]) == [Status.OK]
    finally:
        release.set()
        in_flight.join(30)
    assert _tenants(second)["agent"]["usage_bytes"] <= quota
    for index, key in enumerate(_keys("agent", 3, start=10)):
        assert second.put([key], [_value(10 + index)]) == [Status.OK]
        usage = _tenants(second)["agent"]["usage_bytes"]
        assert usage <= quota, f"tenant holds {usage} bytes after a put, quota {quota}"
    first.close()
    second.close()
