"""The Mooncake backend against a real ``mooncake_master`` on loopback: semantics, errors, breaker."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hybridkv.store import Status, open_store
from hybridkv.store.base import collect_late_calls
from hybridkv.store.framed import FramedStore
from hybridkv.store.mooncake import EXISTS_KEYS_PER_CALL, MooncakeBackend, status_of_code
from hybridkv_dev.devkit.mooncake import MooncakeMaster
from support.mooncake import RPC_TIMEOUT_MS, freeze_until_stopped

pytestmark = pytest.mark.mooncake


def test_put_get_exists_remove_with_parts(shared_mooncake_store: FramedStore) -> None:
    store = shared_mooncake_store
    payload = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    keys = ["mc/one", "mc/parts", "mc/empty"]
    assert store.put(keys, [payload, [b"ab", memoryview(b"cd")], b""]) == [Status.OK] * 3
    assert store.put(["mc/one"], [np.zeros(1 << 20, np.uint8)]) == [Status.OK], "insert-if-absent returns OK"
    assert store.exists(keys + ["mc/missing"]) == [Status.OK] * 3 + [Status.NOT_FOUND]
    destination = np.zeros_like(payload)
    parts = [bytearray(1), bytearray(3)]
    statuses = store.get_into(keys + ["mc/missing"], [destination, parts, bytearray(0), bytearray(4)])
    assert statuses == [Status.OK] * 3 + [Status.NOT_FOUND]
    assert np.array_equal(destination, payload), "insert-if-absent: the first value must stay"
    assert parts == [bytearray(b"a"), bytearray(b"bcd")]
    assert store.remove(["mc/one", "mc/missing"]) == [Status.OK, Status.NOT_FOUND]
    assert store.remove_prefix("mc/") == 2
    assert store.exists(keys) == [Status.NOT_FOUND] * 3


def test_exists_of_many_keys_is_answered_in_slices_in_order(shared_mooncake_store: FramedStore) -> None:
    """A lookup's thousands of keys go in ``EXISTS_KEYS_PER_CALL`` slices; the answers keep the keys' order
    across the slices' edges (present keys straddle every edge, the last slice is short)."""
    store = shared_mooncake_store
    backend = store.backend
    assert isinstance(backend, MooncakeBackend)
    per_call = EXISTS_KEYS_PER_CALL
    num_keys = 2 * per_call + 5
    keys = [f"mc/slices/{i}" for i in range(num_keys)]
    present = sorted({0, per_call - 1, per_call, 2 * per_call - 1, 2 * per_call, num_keys - 1, 7})
    assert store.put([keys[i] for i in present], [b"v"] * len(present)) == [Status.OK] * len(present)
    calls: list[int] = []
    client = backend._store

    class CountingClient:  # the binding's attributes are read-only: count through a stand-in
        def __getattr__(self, name: str) -> object:
            return getattr(client, name)

        def batch_is_exist(self, ks: list[str]) -> list[int]:
            calls.append(len(ks))
            return list(client.batch_is_exist(ks))

    backend._store = CountingClient()
    try:
        answers = store.exists(keys)
    finally:
        backend._store = client
    assert calls == [per_call, per_call, 5], f"slices of one exists: {calls}"
    expected = [Status.OK if i in present else Status.NOT_FOUND for i in range(num_keys)]
    assert answers == expected, (
        f"wrong answers at {[i for i in range(num_keys) if answers[i] != expected[i]]}"
    )
    assert store.remove_prefix("mc/slices/") == len(present)


def test_wrong_destination_size_is_corrupt(shared_mooncake_store: FramedStore) -> None:
    store = shared_mooncake_store
    assert store.put(["mc/sized"], [b"x" * 1000]) == [Status.OK]
    assert store.get_into(["mc/sized"], [bytearray(999)]) == [Status.CORRUPT]  # Mooncake: -600
    assert store.get_into(["mc/sized"], [bytearray(1001)]) == [Status.CORRUPT]  # Mooncake: -800 + size check
    store.remove(["mc/sized"])


def test_puts_prefer_the_local_segment(shared_mooncake_store: FramedStore) -> None:
    backend = shared_mooncake_store.backend
    assert isinstance(backend, MooncakeBackend)
    assert backend.preferred_segment == backend.hostname, "rank-local binding must be the default"


def test_error_codes_map_to_statuses() -> None:
    assert status_of_code(-704, "get") is Status.NOT_FOUND
    assert status_of_code(-703, "get") is Status.NOT_FOUND
    assert status_of_code(-200, "put") is Status.NO_SPACE
    assert status_of_code(-901, "exists") is Status.TIMEOUT
    assert status_of_code(-900, "exists") is Status.TRANSFER_FAILED
    assert status_of_code(-800, "get") is Status.TRANSFER_FAILED
    assert status_of_code(-600, "get") is Status.CORRUPT
    assert status_of_code(-600, "put") is Status.TRANSFER_FAILED
    assert status_of_code(-705, "put") is Status.OK


def test_chaos_wrapper_over_mooncake_reports_corruption(mooncake_master: MooncakeMaster) -> None:
    store = open_store("faulty+" + mooncake_master.url(corrupt=1, seed=1))
    try:
        assert store.put(["mc/chaos"], [b"y" * 4096]) == [Status.OK]
        assert store.get_into(["mc/chaos"], [bytearray(4096)]) == [Status.CORRUPT]
    finally:
        store.close()


def _timed(call: object) -> tuple[list[Status], float]:
    start = time.monotonic()
    result = call()  # type: ignore[operator]
    return result, time.monotonic() - start


