"""hybridkv.store: byte storage behind one protocol (``base.Store``), selected by URL.

``open_store("file:///dev/shm/hybridkv?capacity=8GiB")`` returns a ``Store``; see ``hybridkv.store.url``
for every scheme and parameter, ``hybridkv.store.base`` for the contract all backends share, and
``hybridkv.store.plugins`` for a store of another package (a ``StoreKind`` under an entry point).
"""

from __future__ import annotations

from hybridkv.store.base import Destination, Status, Store, StoreError, StoreLogEvent, StoreStats, Value
from hybridkv.store.framed import FramedStore
from hybridkv.store.kinds import StoreKind, StoreTier
from hybridkv.store.params import format_size, parse_size
from hybridkv.store.url import open_store

__all__ = [
    "Destination",
    "FramedStore",
    "Status",
    "Store",
    "StoreError",
    "StoreKind",
    "StoreLogEvent",
    "StoreStats",
    "StoreTier",
    "Value",
    "format_size",
    "open_store",
    "parse_size",
]
