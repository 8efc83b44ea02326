"""The framing layer shared by every backend, and the ``Backend`` protocol it drives.

``open_store`` builds every store as ``FramedStore(backend)``: the backend moves whole frames (header part
+ payload parts) and knows nothing about their content; ``FramedStore`` builds headers on ``put`` and checks
them on ``get_into``. Keeping the check above the backend means one implementation of hard rule 7, and lets
the chaos wrapper (``faulty+``) damage real frame bytes between the two, where the check must catch it.
With an integrity keyring (``hybridkv.store.integrity``) it seals and checks keyed frames instead, the same
size, through the same hooks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, Self, cast

import structlog
from hybridkv.store.base import Destination, Status, StoreError, StoreLogEvent, StoreStats, Value, with_extra
from hybridkv.store.frame import ChecksumAlgo, check_frame, encode_header, header_size
from hybridkv.store.integrity import Keyring
from typing_extensions import Buffer

log = structlog.get_logger(__name__)

#: One frame on its way to or from a backend: the header part first, then the payload parts.
FrameParts = list[memoryview]


class Backend(Protocol):
    """Moves whole frames; implemented by the memory, file and mooncake backends and the chaos wrapper.

    Contract:
    - ``put_frames`` is insert-if-absent and atomic per key (a key is visible only with its whole frame).
    - ``get_frames_into`` fills the parts of each destination in order; it returns ``OK`` only when the
      stored frame is exactly as long as the destination parts together, ``CORRUPT`` when the lengths
      differ, ``NOT_FOUND`` when absent. It does not look inside the frame.
    - ``answers_late(op)``: whether a get (``op="get"``) or put (``op="put"``) may answer ``TIMEOUT``
      while its work goes on with the caller's buffers (it then registers the call with
      ``hybridkv.store.base.register_late_call``). A backend that answers ``False`` returns from every such
      call before answering -- however long that takes, so only one whose calls cannot hang may say so.
    """

    url: str

    def answers_late(self, op: str) -> bool: ...

    def exists(self, keys: Sequence[str]) -> list[Status]: ...

    def put_frames(self, keys: Sequence[str], frames: Sequence[FrameParts]) -> list[Status]: ...

    def get_frames_into(self, keys: Sequence[str], frames: Sequence[FrameParts]) -> list[Status]: ...

    def remove(self, keys: Sequence[str]) -> list[Status]: ...

    def iter_keys(self, prefix: str = "") -> Iterator[str]: ...

    def remove_prefix(self, prefix: str) -> int: ...

    def stats(self) -> StoreStats: ...

    def close(self) -> None: ...


#: ``seal(index)``: fill frame ``index``'s header part in place (this computes the payload checksum).
SealHook = Callable[[int], None]
#: ``verify(index)``: check frame ``index`` just filled; ``False`` means the backend must answer ``CORRUPT``.
VerifyHook = Callable[[int], bool]


class JustInTimeBackend(Backend, Protocol):
    """Optional: a backend that runs the framing next to each value's copy (``FramedStore`` detects it).

    Hashing a whole batch before writing it (or after reading it) streams every byte through the CPU cache
    once more; calling the hook right before (after) each value's copy hashes bytes that are still cached
    (see docs/performance.md, "Figures behind design choices"). It also skips the checksum of values that
    insert-if-absent does not write.

    - ``put_frames_sealed``: each frame's header part is a zeroed placeholder of the header's exact length;
      the backend calls ``seal(index)`` before it copies frame ``index``'s header part anywhere and never
      makes a frame it has not sealed visible. It may copy the payload parts first, so that the checksum
      reads bytes the copy has just pulled into cache. Otherwise as ``put_frames``.
    - ``get_frames_verified``: for every frame it would answer ``OK``, right after filling it, the backend
      calls ``verify(index)`` and answers ``CORRUPT`` if that returns ``False``. Otherwise as
      ``get_frames_into``. (``FramedStore`` still checks every ``OK`` frame that was not verified, so a
      backend that forgets cannot skip the check.)

    Wrappers that alter bytes between the backend and the check (``faulty+``) must not offer these.
    """

    def put_frames_sealed(
        self, keys: Sequence[str], frames: Sequence[FrameParts], seal: SealHook
    ) -> list[Status]: ...

    def get_frames_verified(
        self, keys: Sequence[str], frames: Sequence[FrameParts], verify: VerifyHook
    ) -> list[Status]: ...


class RetainingBackend(Backend, Protocol):
    """Optional: a backend that keeps entries a client expects to reuse ahead of the others for a while
    (``hybridkv.store.retention``; ``FramedStore`` detects it). Without it ``retain`` answers
    ``TRANSFER_FAILED``."""

    def retain(self, keys: Sequence[str], until: float) -> list[Status]: ...


def _retain_of(backend: object) -> Callable[[Sequence[str], float], list[Status]] | None:
    """The backend's ``retain``, or ``None``: it has none, or it wraps one that cannot (``can_retain``)."""
    retain = getattr(backend, "retain", None)
    return retain if callable(retain) and getattr(backend, "can_retain", True) else None


