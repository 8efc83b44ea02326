"""Buffer ownership: which memory a store call may still use, and until when (the late-call contract).

Contract:

- A KV page range, private host buffer or staging slab handed to a store call belongs to that call until it
  has really returned, even when the call raised.
- A call that answered ``TIMEOUT`` but goes on (``hybridkv.store.base.collect_late_calls``; a split read
  collects every share's, the raising share's included) is a *late call*. Its buffers stay quarantined
  (:class:`Quarantine`): a slab goes back to the pool only when every call that touched it returned; a
  private host buffer leaves its pool the moment a late call takes it (``LateOwnership.take``), is never
  handed out again, and is dropped once those calls returned (the pool may allocate a replacement).
- So that a late call never owns KV memory, a transfer whose store may answer late (:func:`may_answer_late`:
  Mooncake, ``file://`` on a network or FUSE file system, ``faulty+`` with ``get_late`` / ``put_late``, any
  store the worker does not know) never hands it the pages: CUDA goes through its slabs anyway; on the host
  path a load reads into a private buffer and copies a share's OK blocks into the pages once that share's
  call returned on time (never from a buffer a late call still holds), and a save hands the store a
  private copy taken before the call. Private buffers come
  from the worker's pool of pre-faulted buffers (``staging.HostBufferPool``), to which a batch whose calls
  all answered on time gives its buffer back, in rounds of at most one PUT wave. The job is then
  reported at once (a load failed, a save with its outcomes), so a late call that never returns holds no
  request, no pinned block and no in-flight budget.
- At most :data:`MAX_QUARANTINED_BATCHES` host batches stay quarantined; beyond that a load fails at once
  (``NOT_ATTEMPTED``) and a save wave is dropped rather than allocating more
  (:meth:`Quarantine.refuses_new_batch`).
- Only where the store cannot answer late (memory, file on a local file system) does the host path hand the
  pages themselves to the call (zero copies). If such a store answers late anyway, the batch's
  :class:`LateOwnership` ``owns_kv_pages``: the job is reported only once the call returned (vLLM keeps a
  request's blocks while it waits for its load; the scheduler's pins hold a save's source blocks), and the
  worker's ``flush`` and ``suspend`` wait for that call (:meth:`Quarantine.wait_kv_pages_free`), within
  their timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from hybridkv.connector.datapath.staging import StagedBlocks

#: Host path: private load/save batches late store calls may keep at once.
MAX_QUARANTINED_BATCHES = 8


def may_answer_late(store: object, op: str) -> bool:
    """Whether a ``op`` call ("get" or "put") of ``store`` may answer ``TIMEOUT`` while it goes on using
    its buffers.

    The store says (``answers_late``, which every backend of ``open_store`` declares: memory never; file
    where its directory is on a file system that may hang, or with ``timeout_ms``; Mooncake always;
    ``faulty+`` with ``get_late`` / ``put_late`` or where its inner backend does). Any other store object is
    assumed to answer late: it gets private buffers, never KV pages.
    """
    assert op in ("get", "put"), f"may_answer_late: unknown op {op!r}"
    # Looked up on the class, not the instance: a wrapper that forwards unknown attributes to a store
    # (``__getattr__``) would otherwise answer for that store, while its own calls may answer late.
    if not callable(getattr(type(store), "answers_late", None)):
        return True
    return bool(store.answers_late(op))  # type: ignore[attr-defined]


@dataclass
class LateOwnership:
    """What one job's late store calls still own: their completion handles and the batches (slabs, private
    buffers, or KV pages) they read or write. Nothing here is reused until every call in ``calls`` is done.
    ``owns_kv_pages``: some batch is the KV pages themselves (a direct-path batch of a store that was not
    expected to answer late), so the job may be reported only once the calls returned."""

    calls: list[Future[object]] = field(default_factory=list)
    batches: list[StagedBlocks] = field(default_factory=list)
    owns_kv_pages: bool = False

    def take(self, late: list[Future[object]], batches: list[StagedBlocks], *, kv_pages: bool) -> None:
        """The late calls of one store call (non-empty) and the batches they were handed. A batch's private
        host buffer leaves its pool now, for good (:meth:`StagedBlocks.quarantine`)."""
        assert late, "LateOwnership.take: no late call (only a call that answered late gives up its batches)"
        for batch in batches:
            batch.quarantine()
        self.calls.extend(late)
        self.batches.extend(batches)
        self.owns_kv_pages = self.owns_kv_pages or kv_pages


class Quarantine:
    """The worker's late store calls and what they still own, across its pipelines. Thread-safe.

    :meth:`hold_until_returned` takes a job's :class:`LateOwnership`; once its calls returned it releases the
    batches and runs the job's continuation (its report, for a job that ``owns_kv_pages``).
    """

    def __init__(self, max_batches: int = MAX_QUARANTINED_BATCHES) -> None:
        self._max_batches = max_batches
        # Signalled when a held job's calls have all returned.
        self._returned = threading.Condition()
        #: held jobs that own KV pages (their report waits for their calls)
        self._num_kv_jobs = 0
        #: batches (of any job) late calls still own
        self._num_batches = 0
        #: host batches refused (load failed, save wave dropped) because too many were quarantined
        self.num_refusals = 0
        #: store calls that answered before returning and kept their buffers quarantined (tests, debugging)
        self.num_late_calls = 0
        #: of those, the calls that have not returned yet
        self._num_calls_pending = 0

    def hold_until_returned(self, owned: LateOwnership, then: Callable[[], None]) -> None:
        """Once every call in ``owned`` really returned (on the thread of the last one): release its
        batches, then run ``then``. Until then the batches count as quarantined, and a job that
        ``owns_kv_pages`` as waiting (see :meth:`wait_kv_pages_free`)."""
        assert owned.calls, "Quarantine.hold_until_returned: no late call (report the job at once instead)"
        with self._returned:
            self.num_late_calls += len(owned.calls)
            self._num_calls_pending += len(owned.calls)
            self._num_batches += len(owned.batches)
            if owned.owns_kv_pages:
                self._num_kv_jobs += 1
        num_left = [len(owned.calls)]
        count_lock = threading.Lock()

        def returned(_call: Future[object]) -> None:
            with self._returned:
                self._num_calls_pending -= 1
            with count_lock:
                num_left[0] -= 1
                if num_left[0]:
                    return
            for batch in owned.batches:
                batch.release()
            try:
                then()
            finally:
                with self._returned:
                    self._num_batches -= len(owned.batches)
                    if owned.owns_kv_pages:
                        self._num_kv_jobs -= 1
                    self._returned.notify_all()

        for call in owned.calls:
            call.add_done_callback(returned)

    @property
    def num_calls_pending(self) -> int:
        """Late store calls that have not returned yet."""
        with self._returned:
            return self._num_calls_pending

    def refuses_new_batch(self) -> bool:
        """Host path: whether a new private batch must be refused (too many held by late calls); counts the
        refusal."""
        with self._returned:
            full = self._num_batches >= self._max_batches
            if full:
                self.num_refusals += 1
            return full

    def wait_kv_pages_free(self, timeout: float) -> bool:
        """Wait until no job waits for a late store call that owns KV pages; False after ``timeout``."""
        with self._returned:
            return self._returned.wait_for(lambda: self._num_kv_jobs == 0, timeout)

    def wait_all_returned(self, timeout: float) -> bool:
        """Wait until every late store call has returned and its quarantined buffers are released; False
        after ``timeout`` seconds."""
        with self._returned:
            return self._returned.wait_for(lambda: self._num_kv_jobs == 0 and self._num_batches == 0, timeout)
