"""A put over a large file store's capacity evicts what it needs, not a tenth of the store; the background
top-up takes the store on down to the low watermark; the usage estimate stays exact and every eviction is
reported."""

from __future__ import annotations

from pathlib import Path

from hybridkv.store import open_store
from hybridkv.store.base import Status, find_layer
from hybridkv.store.file import FileBackend
from hybridkv.store.file.eviction import SAMPLE_FILES, SYNC_MIN_FILES
from hybridkv.store.file.policy import LOW_WATERMARK

_VALUE_BYTES = 512
_NUM_ENTRIES = 2 * SAMPLE_FILES  # more than one sample: the put's pass cannot see the whole store
_BATCH = 32


def _key(index: int) -> str:
    return f"hkv1/bounded/0123456789ab/g0/tp0/dcp0/{index:032x}"


def test_a_put_over_capacity_evicts_what_it_needs_and_the_top_up_the_rest(tmp_path: Path) -> None:
    probe = open_store(f"file://{tmp_path / 'probe'}?capacity=1048576")
    assert probe.put([_key(0)], [bytes(_VALUE_BYTES)]) == [Status.OK]
    frame_bytes = probe.stats().num_bytes
    probe.close()
    assert frame_bytes
    capacity = _NUM_ENTRIES * frame_bytes + _BATCH * frame_bytes // 2
    store = open_store(f"file://{tmp_path / 'store'}?capacity={capacity}")
    backend = find_layer(store, FileBackend)
    assert backend is not None
    evictor = backend.layout.evictor
    value = bytes(_VALUE_BYTES)
    for first in range(0, _NUM_ENTRIES, 1024):
        keys = [_key(i) for i in range(first, min(_NUM_ENTRIES, first + 1024))]
        assert set(store.put(keys, [value] * len(keys))) == {Status.OK}
    assert backend.layout.num_evicted == 0, "populating must fit the capacity"
    backend.take_evictions()

    new_keys = [_key(_NUM_ENTRIES + i) for i in range(_BATCH)]
    assert store.put(new_keys, [value] * _BATCH) == [Status.OK] * _BATCH
    # The put evicted about what it needed (at least SYNC_MIN_FILES), not the tenth of the store down to the
    # low watermark a whole pass takes.
    num_put_evicted = evictor.num_put_evicted
    assert _BATCH // 2 <= num_put_evicted <= SYNC_MIN_FILES + _BATCH, num_put_evicted
    assert num_put_evicted < (1 - LOW_WATERMARK) * _NUM_ENTRIES / 2
    assert store.exists(new_keys) == [Status.OK] * _BATCH, "the put's own entries must stay"

    assert evictor.wait_idle(120), "the background top-up did not finish"
    stats = store.stats()
    assert stats.num_bytes is not None
    real = stats.num_bytes + int(stats.extra["spare_bytes"])
    assert real <= LOW_WATERMARK * capacity, (real, capacity)
    assert stats.extra["usage_estimate_bytes"] == real, stats.extra
    assert evictor.num_top_up_evicted > 0
    num_evicted = backend.layout.num_evicted
    assert num_evicted == num_put_evicted + evictor.num_top_up_evicted
    assert stats.num_keys == _NUM_ENTRIES + _BATCH - num_evicted
    evictions = backend.take_evictions()
    assert evictions.complete and len(set(evictions.digests)) == num_evicted
    store.close()
