"""The worker's save pipeline: a queue and a thread that write save jobs to the store in PUT waves.

Contracts:

- Saves are queued in ``wait_for_save`` (:meth:`SavePipeline.submit`, engine thread, never waits). On CPU
  the forward already finished, so the bytes are final; on CUDA a fence recorded on the compute stream
  there makes the save thread's device->host copies wait for it (the scheduler pins the source blocks
  until every rank reports the job).
- One kind of block is not final there: a full-attention *tail* saved under a boundary inside it (the key
  boundary is not a multiple of the group's span), which the next steps keep appending to. On the host
  path it is copied at submit (one page per group per such save) and the store gets that copy, so the
  checksum and the stored bytes are one consistent snapshot; on CUDA the staging slab is that copy already.
- Blocks go out in PUT waves of at most ``put_wave_bytes`` (CUDA: also one group and one staging slab per
  wave). Backpressure: at most :data:`MAX_WAVES_IN_FLIGHT` waves' bytes are queued per rank; beyond that a
  job is dropped and counted (``put_wave_drops``): a slow or full store never stalls the engine.
  ``NO_SPACE`` drops the wave; so does a staging pool that stays exhausted for
  :data:`SAVE_STAGING_WAIT_S`. Keys the store already has are not sent (``save_skipped_keys``).
- Every job submitted is reported to the :class:`~hybridkv.connector.worker.outbox.Outbox` (``save_finished``),
  dropped jobs included. Buffer ownership follows :mod:`hybridkv.connector.worker.ownership`: a put that may
  answer late reads a private copy (host path) or its slab; a job whose late put reads the KV pages
  themselves is reported, and its in-flight bytes freed, only once that put returned.
"""

from __future__ import annotations

import functools
import queue
import threading

import numpy as np
import structlog
from hybridkv.connector.datapath.movers import Fence, HostBufferPool, StagedBlocks
from hybridkv.connector.log_events import ConnectorLogEvent
from hybridkv.connector.metadata import SaveJob, SaveOutcome, SaveResult
from hybridkv.connector.outcomes import save_outcome
from hybridkv.connector.worker.context import WorkerContext, as_store_buffers
from hybridkv.connector.worker.outbox import Outbox
from hybridkv.connector.worker.ownership import LateOwnership, Quarantine
from hybridkv.lifecycle.keys import KeyScheme
from hybridkv.lifecycle.kinds import KIND_RULES
from hybridkv.store.base import Status, collect_late_calls

log = structlog.get_logger(__name__)

#: PUT waves' bytes a rank may have queued at once (beyond that a job is dropped).
MAX_WAVES_IN_FLIGHT = 4
#: CUDA: how long the save thread waits for a free slab before dropping the wave (off the engine's path).
SAVE_STAGING_WAIT_S = 0.5

#: Position in ``job.blocks`` -> parts copied at submit (open tails, host path), sent instead of the pages.
_Snapshots = dict[int, list[np.ndarray]]
#: A queue item: (scheme, job, bytes, fence, snapshots) to write, a threading.Event to set once everything
#: before it is written, or None to stop.
_SaveItem = tuple[KeyScheme, SaveJob, int, Fence, _Snapshots] | threading.Event | None


