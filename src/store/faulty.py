"""``faulty+URL?get_fail=P&put_fail=P&exists_fail=P&corrupt=P&delay_ms=N&get_late=P&put_late=P&late_ms=N&seed=S``
(and the positional ``exists_gap``, ``get_tail``, ``fail_after``, ... below): a chaos wrapper.

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

Positional faults (a gapped found-set, a failed tail, a run of failed calls) hit keys by their position in a
batch call, counted among the call's keys *in scope* (all of them unless ``fault_*`` says otherwise):

- ``exists_gap`` / ``get_gap`` / ``put_gap`` = ``I[,J...]``: the keys at these 0-based positions of every
  call of that operation (a position past a call's last key touches nothing in it);
- ``exists_tail`` / ``get_tail`` / ``put_tail`` = ``F`` in [0, 1]: the last ``ceil(F * n)`` of a call's
  ``n`` keys (``get_tail=0.25``: the last quarter; any ``F > 0`` hits at least the last key);
- ``exists_random_gaps`` / ``get_random_gaps`` / ``put_random_gaps`` = ``N``: ``N`` distinct positions of
  every call (all of a smaller call), drawn from a generator of their own seeded with ``seed``: the same
  seed and the same sequence of calls give the same positions, whatever the probabilities above draw;
- ``fail_calls=N`` / ``fail_after=K``: calls number ``K+1`` .. ``K+N`` fail as a whole. Calls are numbered
  1, 2, ... as they arrive, one count over the operations ``fail_ops`` lists (``exists,get,put``, the
  default; ``fail_ops=get`` numbers and fails only gets), counting every call with at least one key.
  ``fail_after=K`` alone: every call after the K-th fails (the store dies); ``fail_calls=N`` alone: the
  first N (default ``fail_after`` 0);
- ``fault_group=G[,H...]`` / ``fault_tp_rank=R[,...]`` / ``fault_dcp_rank=R[,...]``: the scope. Only block
  keys (``hkv1/<namespace>/<fingerprint>/g<G>/tp<R>/dcp<R>/<hash>``) of those groups and ranks take
  positional faults; other keys (other groups and ranks, keys of no block) pass untouched and hold no
  position. Each one left out matches every group / rank. The probabilities ignore the scope.

A positional fault answers like a store that lost the entry (``exists``: ``NOT_FOUND`` at a gap, a tail or
a random gap -- the entries after it may well be found) or the call (a failed call: ``TRANSFER_FAILED``
for every key in scope, ``exists`` included); ``get`` and ``put`` answer ``TRANSFER_FAILED`` (a get leaves
its destination untouched, a put stores nothing). The inner backend is not asked about those keys, and the
probabilities are drawn only for the keys positional faults leave.
"""

from __future__ import annotations

import functools
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future

from hybridkv.store.base import Status, StoreStats, register_late_call, with_extra
from hybridkv.store.faulty_patterns import (
    MAX_PATTERN_NUMBER,
    NO_PATTERNS,
    PATTERN_OPS,
    FaultPatterns,
    FaultScope,
    OpPattern,
    read_fault_patterns,
)
from hybridkv.store.framed import Backend, FrameParts
from hybridkv.store.params import MAX_DURATION_MS, Params

# The positional patterns (their types, their parameters read from a URL) live in ``faulty_patterns``; they
# are re-exported here, beside the backend that applies them.
__all__ = [
    "FAULTY_PARAMS",
    "MAX_PATTERN_NUMBER",
    "NO_PATTERNS",
    "PATTERN_OPS",
    "SCRIBBLE_BYTE",
    "FaultPatterns",
    "FaultScope",
    "FaultyBackend",
    "OpPattern",
    "read_fault_patterns",
]

