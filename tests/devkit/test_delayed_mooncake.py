"""A real ``mooncake_master`` and storage node behind ``DelayProxy``: hybridkv's store works through it, and
every ``exists`` pays the master link's round trip while a client of the master itself does not."""

from __future__ import annotations

import socket
import statistics
import time

import numpy as np
import pytest
from hybridkv.store import Status, open_store
from hybridkv.store.framed import FramedStore
from hybridkv_dev.devkit.delayed_mooncake import delayed_mooncake, delayed_mooncake_store
from support.mooncake import assert_loopback_only_namespace

pytestmark = pytest.mark.mooncake


def _exists_times_s(store: FramedStore, keys: list[str], num_calls: int) -> list[float]:
    times = []
    for _ in range(num_calls):
        start = time.perf_counter()
        statuses = store.exists(keys)
        times.append(time.perf_counter() - start)
        assert statuses == [Status.OK] * (len(keys) - 1) + [Status.NOT_FOUND], statuses
    return times


def test_put_exists_get_through_the_delayed_master() -> None:
    assert_loopback_only_namespace()
    delay_ms = 20.0
    payload = np.random.default_rng(7).integers(0, 256, 256 << 10, dtype=np.uint8)
    with delayed_mooncake(delay_ms) as deployment:
        assert deployment.url.startswith(f"mooncake://{deployment.proxy_address}?segment=0&")
        store = open_store(deployment.url)
        try:
            assert store.put(["delayed/a", "delayed/b"], [payload, b"small"]) == [Status.OK] * 2
            keys = ["delayed/a", "delayed/b", "delayed/missing"]
            exists_s = _exists_times_s(store, keys, 10)
            destination = np.zeros_like(payload)
            small = bytearray(5)
            assert store.get_into(keys, [destination, small, bytearray(1)]) == [
                Status.OK,
                Status.OK,
                Status.NOT_FOUND,
            ]
            assert np.array_equal(destination, payload) and small == b"small"
        finally:
            store.close()
        # The same entries through a client of the master itself: no delay on its link.
        direct = open_store(deployment.url.replace(deployment.proxy_address, deployment.master_address))
        try:
            direct_exists_s = _exists_times_s(direct, keys, 10)
        finally:
            direct.close()
    delay_s = delay_ms / 1000
    assert min(exists_s) >= 2 * delay_s, f"an exists took {min(exists_s) * 1e3:.2f} ms < 2 x {delay_ms} ms"
    # one master round trip per exists, not two; slack for a busy 2-core host
    assert statistics.median(exists_s) < 2 * delay_s + 0.015, f"exists median {statistics.median(exists_s)}"
    assert statistics.median(direct_exists_s) < delay_s, (
        f"exists without the proxy took {statistics.median(direct_exists_s) * 1e3:.2f} ms: the delay is "
        f"not the proxy's"
    )
    stats = deployment.proxy_stats
    assert stats is not None, "no counters from the proxy process"
    # the client's master RPCs went through the proxy (and only the engine's client: one connection)
    assert stats.num_connections >= 1 and stats.num_failed_connections == 0, stats
    assert stats.num_bytes_to_target > 0 and stats.num_bytes_to_client > 0, stats


def test_the_url_helper_and_its_contract() -> None:
    assert_loopback_only_namespace()
    with pytest.raises(ValueError, match="round trips"), delayed_mooncake_store(100.0, timeout_ms=500):
        pass
    with delayed_mooncake_store(0.0) as url:
        store = open_store(url)
        try:
            assert store.put(["zero/a"], [b"v" * 100]) == [Status.OK]
            assert store.exists(["zero/a"]) == [Status.OK]
        finally:
            store.close()
    # the deployment is gone with the block: nothing listens where the URL points
    proxy_port = int(url.removeprefix("mooncake://").split("?")[0].rpartition(":")[2])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy_port), timeout=5).close()
