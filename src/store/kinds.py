"""What the package knows about a store URL scheme: one ``StoreKind`` per scheme.

The built-in kinds (``memory``, ``file``, ``mooncake``) are rows in ``hybridkv.store.url``; a store of another
package registers its ``StoreKind`` through an entry point (``hybridkv.store.plugins``). Both are read the
same way: ``open_store``, ``check_store_url``, the connector's configuration and ``hybridkv describe`` ask
only the kind.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from hybridkv.store.framed import Backend
from hybridkv.store.params import Params, ParsedUrl

__all__ = ["StoreKind", "StoreTier"]


class StoreTier(enum.Enum):
    """Where a store's bytes live, as vLLM's hit sources see it."""

    HOST = "host"  # this process's memory
    DISK = "disk"  # files on this host
    EXTERNAL = "external"  # another service (Mooncake's master and storage nodes)


@dataclass(frozen=True)
class StoreKind:
    """One row of the store registry: everything the package knows about a URL scheme."""

    scheme: str
    #: Reads and checks every part of the URL (raising ``StoreError``), then returns what opens the backend:
    #: nothing is created or connected before that is called (``check_store_url`` never calls it).
    opener: Callable[[ParsedUrl, Params], Callable[[], Backend]]
    tier: StoreTier
    #: Only this process sees its entries (engines with several worker processes need another store).
    process_local: bool
    #: The query parameters it takes besides ``checksum`` and ``INTEGRITY_PARAMS`` (the chaos view adds its own).
    params: tuple[str, ...]
    #: Why a URL of this kind names no existing store, so that opening it would create one (read-only tools
    #: refuse then); None when it names one or the kind cannot tell without connecting.
    absent: Callable[[ParsedUrl], str | None] = lambda _parsed: None
    #: The parameters a client that only asks what exists (a lookup process) sets, over the URL's own:
    #: Mooncake's mounts no segment (it would hold data, and other clients would place puts in it).
    lookup_client_params: Mapping[str, str] = field(default_factory=dict)
    #: What an engine's open records in the store it opened (a file store's capacity); an operator's open
    #: (``open_store(url, operator=True)``) records nothing.
    record: Callable[[Backend], None] = lambda _backend: None
    #: The parameters an operator's open reads from the store where its URL names them not: what the
    #: engines recorded (``record``).
    recorded_params: Callable[[ParsedUrl], Mapping[str, str]] = lambda _parsed: {}
