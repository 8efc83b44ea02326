"""The stores report what their own eviction removed (``EvictionReporter.take_evictions``), found through the
wrapper layers with ``find_layer``: capacity and quota eviction, to every handle sharing the store (another
``FileBackend`` on one directory stands for another process), and an incomplete report when a reader fell
behind the bounded record. Removals are not evictions.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from hybridkv.store import open_store
from hybridkv.store.base import EvictionReporter, Evictions, find_layer
from hybridkv.store.file import eviction_log
from hybridkv.store.frame import key_digest
from hybridkv.store.memory import EVICTION_RECORD_LEN
from hybridkv.store.quotas import QUOTAS_FILE

VALUE = b"v" * 4096
CAPACITY = 64 << 10


def _reporter(store: object) -> EvictionReporter:
    reporter = find_layer(store, EvictionReporter)
    assert reporter is not None, f"{store!r} has no eviction report"
    return reporter


def _put_each(store: object, keys: list[str]) -> None:
    for key in keys:
        assert store.put([key], [VALUE])[0].is_ok  # type: ignore[attr-defined]


@pytest.fixture(params=["memory", "file"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return f"memory://evictions-{uuid.uuid4().hex[:8]}?capacity={CAPACITY}"
    return f"file://{tmp_path / 'store'}?capacity={CAPACITY}"


def test_capacity_evictions_reach_every_handle(url: str) -> None:
    writer, other = open_store(url), open_store(url)
    keys = [f"hkv1/ns/fp/g0/tp0/dcp0/{i:04x}" for i in range(40)]  # 160 KiB into 64 KiB
    _put_each(writer, keys)
    present = {key for key, st in zip(keys, writer.exists(keys), strict=True) if st.is_ok}
    evicted = set(keys) - present
    assert evicted, "nothing was evicted"
    digest_to_key = {key_digest(key): key for key in keys}
    for store in (writer, other):
        report = _reporter(store).take_evictions()
        assert report.complete
        assert {digest_to_key[d] for d in report.digests} == evicted
        assert _reporter(store).take_evictions() == Evictions()  # drained: nothing new
    writer.remove(sorted(present)[:2])  # a removal is not an eviction
    assert _reporter(other).take_evictions() == Evictions()


def test_a_handle_reports_only_evictions_after_it_was_opened(url: str) -> None:
    first = open_store(url)
    _put_each(first, [f"hkv1/ns/fp/g0/tp0/dcp0/a{i:03x}" for i in range(40)])
    late = open_store(url)
    assert _reporter(late).take_evictions() == Evictions()
    assert _reporter(first).take_evictions().digests


def test_quota_evictions_are_reported(url: str, tmp_path: Path) -> None:
    quota = 5 * len(VALUE) + 1024
    if url.startswith("memory://"):
        url = f"{url}&quotas=tenant:{quota}"
    else:
        (tmp_path / "store").mkdir()
        (tmp_path / "store" / QUOTAS_FILE).write_text(f'{{"tenant": {quota}}}')
    store = open_store(url)
    keys = [f"hkv1/tenant/fp/g0/tp0/dcp0/{i:04x}" for i in range(8)]  # 8 x 4 KiB into a 5-value quota
    _put_each(store, keys)
    assert store.stats().num_keys is not None and store.stats().num_keys <= 5  # under capacity: quota only
    gone = {key for key, st in zip(keys, store.exists(keys), strict=True) if not st.is_ok}
    report = _reporter(store).take_evictions()
    assert gone and {key_digest(key) for key in gone} == set(report.digests)


def test_a_file_batch_evicted_by_its_own_quota_is_reported(tmp_path: Path) -> None:
    # A batch larger than its tenant's quota writes only its newest frames; the older ones are answered
    # OK but never written: reported as evictions (a caller must not believe they are stored).
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / QUOTAS_FILE).write_text(f'{{"tenant": {3 * len(VALUE) + 1024}}}')
    store = open_store(f"file://{tmp_path / 'store'}?capacity={CAPACITY}")
    keys = [f"hkv1/tenant/fp/g0/tp0/dcp0/{i:04x}" for i in range(6)]
    assert all(st.is_ok for st in store.put(keys, [VALUE] * len(keys)))
    gone = {key for key, st in zip(keys, store.exists(keys), strict=True) if not st.is_ok}
    assert gone and {key_digest(key) for key in gone} == set(_reporter(store).take_evictions().digests)


def test_a_memory_handle_that_falls_behind_gets_an_incomplete_report() -> None:
    url = f"memory://evictions-{uuid.uuid4().hex[:8]}?capacity={len(VALUE) + 1024}"
    store, lagging = open_store(url), open_store(url)
    keys = [f"hkv1/ns/fp/g0/tp0/dcp0/{i:06x}" for i in range(EVICTION_RECORD_LEN + 10)]
    assert _reporter(store).take_evictions() == Evictions()
    for start in range(0, len(keys), 1024):
        _put_each(store, keys[start : start + 1024])
        assert _reporter(store).take_evictions().complete  # keeps up
    report = _reporter(lagging).take_evictions()
    assert not report.complete and len(report.digests) == EVICTION_RECORD_LEN


def test_the_file_log_rotates_and_a_lagging_reader_learns_it_lost_evictions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(eviction_log, "SEGMENT_BYTES", 4 * eviction_log.RECORD_BYTES)
    log = eviction_log.EvictionLog(tmp_path)
    keeping_up, lagging = log.reader(), log.reader()
    digests = [key_digest(f"k{i}") for i in range(40)]
    seen: list[bytes] = []
    for start in range(0, len(digests), 3):  # passes of 3 evictions: a new segment every other pass
        log.append(digests[start : start + 3])
        report = keeping_up.take()
        assert report.complete
        seen.extend(report.digests)
    assert seen == digests
    assert len(log.generations()) == eviction_log.KEEP_SEGMENTS
    report = lagging.take()
    assert not report.complete and report.digests == tuple(digests[-len(report.digests) :])
    log.append(digests[:1])
    assert lagging.take() == Evictions(tuple(digests[:1]))  # caught up: complete again
