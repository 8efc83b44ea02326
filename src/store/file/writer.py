"""The put path of a file store: frames from the caller's buffers into published files.

Contract: :class:`FrameWriter` puts a batch of frames, insert-if-absent, into one store directory, in this
order: refuse what cannot fit (larger than the capacity, or than its tenant's quota: ``FileTenants``), claim
spares of the frames' size classes (``SpareShelf.claim``), add the new bytes to the shared usage
estimate and make room if that passes the effective capacity (``FileSpace``), then write and publish each
frame (a temp file linked into place: first writer wins), and give back what was not published. A frame
that meets ``ENOSPC``/``EDQUOT`` (a file system full below the capacity) re-reads the free space, makes room
and is written once more. It reads no value and lists nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence

from hybridkv.key_grammar import namespace_of
from hybridkv.store.base import Status
from hybridkv.store.file.frame_io import status_of, write_all
from hybridkv.store.file.layout import FileLayout
from hybridkv.store.file.tenants import FileTenants
from hybridkv.store.file.usage import FileSpace
from hybridkv.store.framed import FrameParts, SealHook


class FrameWriter:
    """One handle's put path over a store directory. Thread- and process-safe."""

    def __init__(
        self, url: str, layout: FileLayout, tenants: FileTenants, space: FileSpace, *, capacity_bytes: int
    ) -> None:
        self.url = url
        self.layout = layout
        self.tenants = tenants
        self.space = space
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        #: Spares this handle's puts overwrote instead of writing new files.
        self.num_recycled = 0
        #: Whether this process's last put that met ``ENOSPC`` still failed after evicting (cleared by the
        #: next published put): the store cannot write.
        self.cannot_write = False

    def put(self, keys: Sequence[str], frames: Sequence[FrameParts], seal: SealHook | None) -> list[Status]:
        """Put each new frame (insert-if-absent), sealing it right before its header is written; see the
        module docstring for the order of claiming spares, reserving, making room and publishing."""
        layout = self.layout
        results: list[Status] = []
        paths: list[str | None] = []
        sizes = [sum(part.nbytes for part in frame) for frame in frames]
        num_new_bytes = 0
        for key, size in zip(keys, sizes, strict=True):
            path = layout.path_of(key)
            if os.path.exists(path):  # insert-if-absent; the link in _publish settles races
                results.append(Status.OK)
                paths.append(None)
            elif size > self.capacity_bytes:
                results.append(Status.NO_SPACE)
                paths.append(None)
            else:
                results.append(Status.OK)
                paths.append(path)
                num_new_bytes += size
        namespace_to_new_bytes, unwritten, reservation = self.tenants.apply_to_put(
            keys, sizes, paths, results
        )
        for index in unwritten:  # refused by its tenant's quota, or evicted by a newer value of the batch
            num_new_bytes -= sizes[index]
            paths[index] = None
        if num_new_bytes == 0:
            if reservation is not None:
                layout.ledger.release(reservation, {})
            return results
        # Claim spares first: their bytes are already counted, so only the rest is new. Reserve the new
        # bytes up front (one locked update), make room if that overflows, and give back what was not
        # published.
        claims = layout.spares.claim(
            [size if path else None for size, path in zip(sizes, paths, strict=True)]
        )
        num_claimed = sum(claim is not None for claim in claims)
        num_spare_bytes = sum(claim[1] for claim in claims if claim is not None)
        num_claimed_frame_bytes = sum(
            size for size, claim in zip(sizes, claims, strict=True) if claim is not None
        )
        num_unclaimed_bytes = num_new_bytes - num_claimed_frame_bytes
        capacity = self.space.effective_capacity(force=False)
        usage = layout.add_usage(num_new_bytes - num_spare_bytes, -num_spare_bytes)
        if num_unclaimed_bytes and usage > capacity:
            layout.make_room_for_put(num_unclaimed_bytes, self.tenants.quotas)  # this batch stays counted
        num_unpublished_bytes = 0
        namespace_to_unpublished_bytes: dict[str, int] = {}
        num_unwritten_bytes = num_new_bytes  # counted in usage, not written yet (see _publish_with_room)
        may_make_room = True  # until a retry after evicting met ENOSPC again: the batch's rest is not retried
        for index, (key, frame, new_path) in enumerate(zip(keys, frames, paths, strict=True)):
            if new_path is None:
                continue
            claim = claims[index]
            results[index], published, may_make_room = self._publish_with_room(
                key,
                frame,
                new_path,
                None if claim is None else claim[0],
                seal,
                index,
                num_unwritten_bytes=num_unwritten_bytes if may_make_room else None,
            )
            num_unwritten_bytes -= sizes[index]
            if not published:
                num_unpublished_bytes += sizes[index]
                namespace = namespace_of(key)
                if namespace in namespace_to_new_bytes:
                    namespace_to_unpublished_bytes[namespace] = (
                        namespace_to_unpublished_bytes.get(namespace, 0) + sizes[index]
                    )
        if num_unpublished_bytes:
            layout.add_usage(-num_unpublished_bytes)
        # (A put that raises before this leaves its reservation counted -- high, never low -- until it is
        # stale: hybridkv.store.file.ledger.)
        if reservation is not None:
            layout.ledger.release(reservation, namespace_to_unpublished_bytes)
        if num_claimed:
            with self._lock:
                self.num_recycled += num_claimed
        return results

    def _publish_with_room(
        self,
        key: str,
        frame: FrameParts,
        path: str,
        spare: str | None,
        seal: SealHook | None,
        index: int,
        *,
        num_unwritten_bytes: int | None,
    ) -> tuple[Status, bool, bool]:
        """``_publish``, and where it meets ``ENOSPC``/``EDQUOT`` (a file system full below the capacity) and
        ``num_unwritten_bytes`` is given: re-read the free space (the effective capacity drops to what the
        file system holds), evict to make room as at capacity (least recently used first, retention and
        quotas as usual) and write the frame once more, into a new file. ``num_unwritten_bytes``: the
        batch's bytes counted in ``usage`` but not on disk (this frame's included), which the effective
        capacity must not take for bytes the file system holds; ``None``: no retry.

        Returns (status, whether this call published, whether the batch's next frames may still retry):
        not after a retry that met ``ENOSPC`` again, which also marks the store ``cannot_write`` (until a
        put publishes)."""
        status, published = self._publish(key, frame, path, spare, seal, index)
        if status is Status.NO_SPACE and num_unwritten_bytes is not None:
            self.space.effective_capacity(force=True, num_unwritten_bytes=num_unwritten_bytes)
            size = sum(part.nbytes for part in frame)
            self.layout.make_room_for_put(size, self.tenants.quotas)  # the unwritten bytes stay counted
            status, published = self._publish(key, frame, path, None, seal, index)
            if not published and status is Status.NO_SPACE:
                self.cannot_write = True
                return status, published, False
        if published:
            self.cannot_write = False
        return status, published, True

    def _publish(
        self, key: str, frame: FrameParts, path: str, spare: str | None, seal: SealHook | None, index: int
    ) -> tuple[Status, bool]:
        """Write ``frame`` to a temp file (the claimed ``spare`` in tmp/ if given, else a new one) and link it
        to ``path``: (status, whether this call published). The temp file is gone afterwards.

        The payload parts are written first and the header part last, right after ``seal(index)`` (if given)
        has filled it: the checksum then reads payload bytes the write has just pulled into the CPU cache
        instead of fetching them from memory once more (see Speed), and the file holds the whole sealed frame
        before it is linked."""
        layout = self.layout
        header = frame[0]
        size = sum(part.nbytes for part in frame)
        temp = layout.temp_path() if spare is None else spare
        try:
            fd = layout.spares.open(spare, size) if spare is not None else None
            if fd is None:  # no spare, or a reader of its previous life still holds it: a new file
                temp = layout.temp_path()
                if spare is not None:
                    os.unlink(spare)
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    # The final size first: a tmpfs mounted huge=within_size backs a file with large pages
                    # only inside its size (some kernels look only at the size, not at where a write will end).
                    os.ftruncate(fd, size)
                except OSError:
                    os.close(fd)
                    raise
            try:
                write_all(fd, frame[1:], header.nbytes)
                if seal is not None:
                    seal(index)
                write_all(fd, [header], 0)
            finally:
                # Unlocks a recycled inode. Safe before the link: its bytes are final now, and a reader of
                # its previous life that locks it from here on finds its old name no longer links to it.
                os.close(fd)
            try:
                layout.link(temp, path)
            except FileExistsError:
                return Status.OK, False  # another writer published first: first writer wins
            else:
                return Status.OK, True
        except OSError as error:
            return status_of(error, "put", key, url=self.url), False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