def _is_just_in_time(backend: object) -> bool:
    return callable(getattr(backend, "put_frames_sealed", None)) and callable(
        getattr(backend, "get_frames_verified", None)
    )


def value_to_parts(value: Value) -> list[memoryview]:
    """Byte views of one value: a single buffer, or a sequence of buffers concatenated in order."""
    if isinstance(value, (list, tuple)):  # parts (a value's KV pages); neither type exports a buffer
        return _byte_views(value)
    try:
        view = memoryview(cast(Buffer, value))
    except TypeError:  # not one buffer (numpy arrays are, without declaring it): a sequence of parts
        return _byte_views(cast(Sequence[Buffer], value))
    return [_flat(view)]


def destination_to_parts(destination: Destination) -> list[memoryview]:
    """Writable byte views of one destination; ``ValueError`` names a read-only part."""
    parts = value_to_parts(destination)
    for index, part in enumerate(parts):
        if part.readonly:
            raise ValueError(f"destination part {index} is read-only ({type(destination).__name__})")
    return parts


def _byte_views(buffers: Sequence[Buffer]) -> list[memoryview]:
    """A flat byte view of each of ``buffers``; ``TypeError`` names a part that is not a buffer. Inlined
    for the common flat byte part (no helper call per part): a loaded value has a part per KV page, and
    this runs for every value of every load."""
    views: list[memoryview] = []
    for buffer in buffers:
        try:
            view = memoryview(buffer)
        except TypeError:
            raise TypeError(
                f"value part of type {type(buffer).__name__} does not support the buffer protocol"
            ) from None
        views.append(view if view.ndim == 1 and view.format == "B" else _flat(view))
    return views


def _flat(view: memoryview) -> memoryview:
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.c_contiguous:
        raise ValueError("buffers must be C-contiguous (got a strided view)")
    return view.cast("B")


