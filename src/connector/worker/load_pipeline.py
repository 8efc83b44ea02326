"""The worker's async load pipeline: a queue and a thread that read load jobs from the store into pages.

Contracts:

- Every load job queued here is reported to the :class:`~hybridkv.connector.worker.outbox.Outbox` once done
  (``load_finished``, failed when any block is not OK); a job that raised is reported failed
  (``TRANSPORT_ERROR``: the request recomputes). A store failure never reaches the engine.
- A job's blocks go in batches (``WorkerContext.batches``): host caches, one batch per group; CUDA, one
  slab per batch (store -> pinned slab -> device blocks), whose host->device copies wait on the fence
  recorded in ``start_load_kv`` and have completed before the job is reported. A batch that gets no slab
  within :data:`LOAD_STAGING_WAIT_S` is not attempted (``NOT_ATTEMPTED`` keeps the entry).
- A batch of at least :data:`SPLIT_READ_MIN_BYTES` is read by :data:`LOAD_READERS` threads at once, each its
  own contiguous share of the keys (:meth:`LoadPipeline._read_into`).
- Buffer ownership follows :mod:`hybridkv.connector.worker.ownership`: a store that may answer late reads into
  private buffers (host path: pooled, pre-faulted, in rounds of at most one PUT wave), and each share's
  thread copies its OK blocks into the pages once its own call returned on time; a buffer a late call
  still writes is never copied from (nor reused); a job whose late call writes the KV pages themselves is
  reported only once that call returned.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Any, TypeVar

import structlog
from hybridkv.connector.datapath.movers import Fence, StagedBlocks
from hybridkv.connector.log_events import ConnectorLogEvent
from hybridkv.connector.metadata import BlockRef, LoadJob, LoadResult
from hybridkv.connector.outcomes import load_outcome
from hybridkv.connector.worker.context import WorkerContext, as_store_buffers
from hybridkv.connector.worker.cpus import WorkerCpus
from hybridkv.connector.worker.load_probe import LoadProbe
from hybridkv.connector.worker.outbox import Outbox
from hybridkv.connector.worker.ownership import LateOwnership, Quarantine
from hybridkv.lifecycle.keys import KeyScheme
from hybridkv.lifecycle.load import LoadOutcome
from hybridkv.store.base import Status, Value, collect_late_calls, contiguous_shares

log = structlog.get_logger(__name__)

T = TypeVar("T")

#: CUDA: how long the load thread waits for a free slab before failing the job (the request recomputes).
LOAD_STAGING_WAIT_S = 5.0
#: Threads that read one load batch from the store: the load thread and ``LOAD_READERS - 1`` helpers, each
#: reading (and verifying) its own contiguous share of the keys. One thread reads a file-store hit at about
#: half of memcpy speed (the kernel's copy out of tmpfs pages) and then checksums it; two threads overlap
#: one key's checksum with another key's read and use a second core (see docs/performance.md, "Figures
#: behind design choices").
LOAD_READERS = 2
#: A batch smaller than this is read by the load thread alone (the hand-off costs more than it saves).
SPLIT_READ_MIN_BYTES = 4 << 20

#: A queue item: (scheme, job, fence, perf_counter when queued if a probe was installed) to run, a
#: threading.Event to set once every load before it finished, or None to stop.
_LoadItem = tuple[KeyScheme, LoadJob, Fence, float | None] | threading.Event | None


class _Readers:
    """The helper threads of split reads (``submit`` returns the call's future).

    Daemon threads: a store call that never returns must not hold up shutdown or interpreter exit (a
    ``ThreadPoolExecutor``'s workers are joined at exit)."""

    def __init__(self, num_threads: int, name: str, cpus: WorkerCpus) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=cpus.run_pinned(self._work), name=f"{name}-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for th in self._threads:
            th.start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((future, fn))
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 -- delivered to the submitter, who re-raises it
                    future.set_exception(exc)

    def shutdown(self) -> None:
        """Ask the threads to exit after their current call (never waits)."""
        for _ in self._threads:
            self._jobs.put(None)


class LoadPipeline:
    """The load queue, its thread and the split-read helpers. :meth:`submit` and :meth:`drain` are the
    engine thread's; everything else runs on the load thread."""

    def __init__(self, ctx: WorkerContext, outbox: Outbox, quarantine: Quarantine) -> None:
        self._ctx = ctx
        self._outbox = outbox
        self._quarantine = quarantine
        #: the bench's load profile (``WorkerSide.install_load_probe``); None in production: nothing timed
        self.probe: LoadProbe | None = None
        self._queue: queue.Queue[_LoadItem] = queue.Queue()
        self._readers = _Readers(LOAD_READERS - 1, "hybridkv-read", ctx.cpus)
        self._thread = threading.Thread(
            target=ctx.cpus.run_pinned(self._loop), name="hybridkv-load", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ engine thread
    def submit(self, scheme: KeyScheme, jobs: list[LoadJob], fence: Fence) -> None:
        """Queue ``jobs`` (each owed a report, see :meth:`Outbox.loads_queued`)."""
        self._outbox.loads_queued(len(jobs))
        queued_at = time.perf_counter() if self.probe is not None else None
        for job in jobs:
            self._queue.put((scheme, job, fence, queued_at))

    def drain(self, timeout: float) -> bool:
        """Wait until every job queued so far is done; False after ``timeout`` seconds."""
        drained = threading.Event()
        self._queue.put(drained)
        return drained.wait(timeout)

    def stop(self) -> None:
        """Ask the thread to exit after the jobs queued so far, and the readers after their current call."""
        self._queue.put(None)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        self._readers.shutdown()

    # ------------------------------------------------------------------ load thread
    def _finish(self, job: LoadJob, ok: bool, results: list[LoadResult]) -> None:
        if self.probe is not None:
            self.probe.load_finished(job.req_id)
        self._outbox.load_finished(job.req_id, ok, results, owed=True)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
                continue
            scheme, job, fence, queued_at = item
            owned = LateOwnership()
            started = time.perf_counter()
            probe = self.probe
            if probe is not None and queued_at is not None:
                probe.add("queue_s", started - queued_at)
            try:
                ok, results = self._load_job(scheme, job, fence, owned, probe)
            except Exception as exc:  # noqa: BLE001 -- a store bug must not kill the engine: the request recomputes
                log.warning(ConnectorLogEvent.LOAD_RAISED, request_id=job.req_id, error=repr(exc))
                ok = False
                results = self._ctx.load_results(job, LoadOutcome.TRANSPORT_ERROR)
            self._ctx.stats.add("load_job_seconds", time.perf_counter() - started)
            if probe is not None:
                probe.add("jobs", 1)
            if not owned.calls:
                self._finish(job, ok, results)
            elif owned.owns_kv_pages:
                # The late call writes the request's KV pages: report only once it returned, so vLLM cannot
                # free (and reuse) them before.
                self._quarantine.hold_until_returned(owned, functools.partial(self._finish, job, ok, results))
            else:
                # The late call writes only its slab or private buffer: the job is over for the KV pages,
                # its buffers are not.
                self._finish(job, ok, results)
                self._quarantine.hold_until_returned(owned, lambda: None)

    def _load_job(
        self, scheme: KeyScheme, job: LoadJob, fence: Fence, owned: LateOwnership, probe: LoadProbe | None
    ) -> tuple[bool, list[LoadResult]]:
        """Read ``job``'s blocks into their pages: (every block OK, each block's result). ``owned`` gets the
        late calls and the batches they still own; ``probe``: where the phases are timed, if anywhere."""
        ctx = self._ctx
        refs = job.blocks
        keys = ctx.keys(scheme, refs)
        if not refs:
            return False, []  # a hit the scheduler declined after vLLM allocated it: report it failed
        # None: never attempted (staging stayed exhausted, or too many host batches quarantined); reported
        # NOT_ATTEMPTED, which keeps the entry.
        statuses: list[Status | None] = [None] * len(refs)
        nbytes = 0
        # Host path: a store call that may answer late writes a private buffer (pooled), never the pages.
        private = ctx.private_buffers("get")
        for batches in ctx.batches(refs, range(len(refs)), private=private is not None):
            if private is not None and self._quarantine.refuses_new_batch():
                continue  # fail fast rather than allocate without bound
            held: list[tuple[StagedBlocks, list[int]]] = []
            try:
                started = time.perf_counter() if probe is not None else 0.0
                for idxs in batches:
                    mover = ctx.group_to_mover[refs[idxs[0]].group_index]
                    sb = mover.scatter_targets(
                        [refs[i].block_id for i in idxs],
                        after=fence,
                        timeout=LOAD_STAGING_WAIT_S,
                        private=private,
                    )
                    if sb is not None:  # else staging stayed exhausted: these blocks stay TRANSFER_FAILED
                        held.append((sb, idxs))
                order = [i for _, idxs in held for i in idxs]
                if not order:
                    continue
                destinations = as_store_buffers([p for sb, _ in held for p in sb.parts])
                read_started = read_ended = time.perf_counter() if probe is not None else 0.0
                late: list[Future[object]] = []
                written: list[int] = []  # bytes the shares wrote into pages as they returned (private)
                write_share = self._share_writer(held, written, probe) if private is not None else None
                try:
                    got = self._read_into(
                        [keys[i] for i in order],
                        destinations,
                        sum(ctx.block_nbytes(refs[i].group_index) for i in order),
                        late,
                        write_share,
                    )
                finally:
                    # Also when a share raised: the late calls still write these destinations.
                    if late:
                        kv_pages = not ctx.is_staged and private is None
                        owned.take(late, [sb for sb, _ in held], kv_pages=kv_pages)
                        held = []
                if probe is not None:
                    read_ended = time.perf_counter()
                    probe.add("targets_s", read_started - started)
                    probe.add("store_s", read_ended - read_started)
                for i, st in zip(order, got, strict=True):
                    statuses[i] = st
                nbytes += sum(written)
                if late or write_share is not None:
                    # Late: the calls still write these destinations (now owned): never commit them.
                    # Private: every share on time wrote its OK blocks as it returned; the buffers go back.
                    continue
                for sb, idxs in held:
                    flags = [statuses[i] is Status.OK for i in idxs]
                    sb.commit(flags)
                    nbytes += sum(flags) * ctx.block_nbytes(refs[idxs[0]].group_index)
                if probe is not None:
                    probe.add("commit_s", time.perf_counter() - read_ended)
            finally:
                for sb, _ in held:
                    sb.release()
        results = self._load_results(refs, statuses)
        ctx.stats.add("load_keys", len(keys))
        ctx.stats.add("load_bytes", nbytes)
        return all(st is Status.OK for st in statuses), results

    def _load_results(self, refs: Sequence[BlockRef], statuses: Sequence[Status | None]) -> list[LoadResult]:
        """Each block's result (``None``: never attempted, reported ``NOT_ATTEMPTED``); counts the failed."""
        ctx = self._ctx
        results = []
        for ref, status in zip(refs, statuses, strict=True):
            if status is not Status.OK:
                ctx.stats.add("load_failed_keys")
            results.append(LoadResult(ref.entry(ctx.tp_rank), load_outcome(status)))
        return results

    def _share_writer(
        self, held: list[tuple[StagedBlocks, list[int]]], written: list[int], probe: LoadProbe | None
    ) -> Callable[[int, list[Status]], None]:
        """Host path, private batches: what :meth:`_read_into` runs on a share's thread once that share's
        call returned on time (it left no late call): copy the share's OK blocks from the private buffers
        into their pages, right after the read (the bytes still in cache, beside the other share's read),
        and append the bytes to ``written``. A share whose call answered late writes nothing: its buffers
        are quarantined."""
        rows = [(sb, row) for sb, idxs in held for row in range(len(idxs))]  # key position -> (batch, row)

        def write(first: int, got: list[Status]) -> None:
            started = time.perf_counter() if probe is not None else 0.0
            keep: dict[int, tuple[StagedBlocks, list[bool]]] = {}
            for pos, st in enumerate(got, start=first):
                if st is Status.OK:
                    sb, row = rows[pos]
                    keep.setdefault(id(sb), (sb, [False] * len(sb.block_ids)))[1][row] = True
            for sb, flags in keep.values():
                sb.write(flags)
                written.append(sum(flags) * sb.block_nbytes)
            if probe is not None:
                probe.add("commit_s", time.perf_counter() - started)

        return write

    def _read_into(
        self,
        keys: list[str],
        destinations: list[Value],
        nbytes: int,
        late: list[Future[object]],
        on_time: Callable[[int, list[Status]], None] | None = None,
    ) -> list[Status]:
        """``store.get_into(keys, destinations)``: the statuses in key order. Appends to ``late`` the calls
        that answered while still writing their destinations (see :mod:`hybridkv.connector.worker.ownership`) --
        every share's, also when some share raised. ``on_time(first key index, statuses)`` runs on a
        share's thread once its call returned leaving no late call (see :meth:`_share_writer`).

        A batch of at least ``SPLIT_READ_MIN_BYTES`` is split into ``LOAD_READERS`` contiguous shares of
        keys: this thread reads the first, the helper readers the others, at once (each share's checksum
        runs right after its own reads, while the bytes are in cache). Returns or raises only once every
        share's call has returned; an exception of any share propagates (the job fails, the request
        recomputes), after ``late`` has every share's late calls.
        """
        shares = contiguous_shares(len(keys), LOAD_READERS if nbytes >= SPLIT_READ_MIN_BYTES else 1)
        shares_late: list[list[Future[object]]] = [[] for _ in shares]
        helpers = [
            self._readers.submit(
                functools.partial(
                    self._read_share, keys[a:b], destinations[a:b], shares_late[share], a, on_time
                )
            )
            for share, (a, b) in enumerate(shares[1:], start=1)
        ]
        try:
            _, first_end = shares[0]
            statuses = self._read_share(
                keys[:first_end], destinations[:first_end], shares_late[0], 0, on_time
            )
        finally:
            # Never hand the destinations back while a helper may still write them; then every share's
            # late calls are the caller's to keep, whatever raised.
            futures_wait(helpers)
            for share_late in shares_late:
                late.extend(share_late)
        for helper in helpers:
            statuses.extend(helper.result())
        assert len(statuses) == len(keys), f"store answered {len(statuses)} statuses for {len(keys)} keys"
        return statuses

    def _read_share(
        self,
        keys: list[str],
        destinations: list[Value],
        late: list[Future[object]],
        first: int = 0,
        on_time: Callable[[int, list[Status]], None] | None = None,
    ) -> list[Status]:
        """One thread's ``get_into`` of the keys from index ``first`` of the batch; appends the late calls
        it left to ``late``, also when it raises (``collect_late_calls`` is per thread). Then, when it left
        none, ``on_time(first, statuses)``."""
        with collect_late_calls() as share_late:
            try:
                statuses = list(self._ctx.store.get_into(keys, destinations))
            finally:
                late.extend(share_late)
        if on_time is not None and not share_late:
            on_time(first, statuses)
        return statuses