#: Every parameter of a ``faulty+`` URL.
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
    *(f"{op}_{kind}" for op in PATTERN_OPS for kind in ("gap", "tail", "random_gaps")),
    "fail_after",
    "fail_calls",
    "fail_ops",
    "fault_group",
    "fault_tp_rank",
    "fault_dcp_rank",
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
        patterns: FaultPatterns = NO_PATTERNS,
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
        self.patterns = patterns
        self._random = random.Random(seed)
        # A generator of their own: the positions a seed gives do not shift with the probabilities' draws.
        self._pattern_random = random.Random(f"faulty-patterns:{seed}")
        self._num_numbered_calls = 0
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
            "exists_pattern": 0,
            "get_pattern": 0,
            "put_pattern": 0,
            "failed_calls": 0,
        }

    @classmethod
    def factory(cls, params: Params) -> Callable[[str, Backend], FaultyBackend]:
        """Reads and checks every ``faulty+`` parameter in ``params`` (``StoreError`` naming a bad one),
        opening nothing; returns what wraps an inner backend as ``factory(url, inner)``."""
        return functools.partial(
            cls,
            get_fail=params.probability("get_fail"),
            put_fail=params.probability("put_fail"),
            exists_fail=params.probability("exists_fail"),
            corrupt=params.probability("corrupt"),
            delay_ms=params.number("delay_ms", 0.0, maximum=MAX_DURATION_MS),
            get_late=params.probability("get_late"),
            put_late=params.probability("put_late"),
            late_ms=params.number("late_ms", 200.0, maximum=MAX_DURATION_MS),
            late_scribble=params.integer("late_scribble", 1, minimum=0) != 0,
            patterns=read_fault_patterns(params),
            seed=params.integer("seed", 0, minimum=-(1 << 63)),
        )

    def _draw(self, probability: float) -> bool:
        if probability <= 0.0:
            return False
        with self._lock:
            return self._random.random() < probability

    def _randint(self, low: int, high: int) -> int:
        with self._lock:
            return self._random.randint(low, high)

    def _count(self, what: str, num: int = 1) -> None:
        with self._lock:
            self.num_injected[what] += num

    def _delay(self) -> None:
        if self.delay_ms > 0:
            time.sleep(self.delay_ms / 1000.0)

    def _positional_faults(self, op: str, keys: Sequence[str]) -> dict[int, Status]:
        """Batch index -> what a positional fault answers for that key in this call of ``op`` (empty when
        none applies); numbers the call when a failed run counts ``op``. Call it once per call, on arrival."""
        patterns = self.patterns
        pattern = patterns.of(op)
        numbered = bool(keys) and patterns.numbers_calls_of(op)
        if not numbered and pattern.is_empty:
            return {}
        in_scope = [index for index, key in enumerate(keys) if patterns.scope.contains(key)]
        if numbered:
            with self._lock:
                self._num_numbered_calls += 1
                call_number = self._num_numbered_calls
            if patterns.fails_call(call_number):
                self._count("failed_calls")
                self._count(f"{op}_pattern", len(in_scope))
                return dict.fromkeys(in_scope, Status.TRANSFER_FAILED)
        num_in_scope = len(in_scope)
        positions = {position for position in pattern.gap if position < num_in_scope}
        positions.update(range(num_in_scope - pattern.num_tail(num_in_scope), num_in_scope))
        if pattern.num_random_gaps and num_in_scope:
            with self._lock:
                positions.update(
                    self._pattern_random.sample(
                        range(num_in_scope), min(pattern.num_random_gaps, num_in_scope)
                    )
                )
        # exists: a found-set with holes (the store lost those entries); get / put: the transfer failed.
        status = Status.NOT_FOUND if op == "exists" else Status.TRANSFER_FAILED
        self._count(f"{op}_pattern", len(positions))
        return {in_scope[position]: status for position in sorted(positions)}

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
        self, keys: Sequence[str], probability: float, what: str, faults: dict[int, Status]
    ) -> tuple[list[int], list[Status | None]]:
        """Indices that pass through, and a result list pre-filled with injected failures: the positional
        ``faults``, then per remaining key one draw of ``probability``."""
        results: list[Status | None] = [None] * len(keys)
        passing: list[int] = []
        for index in range(len(keys)):
            fault = faults.get(index)
            if fault is not None:
                results[index] = fault
            elif self._draw(probability):
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
        faults = self._positional_faults("exists", keys)
        if (
            self.exists_fail <= 0.0 and not faults
        ):  # nothing to inject: no per-key Python work (lookups are big)
            return self.inner.exists(keys)
        passing, results = self._split(keys, self.exists_fail, "exists_fail", faults)
        inner = self.inner.exists([keys[i] for i in passing]) if passing else []
        return self._merge(results, passing, inner)

    def put_frames(self, keys: Sequence[str], frames: Sequence[FrameParts]) -> list[Status]:
        self._delay()
        faults = self._positional_faults("put", keys)
        if keys and self._draw(self.put_late):
            key_list, frame_list = list(keys), list(frames)
            return self._late("late_put", len(keys), lambda: self._put_frames(key_list, frame_list, faults))
        return self._put_frames(keys, frames, faults)

    def _put_frames(
        self, keys: Sequence[str], frames: Sequence[FrameParts], faults: dict[int, Status]
    ) -> list[Status]:
        passing, results = self._split(keys, self.put_fail, "put_fail", faults)
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
        faults = self._positional_faults("get", keys)
        if keys and self._draw(self.get_late):
            key_list, frame_list = list(keys), list(frames)

            def late_get() -> list[Status]:
                statuses = self._get_frames_into(key_list, frame_list, faults)
                if self.late_scribble:
                    for frame in frame_list:
                        for part in frame[1:]:  # the payload (frame[0] is the header)
                            part[:] = bytes([SCRIBBLE_BYTE]) * part.nbytes
                return statuses

            return self._late("late_get", len(keys), late_get)
        return self._get_frames_into(keys, frames, faults)

    def _get_frames_into(
        self, keys: Sequence[str], frames: Sequence[FrameParts], faults: dict[int, Status]
    ) -> list[Status]:
        passing, results = self._split(keys, self.get_fail, "get_fail", faults)
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

    @property
    def can_retain(self) -> bool:
        """Whether the inner store retains (``hybridkv.store.framed.RetainingBackend``)."""
        return callable(getattr(self.inner, "retain", None))

    def retain(self, keys: Sequence[str], until: float) -> list[Status]:
        """The inner store's retention, untouched by faults (it changes no bytes and no presence);
        ``TRANSFER_FAILED`` where the inner store cannot retain."""
        retain = getattr(self.inner, "retain", None)
        if not callable(retain):
            return [Status.TRANSFER_FAILED] * len(keys)
        statuses: list[Status] = retain(keys, until)
        return statuses

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

    def num_faults_injected(self) -> int:
        """Every fault this view injected so far (the sum of ``stats()``'s ``injected_*``)."""
        with self._lock:
            return sum(self.num_injected.values())

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
