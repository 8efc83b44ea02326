"""``faulty+URL?get_fail=P&put_fail=P&exists_fail=P&corrupt=P&delay_ms=N&get_late=P&put_late=P&late_ms=N&seed=S``:
a chaos wrapper.

A product feature, meant for staging: it wraps the backend of any other URL and, per key, with the given
probabilities,

- ``exists_fail`` / ``get_fail`` / ``put_fail``: answers ``TRANSFER_FAILED`` without calling the inner
  backend (a failed put stores nothing);
- ``corrupt``: damages real frame bytes -- on ``put`` the stored copy (one flipped bit, or a truncated
  tail), on ``get`` the bytes just read (one flipped bit) -- so the frame check above must report
  ``CORRUPT``. (With ``checksum=none`` only header damage is detectable; a payload flip is then returned as
  ``OK`` -- that is what ``none`` means.)
- ``delay_ms``: sleeps before each batch call.
- ``get_late`` / ``put_late``: per batch call, misses the deadline the way an abandoned Mooncake call does:
  answers ``TIMEOUT`` for every key at once, and ``late_ms`` (default 200) milliseconds later completes
  the operation on a background thread -- a late put reads the caller's values then (and stores them), a
  late get writes the caller's destinations then. With ``late_scribble=1`` (the default) a late get
  overwrites the destinations' payload bytes with a fixed garbage pattern after the read, so a caller that
  reused them before the call returned computes on visibly wrong bytes. The call's completion handle is
  registered with ``hybridkv.store.base.register_late_call``.

Decisions come from one ``random.Random(seed)`` drawn in call order, so a single-threaded run with a given
seed injects the same faults every time. The caller's buffers are never modified on ``put``.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future

from hybridkv.store.base import Status, StoreStats, register_late_call, with_extra
from hybridkv.store.framed import Backend, FrameParts

FAULTY_PARAMS = (
    "get_fail",
    "put_fail",
    "exists_fail",
    "corrupt",
    "delay_ms",
    "get_late",
    "put_late",
    "late_ms",
    "late_scribble",
    "seed",
)

#: What a late get with ``late_scribble`` leaves in its destinations' payload bytes.
SCRIBBLE_BYTE = 0xA5


class FaultyBackend:
    """Injects failures, corruption and delay around an inner backend (see the module docstring)."""

    def __init__(
        self,
        url: str,
        inner: Backend,
        *,
        get_fail: float = 0.0,
        put_fail: float = 0.0,
        exists_fail: float = 0.0,
        corrupt: float = 0.0,
        delay_ms: float = 0.0,
        get_late: float = 0.0,
        put_late: float = 0.0,
        late_ms: float = 200.0,
        late_scribble: bool = True,
        seed: int = 0,
    ) -> None:
        for name, probability in (
            ("get_fail", get_fail),
            ("put_fail", put_fail),
            ("exists_fail", exists_fail),
            ("corrupt", corrupt),
            ("get_late", get_late),
            ("put_late", put_late),
        ):
            assert 0.0 <= probability <= 1.0, f"faulty {name}={probability} outside [0, 1]"
        self.url = url
        self.inner: Backend = inner
        self.get_fail = get_fail
        self.put_fail = put_fail
        self.exists_fail = exists_fail
        self.corrupt = corrupt
        self.delay_ms = delay_ms
        self.get_late = get_late
        self.put_late = put_late
        self.late_ms = late_ms
        self.late_scribble = late_scribble
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._late_threads: set[threading.Thread] = set()
        self.num_injected: dict[str, int] = {
            "exists_fail": 0,
            "get_fail": 0,
            "put_fail": 0,
            "corrupt_put": 0,
            "corrupt_get": 0,
            "late_get": 0,
            "late_put": 0,
        }

    def _draw(self, probability: float) -> bool:
        if probability <= 0.0:
            return False
        with self._lock:
            return self._random.random() < probability

    def _randint(self, low: int, high: int) -> int:
        with self._lock:
            return self._random.randint(low, high)

    def _count(self, what: str) -> None:
        with self._lock:
            self.num_injected[what] += 1

    def _delay(self) -> None:
        if self.delay_ms > 0:
            time.sleep(self.delay_ms / 1000.0)

    def _late(self, what: str, num_keys: int, operation: Callable[[], object]) -> list[Status]:
        """Answer ``TIMEOUT`` now; run ``operation`` ``late_ms`` later on a thread (see the module docstring)."""
        self._count(what)
        done: Future[object] = Future()
        done.set_running_or_notify_cancel()

        def complete() -> None:
            time.sleep(self.late_ms / 1000.0)
            result: object = None
            error: BaseException | None = None
            try:
                result = operation()
            except BaseException as raised:  # noqa: BLE001 -- the caller has gone; the handle carries it
                error = raised
            with self._lock:  # no longer pending before anyone waiting on ``done`` wakes up
                self._late_threads.discard(threading.current_thread())
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

        thread = threading.Thread(target=complete, name=f"faulty-{what}", daemon=True)
        with self._lock:
            self._late_threads.add(thread)
        thread.start()
        register_late_call(done)
        return [Status.TIMEOUT] * num_keys

    @property
    def num_late_pending(self) -> int:
        """Late operations that have not completed yet (they may still read or write caller buffers)."""
        with self._lock:
            return len(self._late_threads)

    def _split(
        self, keys: Sequence[str], probability: float, what: str
    ) -> tuple[list[int], list[Status | None]]:
        """Indices that pass through, and a result list pre-filled with injected failures."""
        results: list[Status | None] = [None] * len(keys)
        passing: list[int] = []
        for index in range(len(keys)):
            if self._draw(probability):
                results[index] = Status.TRANSFER_FAILED
                self._count(what)
            else:
                passing.append(index)
        return passing, results

    @staticmethod
    def _merge(results: list[Status | None], passing: list[int], inner: list[Status]) -> list[Status]:
        for index, status in zip(passing, inner, strict=True):
            results[index] = status
        assert all(status is not None for status in results), "faulty: a key got no result"
        return [status for status in results if status is not None]

    def answers_late(self, op: str) -> bool:
        """With ``get_late`` / ``put_late`` for that op, or when the inner backend may (``delay_ms`` only
        slows a call down: it still returns before answering)."""
        late = self.get_late if op == "get" else self.put_late
        return late > 0 or self.inner.answers_late(op)

    def exists(self, keys: Sequence[str]) -> list[Status]:
        self._delay()
        if self.exists_fail <= 0.0:  # nothing to inject per key: no per-key Python work (lookups are big)
            return self.inner.exists(keys)
        passing, results = self._split(keys, self.exists_fail, "exists_fail")
        inner = self.inner.exists([keys[i] for i in passing]) if passing else []
        return self._merge(results, passing, inner)

    def put_frames(self, keys: Sequence[str], frames: Sequence[FrameParts]) -> list[Status]:
        self._delay()
        if keys and self._draw(self.put_late):
            key_list, frame_list = list(keys), list(frames)
            return self._late("late_put", len(keys), lambda: self._put_frames(key_list, frame_list))
        return self._put_frames(keys, frames)

    def _put_frames(self, keys: Sequence[str], frames: Sequence[FrameParts]) -> list[Status]:
        passing, results = self._split(keys, self.put_fail, "put_fail")
        inner_frames: list[FrameParts] = []
        for index in passing:
            frame = frames[index]
            if self._draw(self.corrupt):
                self._count("corrupt_put")
                frame = self._damaged_copy(frame)
            inner_frames.append(frame)
        inner = self.inner.put_frames([keys[i] for i in passing], inner_frames) if passing else []
        return self._merge(results, passing, inner)

    def _damaged_copy(self, frame: FrameParts) -> FrameParts:
        data = bytearray(b"".join(frame))
        if len(data) > 1 and self._draw(0.25):
            del data[self._randint(1, len(data) - 1) :]  # a torn write: the tail is missing
        else:
            bit = self._randint(0, len(data) * 8 - 1)
            data[bit // 8] ^= 1 << (bit % 8)
        return [memoryview(data)]

    def get_frames_into(self, keys: Sequence[str], frames: Sequence[FrameParts]) -> list[Status]:
        self._delay()
        if keys and self._draw(self.get_late):
            key_list, frame_list = list(keys), list(frames)

            def late_get() -> list[Status]:
                statuses = self._get_frames_into(key_list, frame_list)
                if self.late_scribble:
                    for frame in frame_list:
                        for part in frame[1:]:  # the payload (frame[0] is the header)
                            part[:] = bytes([SCRIBBLE_BYTE]) * part.nbytes
                return statuses

            return self._late("late_get", len(keys), late_get)
        return self._get_frames_into(keys, frames)

    def _get_frames_into(self, keys: Sequence[str], frames: Sequence[FrameParts]) -> list[Status]:
        passing, results = self._split(keys, self.get_fail, "get_fail")
        inner = (
            self.inner.get_frames_into([keys[i] for i in passing], [frames[i] for i in passing])
            if passing
            else []
        )
        for index, status in zip(passing, inner, strict=True):
            if status is Status.OK and self._draw(self.corrupt):
                self._count("corrupt_get")
                frame = frames[index]
                total_bits = sum(part.nbytes for part in frame) * 8
                bit = self._randint(0, total_bits - 1)
                byte = bit // 8
                for part in frame:  # find the part holding that byte
                    if byte < part.nbytes:
                        part[byte] ^= 1 << (bit % 8)
                        break
                    byte -= part.nbytes
        return self._merge(results, passing, inner)

    def remove(self, keys: Sequence[str]) -> list[Status]:
        self._delay()
        statuses: list[Status] = self.inner.remove(keys)
        return statuses

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        keys: Iterator[str] = self.inner.iter_keys(prefix)
        return keys

    def remove_prefix(self, prefix: str) -> int:
        self._delay()
        num_removed: int = self.inner.remove_prefix(prefix)
        return num_removed

    def stats(self) -> StoreStats:
        inner = self.inner.stats()
        with self._lock:
            injected = {f"injected_{name}": count for name, count in self.num_injected.items()}
        return with_extra(inner, {"inner_url": inner.url, **injected}, url=self.url)

    def close(self) -> None:
        """Waits (at most ``late_ms`` + 5 s) for late operations, then closes the inner backend."""
        with self._lock:
            threads = list(self._late_threads)
        deadline = time.monotonic() + self.late_ms / 1000.0 + 5.0
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self.inner.close()
