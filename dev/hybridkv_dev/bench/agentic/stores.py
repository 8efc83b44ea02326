"""The store configurations the agentic bench replays its traces through, and their fresh stores."""

from __future__ import annotations

import contextlib
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hybridkv.store.base import Store, StoreError
from hybridkv.store.memory import drop_memory_store
from hybridkv.store.url import open_store

from hybridkv_dev.bench.agentic.trace import BACKGROUND_TENANT


@dataclass(frozen=True)
class StoreConfiguration:
    """One store setup the bench replays the trace through."""

    name: str
    scheme: str  # "memory" or "file"
    #: whether the background tenant gets a quota (``background_quota_fraction`` of capacity)
    background_quota: bool
    #: more query parameters of the store URL (``name=value&...``), e.g. another eviction policy
    url_params: str = ""
    #: whether sessions retain their prefix (``Store.retain``): each agentic request retains its prompt's
    #: entries for ``SESSION_TTL_S`` after its save, and a chain's last request releases them
    sessions: bool = False


CONFIGURATIONS = (
    StoreConfiguration("lru", "memory", background_quota=False),
    StoreConfiguration("lru+quotas", "memory", background_quota=True),
    StoreConfiguration("lru+sessions", "memory", background_quota=False, sessions=True),
    StoreConfiguration("file-lru", "file", background_quota=False),
    StoreConfiguration("file-lru+quotas", "file", background_quota=True),
    StoreConfiguration("file-lru+sessions", "file", background_quota=False, sessions=True),
)
#: How long a session's retention lasts past its last request (longer than any pause of the trace: a
#: session's prefix is retained until the session ends; the budget bounds what that protects).
SESSION_TTL_S = 3600.0
STORE_CHOICES = ("memory", "file", "both")


def configurations_for(store: str) -> tuple[StoreConfiguration, ...]:
    """The configurations of ``--store memory|file|both`` (the first is the baseline of the differences)."""
    assert store in STORE_CHOICES, store
    return tuple(c for c in CONFIGURATIONS if store in ("both", c.scheme))


@contextlib.contextmanager
def opened_store(
    configuration: StoreConfiguration, capacity_bytes: int, quota_bytes: int, scratch: Path
) -> Iterator[Store]:
    """A fresh, empty store of ``configuration``, removed afterwards. ``StoreError`` if the store refuses
    the configuration (e.g. a store without quotas)."""
    extra = f"&{configuration.url_params}" if configuration.url_params else ""
    if configuration.scheme == "memory":
        name = f"bench-agentic-{uuid.uuid4().hex[:12]}"
        url = f"memory://{name}?capacity={capacity_bytes}{extra}"
        if configuration.background_quota:
            url += f"&quotas={BACKGROUND_TENANT}:{quota_bytes}"
        try:
            store = open_store(url)
        except StoreError:
            drop_memory_store(name)
            raise
        try:
            yield store
        finally:
            store.close()
            drop_memory_store(name)
        return
    directory = scratch / f"store-{uuid.uuid4().hex[:12]}"
    try:
        store = open_store(f"file://{directory}?capacity={capacity_bytes}{extra}")
        try:
            if configuration.background_quota:
                _set_file_quota(directory, quota_bytes)
            yield store
        finally:
            store.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _set_file_quota(directory: Path, quota_bytes: int) -> None:
    """Give the background tenant of the file store in ``directory`` its quota (the directory's quota file)."""
    try:
        from hybridkv.store.quotas import write_quotas
    except ImportError as error:
        raise StoreError(f"file store quotas are not available: {error}") from None
    write_quotas(directory, {BACKGROUND_TENANT: quota_bytes})
