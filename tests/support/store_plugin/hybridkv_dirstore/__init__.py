"""A store plug-in for hybridkv: ``dirstore:///ABS/DIR`` keeps one file per key in a directory.

It is small on purpose: the example of what another package writes to add a store. It states its kind
(``STORE_KIND``, registered in ``pyproject.toml`` under the ``hybridkv.stores`` entry-point group) and
implements ``hybridkv.store.framed.Backend``; hybridkv does the rest (frames and checksums, the ``faulty+``
view, the configuration check at engine start, ``hybridkv describe``).

Parameters: ``capacity`` (a byte size; a put that would exceed it answers ``NO_SPACE``: this store never
evicts). Files are written under a temporary name and linked into place, so a key is visible only whole, and
a second writer of the same key finds it present (insert-if-absent).
"""

from __future__ import annotations

import functools
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from hybridkv.store import Status, StoreError, StoreStats
from hybridkv.store.framed import Backend, FrameParts
from hybridkv.store.kinds import StoreKind, StoreTier
from hybridkv.store.params import Params, ParsedUrl

__all__ = ["STORE_KIND", "DirBackend"]


def _file_name(key: str) -> str:
    return key.encode().hex()


def _key_of(name: str) -> str:
    return bytes.fromhex(name).decode()


class DirBackend:
    """One file per key under ``directory / "keys"``; temporary files under ``directory / "tmp"``."""

    def __init__(self, url: str, directory: Path, *, capacity_bytes: int) -> None:
        self.url = url
        self.capacity_bytes = capacity_bytes
        self._keys = directory / "keys"
        self._tmp = directory / "tmp"
        self._keys.mkdir(parents=True, exist_ok=True)
        self._tmp.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # the capacity check and the link are one step per process

    def answers_late(self, op: str) -> bool:
        return False  # every call finishes before it answers

    def exists(self, keys: Sequence[str]) -> list[Status]:
        return [Status.OK if (self._keys / _file_name(key)).is_file() else Status.NOT_FOUND for key in keys]

    def put_frames(self, keys: Sequence[str], frames: Sequence[FrameParts]) -> list[Status]:
        return [self._put(key, frame) for key, frame in zip(keys, frames, strict=True)]

    def _put(self, key: str, frame: FrameParts) -> Status:
        path = self._keys / _file_name(key)
        if path.exists():
            return Status.OK  # insert-if-absent
        size = sum(part.nbytes for part in frame)
        tmp = self._tmp / uuid.uuid4().hex
        try:
            with tmp.open("wb") as out:
                for part in frame:
                    out.write(part)
            with self._lock:
                if path.exists():
                    return Status.OK
                if self._num_bytes() + size > self.capacity_bytes:
                    return Status.NO_SPACE
                os.link(tmp, path)
        except FileExistsError:
            return Status.OK  # another process linked it first: the first writer wins
        except OSError:
            return Status.TRANSFER_FAILED
        finally:
            tmp.unlink(missing_ok=True)
        return Status.OK

    def get_frames_into(self, keys: Sequence[str], frames: Sequence[FrameParts]) -> list[Status]:
        return [self._get(key, frame) for key, frame in zip(keys, frames, strict=True)]

    def _get(self, key: str, frame: FrameParts) -> Status:
        path = self._keys / _file_name(key)
        try:
            with path.open("rb") as source:
                if os.fstat(source.fileno()).st_size != sum(part.nbytes for part in frame):
                    return Status.CORRUPT
                for part in frame:
                    if source.readinto(part) != part.nbytes:
                        return Status.CORRUPT
        except FileNotFoundError:
            return Status.NOT_FOUND
        except OSError:
            return Status.TRANSFER_FAILED
        return Status.OK

    def remove(self, keys: Sequence[str]) -> list[Status]:
        statuses = []
        for key in keys:
            try:
                (self._keys / _file_name(key)).unlink()
                statuses.append(Status.OK)
            except FileNotFoundError:
                statuses.append(Status.NOT_FOUND)
        return statuses

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        for entry in os.scandir(self._keys):
            key = _key_of(entry.name)
            if key.startswith(prefix):
                yield key

    def remove_prefix(self, prefix: str) -> int:
        return sum(status.is_ok for status in self.remove(list(self.iter_keys(prefix))))

    def _num_bytes(self) -> int:
        return sum(entry.stat().st_size for entry in os.scandir(self._keys))

    def stats(self) -> StoreStats:
        names = list(os.scandir(self._keys))
        return StoreStats(
            url=self.url,
            num_keys=len(names),
            num_bytes=sum(entry.stat().st_size for entry in names),
            capacity_bytes=self.capacity_bytes,
        )

    def close(self) -> None:
        pass


def _open(parsed: ParsedUrl, params: Params) -> Callable[[], Backend]:
    """Check every part of a ``dirstore://`` URL (raising ``StoreError`` naming it); open nothing yet."""
    if parsed.netloc or not parsed.path.startswith("/") or parsed.path == "/":
        raise StoreError(
            f"store URL {parsed.url!r}: dirstore:// needs an absolute directory (dirstore:///DIR)"
        )
    capacity = params.size("capacity", 1 << 30)
    params.finish()  # refuses every parameter not read above, by name
    return functools.partial(DirBackend, parsed.url, Path(parsed.path), capacity_bytes=capacity)


def _absent(parsed: ParsedUrl) -> str | None:
    return None if (Path(parsed.path) / "keys").is_dir() else f"no dirstore at {parsed.path!r}"


STORE_KIND = StoreKind(
    "dirstore",
    _open,
    StoreTier.DISK,
    process_local=False,  # every process on the host opens the same directory
    params=("capacity",),
    absent=_absent,
)
