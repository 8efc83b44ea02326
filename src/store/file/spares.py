"""The spare files of a file store's directory (recycling, see ``hybridkv.store.file.layout``): files an eviction
pass kept under ``spare/<size class>/`` instead of unlinking them, which a writer claims and overwrites in place
(no new page allocated). Moving a file in, claiming one and opening a claimed one for overwriting; the
accounting and the budget stay with ``FileLayout``."""

from __future__ import annotations

import fcntl
import itertools
import mmap
import os
import threading
from collections.abc import Callable, Sequence

__all__ = ["SpareShelf", "size_class"]

#: The suffix of every published or spare file.
SUFFIX = ".kv"
_spare_counter = itertools.count()
_PAGE = mmap.PAGESIZE


def size_class(size: int) -> int:
    """The page-rounded size spares are matched on: overwriting a file within its last page needs no new
    page, and truncating it there frees none."""
    return -(-size // _PAGE) * _PAGE


class SpareShelf:
    """``spare/`` of one store directory. ``temp_path`` makes a fresh name under ``tmp/`` (where a claimed
    spare is renamed to); ``is_recyclable(size)`` says which frame sizes may take a spare (readers lock exactly
    those)."""

    def __init__(
        self, directory: str, temp_path: Callable[[], str], is_recyclable: Callable[[int], bool]
    ) -> None:
        self.directory = directory
        self._temp_path = temp_path
        self._is_recyclable = is_recyclable

    def move_in(self, path: str, size: int) -> None:
        """Rename ``path`` into its size class under spare/ (no accounting)."""
        shard = f"{self.directory}/{size_class(size)}"
        spare = f"{shard}/{os.getpid()}-{threading.get_ident()}-{next(_spare_counter)}{SUFFIX}"
        try:
            os.rename(path, spare)
        except FileNotFoundError:
            if not os.path.exists(path):
                raise
            os.makedirs(shard, mode=0o700, exist_ok=True)
            os.rename(path, spare)

    def claim(self, sizes: Sequence[int | None]) -> list[tuple[str, int] | None]:
        """For each frame size (``None``: no frame), claim a spare of its size class by renaming it into
        tmp/: ``(temp path, spare size)``, or ``None`` if none is left. The caller owns the claimed files."""
        claims: list[tuple[str, int] | None] = [None] * len(sizes)
        class_to_candidates: dict[int, list[str]] = {}
        for index, size in enumerate(sizes):
            if size is None or not self._is_recyclable(size):
                continue
            class_bytes = size_class(size)
            candidates = class_to_candidates.get(class_bytes)
            if candidates is None:
                try:
                    with os.scandir(f"{self.directory}/{class_bytes}") as entries:
                        candidates = [entry.path for entry in entries if entry.name.endswith(SUFFIX)]
                except FileNotFoundError:
                    candidates = []
                class_to_candidates[class_bytes] = candidates
            while candidates:
                spare = candidates.pop()
                temp = self._temp_path()
                try:
                    # Touch first, rename second: the file appears in tmp/ already fresh, so no process's
                    # sweep (which deletes temp files unmodified for STALE_TMP_S) can take it for a crashed
                    # writer's, however long it sat in spare/. Touching after the rename would leave a window
                    # in which a sweep sees the old mtime and unlinks the file mid-put.
                    os.utime(spare)
                    os.rename(spare, temp)  # atomic: of several claimers exactly one succeeds
                    spare_size = os.stat(temp).st_size
                except FileNotFoundError:
                    continue  # another process claimed it first
                claims[index] = (temp, spare_size)
                break
        return claims

    def open(self, temp: str, size: int) -> int | None:
        """Open the claimed spare ``temp`` for overwriting with a ``size``-byte frame, holding its exclusive
        lock; ``None`` if a reader that opened it under its old name still holds it (see Recycling)."""
        fd = os.open(temp, os.O_WRONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)  # within the size class: no page allocated or freed but the tail's
        except OSError:
            os.close(fd)
            raise
        return fd