def _wait_until_ok(store: FramedStore, deadline_s: float) -> float:
    """Retry a put until it works; returns the seconds it took."""
    start = time.monotonic()
    while time.monotonic() - start < deadline_s:
        if store.put([f"mc/probe-{time.monotonic_ns()}"], [b"p"]) == [Status.OK]:
            return time.monotonic() - start
        time.sleep(0.2)
    raise AssertionError(f"store did not recover within {deadline_s} s: {store.stats().extra}")


@pytest.mark.slow
def test_breaker_bounds_a_dead_master(private_mooncake_master: MooncakeMaster) -> None:
    master = private_mooncake_master
    reset_s = 2.0
    store = open_store(master.url(breaker_failures=1, breaker_reset_s=reset_s))
    try:
        assert store.put(["mc/k"], [b"v"]) == [Status.OK]
        master.kill()
        statuses, first_s = _timed(lambda: store.exists(["mc/k"]))
        assert statuses[0] in (Status.TRANSFER_FAILED, Status.TIMEOUT)
        assert first_s < RPC_TIMEOUT_MS / 1000 + 0.5, f"first call after the kill took {first_s:.2f} s"
        for _ in range(20):
            statuses, fast_s = _timed(lambda: store.exists(["mc/k"]))
            assert statuses == [Status.TRANSFER_FAILED] and fast_s < 0.05, (statuses, fast_s)
        extra = store.stats().extra
        assert extra["breaker_state"] == "open" and extra["breaker_fast_failures"] >= 20, extra
        master.start()
        took = _wait_until_ok(store, deadline_s=20.0)
        assert store.stats().extra["breaker_state"] == "closed"
        assert took >= reset_s * 0.5, "the breaker must hold calls back until the reset interval"
    finally:
        store.close()


@pytest.mark.slow
def test_breaker_bounds_a_hung_master(private_mooncake_master: MooncakeMaster) -> None:
    master = private_mooncake_master
    store = open_store(master.url(breaker_failures=1, breaker_reset_s=1.5))
    try:
        assert store.put(["mc/k"], [b"v"]) == [Status.OK]
        freeze_until_stopped(master)
        statuses, first_s = _timed(lambda: store.exists(["mc/k"]))
        assert statuses == [Status.TIMEOUT], statuses
        assert first_s < RPC_TIMEOUT_MS / 1000 + 0.5, f"first call to a hung master took {first_s:.2f} s"
        worst_s = 0.0
        for _ in range(20):
            statuses, fast_s = _timed(lambda: store.get_into(["mc/k"], [bytearray(1)]))
            assert statuses[0] in (Status.TRANSFER_FAILED, Status.TIMEOUT), statuses
            worst_s = max(worst_s, fast_s)
        # While open, calls return at once; a half-open probe (after 1.5 s) may spend one budget.
        assert worst_s < RPC_TIMEOUT_MS / 1000 + 0.5, f"a call took {worst_s:.2f} s while the master hung"
        master.thaw()
        _wait_until_ok(store, deadline_s=20.0)
        destination = bytearray(1)
        assert store.get_into(["mc/k"], [destination]) == [Status.OK] and destination == b"v"
    finally:
        store.close()


@pytest.mark.slow
def test_a_timed_out_get_hands_back_the_handle_of_the_call_still_running(
    private_mooncake_master: MooncakeMaster,
) -> None:
    """``TIMEOUT`` while Mooncake still owns the destination: the caller gets a handle that resolves when the
    call really returns, and only then may it reuse the buffer (hard rule: never touch KV after a report)."""
    master = private_mooncake_master
    # A deadline well below Mooncake's own RPC timeout: the abandoned call outlives it.
    store = open_store(master.url(timeout_ms=RPC_TIMEOUT_MS // 4, breaker_failures=5))
    try:
        assert store.put(["mc/k"], [b"v"]) == [Status.OK]
        freeze_until_stopped(master)
        with collect_late_calls() as late:
            statuses = store.get_into(["mc/k"], [bytearray(1)])
        assert statuses == [Status.TIMEOUT], statuses
        assert len(late) == 1, "a timed-out get must hand back its completion handle"
        assert not late[0].done(), "the handle resolved at the deadline, not when the call returned"
        late[0].exception(timeout=RPC_TIMEOUT_MS / 1000 * 10)  # it does return (Mooncake's RPC timeout)
        master.thaw()
        _wait_until_ok(store, deadline_s=20.0)
    finally:
        master.thaw()
        store.close()


def test_pure_client_puts_land_on_a_storage_node_and_outlive_the_client(
    mooncake_master: MooncakeMaster,
) -> None:
    """``segment=0``: the client mounts nothing, the master places its puts on a storage node's segment,
    and a second pure client (a new engine) reads them after the first one closed."""
    from hybridkv.store.mooncake_node import open_storage_node

    node = open_storage_node(
        mooncake_master.address, "127.0.0.1", segment_bytes=32 << 20, local_buffer_bytes=4 << 20
    )
    try:
        writer = open_store(mooncake_master.url(segment=0))
        assert writer.put(["pure/a"], [b"p" * 50_000]) == [Status.OK]
        backend = writer.backend
        assert isinstance(backend, MooncakeBackend)
        assert backend.preferred_segment == "", "a pure client has no segment to prefer"
        writer.close()
        reader = open_store(mooncake_master.url(segment=0))
        try:
            destination = bytearray(50_000)
            assert reader.get_into(["pure/a"], [destination]) == [Status.OK]
            assert destination == b"p" * 50_000
            assert reader.remove(["pure/a"]) == [Status.OK]
        finally:
            reader.close()
    finally:
        node.close()
