"""The capacity a file store's engines run with, recorded in its directory (``capacity.json``).

Contract: an engine that opens a ``file://`` store (``open_store(url)``) records the capacity it opened it
with (:func:`record_capacity`); an operator's command that opens the store by a URL without ``capacity``
(``open_store(url, operator=True)``: ``hybridkv store stats``, ``describe``, ``store quota``, ...) reads it
back (:func:`recorded_capacity`), so it shows and checks against what the engines evict at, not the URL
default. The record is informational: it never changes what an engine runs with (its URL does), and a
record that cannot be written or read is as if there were none. The last engine to open the store wins.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path

__all__ = ["CAPACITY_FILE", "record_capacity", "recorded_capacity"]

#: The record's name in the store's directory: ``{"capacity_bytes": N}``.
CAPACITY_FILE = "capacity.json"


def recorded_capacity(directory: Path) -> int | None:
    """The capacity in bytes the engines of the file store in ``directory`` recorded; None without a
    readable record (none written yet, or not an object with a positive integer ``capacity_bytes``)."""
    try:
        loaded = json.loads((directory / CAPACITY_FILE).read_text())
    except (OSError, ValueError):
        return None
    capacity = loaded.get("capacity_bytes") if isinstance(loaded, dict) else None
    return capacity if type(capacity) is int and capacity > 0 else None


def record_capacity(directory: Path, capacity_bytes: int) -> None:
    """Record ``capacity_bytes`` as the capacity the engines of the store in ``directory`` run with,
    atomically (a reader sees the old record or the new one); nothing is written when it is recorded
    already. Never raises for the file system: a store whose directory takes no small file fails its puts
    anyway, and the record only informs operators."""
    if recorded_capacity(directory) == capacity_bytes:
        return
    # A name of this writer's own: engines starting together must not write into one temp file.
    temp = directory / f".{CAPACITY_FILE}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        temp.write_text(json.dumps({"capacity_bytes": capacity_bytes}) + "\n")
        os.chmod(temp, 0o600)
        os.replace(temp, directory / CAPACITY_FILE)
    except OSError:
        with contextlib.suppress(OSError):
            temp.unlink(missing_ok=True)
