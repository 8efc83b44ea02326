"""Evictions reach the KV event stream: a store that evicts a published block under capacity makes the
connector publish ``BlockRemoved`` for it, inside vLLM's real ``Scheduler`` (TP = DCP = 2, full attention +
Mamba), on the memory and the file store.

- The view the events imply (stored minus removed) equals the namespace's blocks in the store after a
  filler evicted them, and no event names a block that is gone.
- The race: a block evicted after its put but before the ranks' report reached the scheduler, with the
  eviction drained first, is not published (and one stored again meanwhile is).
- A store that reports no evictions (a view without ``take_evictions``) publishes as before: nothing
  followed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hybridkv.connector.identity import MANIFEST_NAME
from hybridkv.connector.metadata import HybridStoreWorkerMetadata, SaveOutcome, SaveResult
from hybridkv.store import open_store
from support.scheduler import make_request, make_scheduler

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("lookups_settle")]

RANKS = (0, 1)
VALUE = b"v" * 4096
CAPACITY = 96 << 10


@pytest.fixture(params=["memory", "file"])
def capped(objs: dict[str, Any], request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """``objs`` with a store of ``CAPACITY`` bytes: ``memory://`` or ``file://``."""
    if request.param == "memory":
        url = f"{objs['store_url']}?capacity={CAPACITY}"
    else:
        url = f"file://{tmp_path / 'store'}?capacity={CAPACITY}"
    objs["extra"]["store"] = url
    return {**objs, "store_url": url}


def _replay(events: list[Any]) -> set[tuple[Any, Any]]:
    """The view a subscriber builds from the store-tier events: (vLLM group, block hash)."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    blocks: set[tuple[Any, Any]] = set()
    for e in events:
        if isinstance(e, AllBlocksCleared):
            blocks.clear()
        elif isinstance(e, (BlockStored, BlockRemoved)) and e.medium == "STORAGE":
            for h in e.block_hashes:
                if isinstance(e, BlockStored):
                    blocks.add((e.group_idx, h))
                else:
                    blocks.discard((e.group_idx, h))
    return blocks


def _stored_blocks(side: Any, store: Any) -> set[tuple[int, bytes]]:
    """(vLLM group, block hash) of the namespace's blocks present on every rank."""
    ranks: dict[tuple[int, bytes], set[int]] = {}
    for key in store.iter_keys(side.scheme.prefix):
        if key.endswith(MANIFEST_NAME):
            continue
        group, tp, _dcp, digest = key.removeprefix(side.scheme.geometry_prefix).split("/")
        block = (side.geo.groups[int(group.removeprefix("g"))].vllm_group_index, bytes.fromhex(digest))
        ranks.setdefault(block, set()).add(int(tp.removeprefix("tp")))
    return {block for block, on in ranks.items() if on >= set(RANKS)}


def _save(sched: Any, store: Any, rid: str, first: int) -> tuple[Any, Any, list[list[str]]]:
    """Schedule a 100-token prompt and let the "workers" write its save job: (scheduler output, the job,
    each block's keys on every rank)."""
    sched.add_request(make_request(rid, 100, first=first))
    out = sched.schedule()
    (save,) = out.kv_connector_metadata.saves
    scheme = out.kv_connector_metadata.scheme
    keys = [[scheme.key(b.group_index, r, b.block_hash) for r in RANKS] for b in save.blocks]
    flat = [key for block_keys in keys for key in block_keys]
    assert all(st.is_ok for st in store.put(flat, [VALUE] * len(flat)))
    return out, save, keys


def _report(sched: Any, out: Any, save: Any, rid: str) -> None:
    """Every rank reports the save job stored: the scheduler publishes its blocks."""
    from hybridkv_dev.devkit.cluster import model_runner_output
    from vllm.v1.outputs import KVConnectorOutput

    results = [SaveResult(b.entry(r), SaveOutcome.OK) for r in RANKS for b in save.blocks]
    wm = HybridStoreWorkerMetadata(saves={save.job_id: results}, saves_done={save.job_id: list(RANKS)})
    sched.update_from_output(
        out,
        model_runner_output(
            [rid],
            sampled_token_ids=[[]],
            kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=wm),
        ),
    )