class FramedStore:
    """A ``Store`` over a ``Backend``: frames values on ``put``, verifies frames on ``get_into``.

    Without ``keyring`` frames carry the ``checksum``; with one they carry a keyed hash under its current
    secret instead (``checksum`` is then unused), and a read accepts only frames sealed with one of its
    secrets: any other frame, unkeyed ones included, is ``CORRUPT``.
    """

    def __init__(self, backend: Backend, *, checksum: ChecksumAlgo, keyring: Keyring | None = None) -> None:
        self._backend = backend
        self._checksum = checksum
        self._keyring = keyring
        self._closed = False
        self._lock = threading.Lock()
        self._num_corrupt = 0

    @property
    def url(self) -> str:
        return self._backend.url

    @property
    def backend(self) -> Backend:
        """The frame-moving backend (for tests and tools that need backend-specific calls)."""
        return self._backend

    @property
    def checksum(self) -> ChecksumAlgo:
        return self._checksum

    @property
    def keyring(self) -> Keyring | None:
        """The integrity secrets frames are sealed and checked with, or ``None`` (checksummed frames)."""
        return self._keyring

    def _header_of(self, key: str, payload: Sequence[memoryview]) -> bytes:
        """The header ``put`` writes before ``payload`` under ``key``."""
        if self._keyring is not None:
            return self._keyring.encode_header(key, payload)
        return encode_header(key, self._checksum, payload)

    def answers_late(self, op: str) -> bool:
        """The backend's answer (see ``Backend``): framing adds no call that could go on after answering."""
        return self._backend.answers_late(op)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"store {self.url} is closed")

    def exists(self, keys: Sequence[str]) -> list[Status]:
        self._check_open()
        if not keys:
            return []
        return self._checked_results("exists", keys, self._backend.exists(keys))

    def put(self, keys: Sequence[str], values: Sequence[Value]) -> list[Status]:
        self._check_open()
        if len(keys) != len(values):
            raise ValueError(f"put: {len(keys)} keys but {len(values)} values")
        if not keys:
            return []
        backend = self._backend
        header_of = self._header_of
        if _is_just_in_time(backend):
            # Header placeholders (a keyed header has the same size); the backend seals each frame next to
            # copying it (see JustInTimeBackend).
            frames = [
                [memoryview(bytearray(header_size(key))), *value_to_parts(value)]
                for key, value in zip(keys, values, strict=True)
            ]

            def seal(index: int) -> None:
                frame = frames[index]
                frame[0][:] = header_of(keys[index], frame[1:])

            return self._checked_results("put", keys, backend.put_frames_sealed(keys, frames, seal))  # type: ignore[attr-defined]
        frames = []
        for key, value in zip(keys, values, strict=True):
            payload = value_to_parts(value)
            frames.append([memoryview(header_of(key, payload)), *payload])
        return self._checked_results("put", keys, backend.put_frames(keys, frames))

    def get_into(self, keys: Sequence[str], destinations: Sequence[Destination]) -> list[Status]:
        self._check_open()
        if len(keys) != len(destinations):
            raise ValueError(f"get_into: {len(keys)} keys but {len(destinations)} destinations")
        if not keys:
            return []
        frames: list[FrameParts] = []
        for key, destination in zip(keys, destinations, strict=True):
            frames.append([memoryview(bytearray(header_size(key))), *destination_to_parts(destination)])
        backend = self._backend
        verified = [False] * len(keys)
        if _is_just_in_time(backend):

            def verify(index: int) -> bool:
                verified[index] = True
                return self._frame_ok(keys[index], frames[index])

            results = self._checked_results(
                "get_into",
                keys,
                backend.get_frames_verified(keys, frames, verify),  # type: ignore[attr-defined]
            )
        else:
            results = self._checked_results("get_into", keys, backend.get_frames_into(keys, frames))
        # Every OK frame the backend did not verify (all of them for a plain backend) is checked here.
        for index, (key, frame) in enumerate(zip(keys, frames, strict=True)):
            if results[index] is Status.OK and not verified[index] and not self._frame_ok(key, frame):
                results[index] = Status.CORRUPT
        return results

    def _frame_ok(self, key: str, frame: FrameParts) -> bool:
        if self._keyring is not None:
            problem = self._keyring.check_frame(key, frame[0], frame[1:])
        else:
            problem = check_frame(key, frame[0], frame[1:], required=self._checksum)
        if problem is None:
            return True
        with self._lock:
            self._num_corrupt += 1
        log.warning(StoreLogEvent.CORRUPT_VALUE, url=self.url, key=key, problem=problem)
        return False

    @property
    def supports_retention(self) -> bool:
        """Whether ``retain`` can keep entries (``hybridkv.store.retention``); ``False``: it answers
        ``TRANSFER_FAILED`` for every key."""
        return _retain_of(self._backend) is not None

    def retain(self, keys: Sequence[str], until: float) -> list[Status]:
        """Keep each stored key ahead of ordinary entries until ``until`` (``time.time()`` seconds; in the
        past: release it), within the store's retention budget (``hybridkv.store.retention``)."""
        self._check_open()
        if not keys:
            return []
        retain = _retain_of(self._backend)
        if retain is None:
            return [Status.TRANSFER_FAILED] * len(keys)
        return self._checked_results("retain", keys, retain(keys, until))

    def remove(self, keys: Sequence[str]) -> list[Status]:
        self._check_open()
        if not keys:
            return []
        return self._checked_results("remove", keys, self._backend.remove(keys))

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        self._check_open()
        return self._backend.iter_keys(prefix)

    def remove_prefix(self, prefix: str) -> int:
        self._check_open()
        return self._backend.remove_prefix(prefix)

    def stats(self) -> StoreStats:
        self._check_open()
        stats = self._backend.stats()
        if self._keyring is None:
            framing: dict[str, object] = {"checksum": self._checksum.url_name}
        else:  # key ids only: every frame carries one, they reveal nothing of the secrets
            framing = {"checksum": "blake3-keyed", "integrity_key_ids": self._keyring.key_ids}
        return with_extra(stats, {**framing, "num_corrupt_reads": self._num_corrupt})

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._backend.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FramedStore({self.url!r})"

    def _checked_results(self, op: str, keys: Sequence[str], results: list[Status]) -> list[Status]:
        assert len(results) == len(keys), (
            f"backend {type(self._backend).__name__}.{op} returned {len(results)} results for {len(keys)} keys"
        )
        return results