class SavePipeline:
    """The save queue, its thread and the in-flight byte budget. :meth:`submit`, :meth:`drop` and
    :meth:`drain` are the engine thread's; everything else runs on the save thread."""

    def __init__(self, ctx: WorkerContext, outbox: Outbox, quarantine: Quarantine) -> None:
        self._ctx = ctx
        self._outbox = outbox
        self._quarantine = quarantine
        self._lock = threading.Lock()
        self._num_inflight_bytes = 0  # guarded by _lock
        #: open full-attention tails copied at submit (host path)
        self.num_tail_snapshots = 0
        self._queue: queue.Queue[_SaveItem] = queue.Queue()
        self._thread = threading.Thread(
            target=ctx.cpus.run_pinned(self._loop), name="hybridkv-save", daemon=True
        )
        self._thread.start()

    @property
    def num_inflight_bytes(self) -> int:
        """Bytes of the jobs admitted and not yet ended (written or failed, and reported)."""
        with self._lock:
            return self._num_inflight_bytes

    # ------------------------------------------------------------------ engine thread
    def submit(self, scheme: KeyScheme, jobs: list[SaveJob], *, admit: bool = True) -> None:
        """Queue ``jobs`` within the in-flight budget; a job beyond it, or every job when not ``admit``
        (the KV cache memory is released: nothing valid to read), is dropped and reported at once.

        CUDA: first records the fence on the current stream, so the save thread's device->host copies read
        the blocks only after every kernel this step queued before ``wait_for_save``."""
        if not jobs:
            return
        ctx = self._ctx
        fence = ctx.fence()
        budget = ctx.cfg.put_wave_bytes * MAX_WAVES_IN_FLIGHT
        for job in jobs:
            nbytes = sum(ctx.block_nbytes(ref.group_index) for ref in job.blocks)
            with self._lock:
                admitted = admit and (
                    self._num_inflight_bytes == 0 or self._num_inflight_bytes + nbytes <= budget
                )
                if admitted:
                    self._num_inflight_bytes += nbytes
            if admitted:
                self._queue.put((scheme, job, nbytes, fence, self._snapshot_open_tails(job)))
            else:
                ctx.stats.add("put_wave_drops")
                self._finish(job, ctx.save_results(job, SaveOutcome.DROPPED))

    def drop(self, jobs: list[SaveJob]) -> None:
        """Report ``jobs`` dropped without reading a block (their step's KV may not reach the store)."""
        for job in jobs:
            self._finish(job, self._ctx.save_results(job, SaveOutcome.DROPPED))

    def drain(self, timeout: float) -> bool:
        """Wait until every job queued so far is written and reported; False after ``timeout`` seconds."""
        marker = threading.Event()
        self._queue.put(marker)
        return marker.wait(timeout)

    def stop(self) -> None:
        """Ask the thread to exit after the jobs queued so far."""
        self._queue.put(None)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _snapshot_open_tails(self, job: SaveJob) -> _Snapshots:
        """Host path: private copies of the job's blocks the next steps may still write (see the module
        docstring), by position in ``job.blocks``. Engine thread; one page copy per open tail."""
        ctx = self._ctx
        if ctx.is_staged:
            return {}
        snapshots: _Snapshots = {}
        for i, ref in enumerate(job.blocks):
            group = ctx.geo.groups[ref.group_index]
            if KIND_RULES[group.kind].stores_partial_tails and ref.key_boundary % group.span:
                snapshots[i] = ctx.group_to_mover[ref.group_index].snapshot(ref.block_id)
        self.num_tail_snapshots += len(snapshots)  # engine thread only
        return snapshots

    # ------------------------------------------------------------------ save thread
    def _finish(self, job: SaveJob, results: list[SaveResult]) -> None:
        self._outbox.save_finished(job.job_id, results)

    def _end(self, job: SaveJob, nbytes: int, results: list[SaveResult]) -> None:
        with self._lock:
            self._num_inflight_bytes -= nbytes
            assert self._num_inflight_bytes >= 0, (
                f"save job {job.job_id} freed more in-flight bytes than held"
            )
        self._finish(job, results)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
                continue
            scheme, job, nbytes, fence, snapshots = item
            owned = LateOwnership()
            try:
                results = self._put_job(scheme, job, fence, owned, snapshots)
            except Exception as exc:  # noqa: BLE001 -- a store failure must never reach the engine
                log.warning(ConnectorLogEvent.SAVE_RAISED, request_id=job.req_id, error=repr(exc))
                results = self._ctx.save_results(job, SaveOutcome.TRANSPORT_ERROR)
            if owned.owns_kv_pages:
                # A late put still reads the source pages: the job's pins and in-flight bytes are released
                # only once it returned.
                self._quarantine.hold_until_returned(
                    owned, functools.partial(self._end, job, nbytes, results)
                )
            else:
                # A late put reads only its slab or private copy, which stay quarantined until it returned.
                self._end(job, nbytes, results)
                if owned.calls:
                    self._quarantine.hold_until_returned(owned, lambda: None)

    def _put_job(
        self, scheme: KeyScheme, job: SaveJob, fence: Fence, owned: LateOwnership, snapshots: _Snapshots
    ) -> list[SaveResult]:
        ctx = self._ctx
        keys = ctx.keys(scheme, job.blocks)
        status: dict[int, SaveOutcome] = {}
        # Insert-if-absent makes duplicates harmless; asking first saves reading and sending the bytes.
        for i, st in enumerate(ctx.store.exists(keys)):
            if st.is_ok:
                status[i] = SaveOutcome.OK
                ctx.stats.add("save_skipped_keys")
        todo = [i for i in range(len(keys)) if i not in status]
        staged = ctx.is_staged
        # Host path: a put that may answer late reads a private copy (in a pooled buffer), never the pages.
        private = ctx.private_buffers("put")
        put_wave = functools.partial(
            self._put_wave,
            job,
            keys,
            status=status,
            fence=fence,
            owned=owned,
            snapshots=snapshots,
            private=private,
        )
        wave: list[int] = []
        wave_bytes = 0
        for i in todo:
            group_index = job.blocks[i].group_index
            # CUDA: a wave is one group's batch that fits one staging slab.
            if (
                wave
                and staged
                and (
                    group_index != job.blocks[wave[0]].group_index
                    or len(wave) >= ctx.group_to_mover[group_index].max_blocks
                )
            ):
                put_wave(wave)
                wave, wave_bytes = [], 0
            wave.append(i)
            wave_bytes += ctx.block_nbytes(group_index)
            if wave_bytes >= ctx.cfg.put_wave_bytes:
                put_wave(wave)
                wave, wave_bytes = [], 0
        if wave:
            put_wave(wave)
        # A block absent from ``status`` was never sent (its staging stayed exhausted).
        return [
            SaveResult(ref.entry(ctx.tp_rank), status.get(i, SaveOutcome.DROPPED))
            for i, ref in enumerate(job.blocks)
        ]

    def _put_wave(
        self,
        job: SaveJob,
        keys: list[str],
        wave: list[int],
        *,
        status: dict[int, SaveOutcome],
        fence: Fence,
        owned: LateOwnership,
        snapshots: _Snapshots,
        private: HostBufferPool | None,
    ) -> None:
        """Put the blocks at positions ``wave``, recording each one's outcome in ``status``; ``private``:
        from a private copy in a buffer of that pool (see :mod:`hybridkv.connector.worker.ownership`)."""
        ctx = self._ctx
        for batches in ctx.batches(job.blocks, wave):
            if private is not None and self._quarantine.refuses_new_batch():
                ctx.stats.add("put_wave_drops")  # dropped rather than copied without bound
                continue
            held: list[tuple[StagedBlocks, list[int]]] = []
            try:
                for idxs in batches:
                    mover = ctx.group_to_mover[job.blocks[idxs[0]].group_index]
                    sb = mover.gather(
                        [job.blocks[i].block_id for i in idxs],
                        after=fence,
                        timeout=SAVE_STAGING_WAIT_S,
                        private=private,
                    )
                    if sb is None:  # staging stayed exhausted: drop these blocks (never stall)
                        ctx.stats.add("put_wave_drops")
                        continue
                    held.append((sb, idxs))
                order = [i for _, idxs in held for i in idxs]
                if not order:
                    continue
                values = as_store_buffers(
                    [
                        snapshots.get(i, p)
                        for i, p in zip(order, (p for sb, _ in held for p in sb.parts), strict=True)
                    ]
                )
                with collect_late_calls() as late:
                    try:
                        statuses = ctx.store.put([keys[i] for i in order], values)
                    finally:
                        # Also when it raised: the call still reads these values; keep them out of use.
                        if late:
                            kv_pages = not ctx.is_staged and private is None
                            owned.take(late, [sb for sb, _ in held], kv_pages=kv_pages)
                            held = []
            finally:
                for sb, _ in held:
                    sb.release()
            ctx.stats.add("save_calls")
            if any(st is Status.NO_SPACE for st in statuses):
                ctx.stats.add("put_wave_drops")
            for i, st in zip(order, statuses, strict=True):
                status[i] = save_outcome(st)
                if st.is_ok:
                    ctx.stats.add("save_keys")
                    ctx.stats.add("save_bytes", ctx.block_nbytes(job.blocks[i].group_index))
                else:
                    ctx.stats.add("save_failed_keys")