def _fill(store: Any, tag: str, num_bytes: int) -> None:
    """Put ``num_bytes`` of another namespace's entries: capacity pressure that evicts the oldest."""
    keys = [f"hkv1/filler/{tag}/g0/tp0/dcp0/{i:04x}" for i in range(num_bytes // len(VALUE))]
    for key in keys:  # one by one: each put evicts what it must
        assert store.put([key], [VALUE])[0].is_ok


class _Recorder:
    """vLLM's event publisher, recording: ``update_from_output`` publishes the connector's events here."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass


def _engine(vc: Any, events: list[Any]) -> tuple[Any, Any]:
    """A fresh scheduler whose published events go to ``events``: (scheduler, its connector's half)."""
    sched = make_scheduler(vc)
    sched.kv_event_publisher = _Recorder(events)
    return sched, sched.connector.scheduler_side


def _drain(side: Any, events: list[Any]) -> None:
    """Two steps' ``take_events`` around the maintenance thread: the drain the first one starts is
    published by the second."""
    events.extend(side.take_events())
    assert side.wait_maintenance(10)
    events.extend(side.take_events())
    assert side.wait_maintenance(10)
    events.extend(side.take_events())


def test_an_eviction_publishes_block_removed(capped: dict[str, Any]) -> None:
    from vllm.distributed.kv_events import BlockRemoved

    store = open_store(capped["store_url"])
    events: list[Any] = []
    sched, side = _engine(capped["vc"], events)
    out, save, keys = _save(sched, store, "ev1", first=5100)
    _report(sched, out, save, "ev1")
    published = _replay(events)
    assert published == _stored_blocks(side, store) and len(published) == len(keys)

    _fill(store, "a", CAPACITY)  # the prompt's entries are the oldest: evicted
    _drain(side, events)
    assert _stored_blocks(side, store) < published, "the filler evicted none of the prompt's blocks"
    assert _replay(events) == _stored_blocks(side, store), "the events' view keeps evicted blocks"
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert removed and all(e.medium == "STORAGE" for e in removed)
    assert {(e.group_idx, h) for e in removed for h in e.block_hashes} <= published


def test_a_block_evicted_before_its_report_is_not_published(capped: dict[str, Any]) -> None:
    store = open_store(capped["store_url"])
    events: list[Any] = []
    sched, side = _engine(capped["vc"], events)
    _drain(side, events)  # the engine's report of evictions is running
    out, save, keys = _save(sched, store, "ev2", first=5300)
    _fill(store, "b", CAPACITY)  # evicted after the put, before the ranks' report arrives ...
    _drain(side, events)  # ... and the eviction drained before it (it matches no published block yet)
    survivor = keys[0]
    assert all(st.is_ok for st in store.put(survivor, [VALUE] * len(survivor)))  # stored again meanwhile
    _report(sched, out, save, "ev2")
    _drain(side, events)
    assert _replay(events) == _stored_blocks(side, store), "a block evicted before its report was published"
    assert len(_replay(events)) >= 1, "the block stored again after its eviction is not in the view"
    assert side.events.num_unsure >= len(keys)


def test_a_store_without_an_eviction_report_publishes_as_before(objs: dict[str, Any]) -> None:
    store = open_store(objs["store_url"])
    events: list[Any] = []
    sched, side = _engine(objs["vc"], events)
    side.store = _NoReport(side.store)
    out, save, keys = _save(sched, store, "ev3", first=5500)
    _report(sched, out, save, "ev3")
    assert len(_replay(events)) == len(keys) and side.events.num_tracked == 0


class _NoReport:
    """A store view that forwards the store calls but has no eviction report (like Mooncake's)."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        if name in ("take_evictions", "backend", "inner"):  # no layer found under it either
            raise AttributeError(name)
        return getattr(self._store, name)
