"""Layer-wise loads (``load_mode: layerwise``): a hit's load overlaps the forward of the step that uses it.

The scheduler answers a hit as a synchronous load (``(n, False)``): vLLM schedules the request's remaining
tokens in the same step and counts the external tokens as computed. On the worker:

- ``start_load_kv`` (before the forward) hands the step's load jobs to a background thread and returns;
- the thread reads every block of the step (one batched ``get_into`` per group) into private host
  buffers, one buffer per layer tensor (layer-major), then writes them into the KV pages one layer at a
  time in the group's layer order, and marks each layer ready once its pages of every loading request
  are written;
- ``wait_for_layer_load(layer)`` (vLLM calls it from every attention / MLA layer before its attention)
  blocks until that layer is ready, so layer i's attention runs while layer i+1 is being written;
- ``wait_for_save`` and ``get_block_ids_with_load_errors`` (after the forward) end the step: every block
  of a job that did not load entirely, every block of every job when some loaded layer was never waited
  for, and every block of every job when the loads did not finish within ``LAYERWISE_WAIT_S``, is
  reported as a load error, and that step's saves are dropped.

Why private buffers, not the pages: a store call that answered ``TIMEOUT`` but goes on (a late call) may
write its destinations later. The request's pages are recomputed by vLLM in the very next step, so a late
write into them would land on good KV; into a private buffer it lands nowhere. The price is one host copy
per loaded byte (buffer -> page), which is also what makes the per-layer hand-over possible: the store's
values are whole blocks (every layer of a group), so no layer's pages are complete before every block has
been read.

Why the step's saves are dropped when a load fails: the tokens computed in that step attended to the failed
load's pages, so their KV is wrong; vLLM discards the step's output for the request and recomputes, and
nothing of it may reach the store.

A store that misses the deadline stalls every request of the step (their forward waits in
``wait_for_layer_load``), and a slow store misses it again at the next hit. So the scheduler half keeps a
``LayerwiseBreaker`` (:mod:`hybridkv.connector.scheduler.layerwise_breaker`), fed by the loads' outcomes (an entry answered ``TIMEOUT``: the step was
abandoned, or the store's own deadline passed): one missed deadline opens it, and while it is open hits are
withheld (the request computes its prefix, ``layerwise_hits_withheld``); after a cool-down the next hits are
offered again (half-open) and the next outcome closes it or opens it for twice as long. So a store that stays
slow costs at most one stalled step per cool-down, each at most ``LAYERWISE_WAIT_S``
(``layerwise_wait_seconds`` counts what the engine thread waited, ``layerwise_abandoned_steps`` the steps).

Safety with vLLM 0.32 (``Scheduler._handle_invalid_blocks``, policy ``recompute``): a request with an
invalid block among its computed blocks has ``num_computed_tokens`` truncated to that block's first token
and is skipped in ``update_from_output`` (no token is appended for it in that step), then recomputes. Only
models with one KV cache group take this path (``HybridStoreConnector`` refuses layerwise mode otherwise).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import structlog
import torch
from hybridkv.connector.datapath.movers import BlockMover, Fence
from hybridkv.connector.log_events import ConnectorLogEvent
from hybridkv.connector.metadata import HybridStoreMetadata, LoadJob, LoadResult
from hybridkv.connector.outcomes import load_outcome
from hybridkv.connector.stats import StatsBox
from hybridkv.connector.worker.cpus import WorkerCpus
from hybridkv.lifecycle.keys import KeyScheme
from hybridkv.lifecycle.load import LoadOutcome
from hybridkv.store.base import Status, Store, collect_late_calls

log = structlog.get_logger(__name__)

#: The longest the engine waits for one step's layer-wise loads (summed over its waits). Past it, the
#: step's jobs are abandoned: reported as load errors (vLLM recomputes), and nothing more is written.
LAYERWISE_WAIT_S = 5.0
#: The most host buffer bytes kept per group between steps (reused: no allocation and page faults per load).
_MAX_SPARE_BYTES = 256 << 20


@dataclass(frozen=True)
class LayerTensors:
    """One layer of a store group: its name (as vLLM passes it to ``wait_for_layer_load``) and the indices
    of its tensors in the group's :class:`BlockMover` (a list-of-tensors layer has several)."""

    name: str
    tensor_indices: tuple[int, ...]


@dataclass
class _Step:
    """One engine step's layer-wise loads."""

    #: the step's connector metadata (``wait_for_save`` gets the same object)
    meta: HybridStoreMetadata
    scheme: KeyScheme
    jobs: list[LoadJob]
    fence: Fence
    #: layer name -> set once that layer's pages of every job of the step are written (or will never be)
    layer_ready: dict[str, threading.Event]
    deadline: float
    done: threading.Event = field(default_factory=threading.Event)
    #: guards ``abandoned`` against a layer write in progress
    lock: threading.Lock = field(default_factory=threading.Lock)
    abandoned: bool = False
    #: results of an earlier unreported step, reported with this one
    carried_results: dict[str, list[LoadResult]] = field(default_factory=dict)
    #: layers the forward waited for
    waited: set[str] = field(default_factory=set)
    #: request id -> its entries' outcomes (set by the load thread)
    results: dict[str, list[LoadResult]] = field(default_factory=dict)
    ended: bool = False
    #: the verdict went to vLLM (``end_step``)
    reported: bool = False
    failed_block_ids: set[int] = field(default_factory=set)
    #: seconds the engine thread waited for this step's loads (``wait_for_layer`` and the step's end)
    wait_s: float = 0.0


class LayerwiseLoads:
    """The worker's layer-wise load pipeline (one background thread). Engine-thread methods:
    :meth:`start`, :meth:`wait_for_layer`, :meth:`saves_allowed`, :meth:`end_step`."""

    def __init__(
        self,
        *,
        store: Store,
        stats: StatsBox,
        tp_rank: Callable[[], int],
        cpus: WorkerCpus,
        on_late_calls: Callable[[list[Future[object]], Callable[[], None]], None],
    ) -> None:
        self._store = store
        self._stats = stats
        self._tp_rank = tp_rank
        self._on_late_calls = on_late_calls
        self._movers: dict[int, BlockMover] = {}
        self._layers: dict[int, list[LayerTensors]] = {}
        self._step: _Step | None = None
        self._cv = threading.Condition()
        self._queue: list[_Step | None] = []
        self._thread = threading.Thread(
            target=cpus.run_pinned(self._loop), name="hybridkv-layerwise-load", daemon=True
        )
        self._thread.start()
        self._copy_stream: torch.cuda.Stream | None = None
        #: load thread only: per group, the last step's host buffers (one per layer tensor), for reuse
        self._spare: dict[int, list[torch.Tensor]] = {}
        #: steps whose jobs were reported failed because a loaded layer was never waited for
        self.num_unwaited_steps = 0

    def register(self, movers: dict[int, BlockMover], layers: dict[int, list[LayerTensors]]) -> None:
        """The groups' movers and, per group, its layers in layer order (``register_kv_caches``)."""
        for group_index, mover in movers.items():
            covered = sorted(i for layer in layers[group_index] for i in layer.tensor_indices)
            assert covered == list(range(len(mover.tensors))), (
                f"group {group_index}: layers name tensors {covered}, the mover has {len(mover.tensors)}"
            )
        self._movers, self._layers = movers, layers
        if any(m.device.type == "cuda" for m in movers.values()):
            device = next(iter(movers.values())).device
            self._copy_stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    # ------------------------------------------------------------------ engine thread
    def start(self, meta: HybridStoreMetadata, fence: Fence, *, write: bool = True) -> None:
        """``start_load_kv``: start this step's loads in the background; returns at once. ``write=False``
        (the KV cache memory is released): the step's jobs fail without touching it."""
        carried: tuple[set[int], dict[str, list[LoadResult]]] = (set(), {})
        if self._step is not None and not self._step.reported:
            # Loads started outside an engine step (never expected): their verdict goes out with this one.
            carried = self.end_step()
        jobs = list(meta.loads)
        layer_ready = {
            layer.name: threading.Event()
            for group_index in sorted({ref.group_index for job in jobs for ref in job.blocks})
            for layer in self._layers[group_index]
        }
        step = _Step(meta, meta.scheme, jobs, fence, layer_ready, time.monotonic() + LAYERWISE_WAIT_S)
        step.failed_block_ids, step.carried_results = carried
        self._step = step
        if not write:
            step.abandoned = True
            for ready in layer_ready.values():
                ready.set()
            step.done.set()
            return
        with self._cv:
            self._queue.append(step)
            self._cv.notify()

    def wait_for_layer(self, layer_name: str) -> None:
        """``wait_for_layer_load``: block until ``layer_name``'s pages of the step's loads are written (or
        the step's wait budget is spent: then the step is abandoned after the forward)."""
        step = self._step
        if step is None or step.ended or step.abandoned:
            return
        ready = step.layer_ready.get(layer_name)
        if ready is None:
            return  # no load this step writes this layer
        step.waited.add(layer_name)
        if ready.is_set():
            return
        started = time.monotonic()
        ready.wait(max(0.0, step.deadline - started))
        step.wait_s += time.monotonic() - started

    def saves_allowed(self, meta: HybridStoreMetadata) -> bool:
        """``wait_for_save``: whether the saves of the step of ``meta`` may go to the store -- not when a
        load of that step failed (its forward computed on the failed pages)."""
        step = self._step
        if step is None or step.meta is not meta:
            return True  # no layer-wise load in that step
        return not self._finish_step(step)

    def _finish_step(self, step: _Step) -> bool:
        """Wait for the step's loads (within its wait budget; else abandon them) and settle its verdict.
        Idempotent. True when some job of the step failed."""
        if step.ended:
            return bool(step.failed_block_ids)
        started = time.monotonic()
        finished = step.done.wait(max(0.0, step.deadline - started))
        step.wait_s += time.monotonic() - started
        # What the engine thread (every request of the step) waited for this step's loads: at most the budget.
        self._stats.add("layerwise_wait_seconds", step.wait_s)
        if not finished:
            with step.lock:
                step.abandoned = True  # no layer write starts after this
            self._stats.add("layerwise_abandoned_steps")
            log.warning(ConnectorLogEvent.LAYERWISE_OVER_BUDGET, seconds=LAYERWISE_WAIT_S)
        unwaited = [name for name in step.layer_ready if name not in step.waited]
        if unwaited and not step.abandoned:
            # Some attention layer ran without waiting (a model path that bypasses vLLM's per-layer hook):
            # its attention may have read pages before they were written.
            self.num_unwaited_steps += 1
            self._stats.add("layerwise_unwaited_steps")
            log.warning(ConnectorLogEvent.LAYERWISE_UNWAITED, layers=unwaited[:4])
        rank = self._tp_rank()
        for job in step.jobs:
            results = None if step.abandoned else step.results.get(job.req_id)
            failed = (
                results is None
                or bool(unwaited)
                or not job.blocks
                or any(r.outcome is not LoadOutcome.OK for r in results)
            )
            if not failed:
                continue
            step.failed_block_ids.update(ref.block_id for ref in job.blocks)
            step.failed_block_ids.update(job.declined_block_ids)
            if job.blocks and (results is None or all(r.outcome is LoadOutcome.OK for r in results)):
                # Abandoned, raised, or a layer read before it was written: the entries are not at fault
                # (transient), they stay in the store.
                outcome = LoadOutcome.TIMEOUT if step.abandoned else LoadOutcome.TRANSPORT_ERROR
                step.results[job.req_id] = [LoadResult(ref.entry(rank), outcome) for ref in job.blocks]
        step.failed_block_ids.discard(0)  # the null block is never allocated to a request
        step.ended = True
        return bool(step.failed_block_ids)

    def end_step(self) -> tuple[set[int], dict[str, list[LoadResult]]]:
        """``get_block_ids_with_load_errors``: (block ids to report as load errors, each job's results)."""
        step = self._step
        if step is None or step.reported:
            return set(), {}
        self._finish_step(step)
        step.reported = True
        results = dict(step.carried_results)
        for job in step.jobs:
            if job.blocks:
                results.setdefault(job.req_id, []).extend(step.results.get(job.req_id, []))
        return set(step.failed_block_ids), results

    def close(self) -> None:
        with self._cv:
            self._queue.append(None)
            self._cv.notify()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ load thread
    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._queue))
                step = self._queue.pop(0)
            if step is None:
                return
            started = time.perf_counter()
            try:
                self._run(step)
            except Exception as exc:  # noqa: BLE001 -- a store bug must not kill the engine: the step recomputes
                log.warning(ConnectorLogEvent.LAYERWISE_LOAD_RAISED, error=repr(exc))
            finally:
                for ready in step.layer_ready.values():
                    ready.set()
                self._stats.add("load_job_seconds", time.perf_counter() - started)
                step.done.set()

    def _run(self, step: _Step) -> None:
        rank = self._tp_rank()
        results = {
            job.req_id: [LoadResult(ref.entry(rank), LoadOutcome.NOT_ATTEMPTED) for ref in job.blocks]
            for job in step.jobs
            if job.blocks
        }
        for group_index in sorted({ref.group_index for job in step.jobs for ref in job.blocks}):
            self._run_group(step, group_index, rank, results)
        with step.lock:
            if not step.abandoned:  # else the engine thread already judged the step (every job failed)
                step.results = results

    def _run_group(
        self, step: _Step, group_index: int, rank: int, results: dict[str, list[LoadResult]]
    ) -> None:
        mover = self._movers[group_index]
        # (job, position in job.blocks) of every block of this group, in job order
        where = [
            (job, i)
            for job in step.jobs
            for i, ref in enumerate(job.blocks)
            if ref.group_index == group_index
        ]
        refs = [job.blocks[i] for job, i in where]
        keys = [step.scheme.key(group_index, rank, ref.block_hash) for ref in refs]
        # Layer-major host buffers: buffers[k][row] is block ``refs[row]``'s page of tensor k.
        whole = self._spare.pop(group_index, None)
        if whole is None or whole[0].shape[0] < len(refs):
            pin = mover.device.type == "cuda"
            whole = [
                torch.empty((len(refs), nbytes), dtype=torch.uint8, pin_memory=pin)
                for nbytes in mover.page_nbytes
            ]
        buffers = [b[: len(refs)] for b in whole]
        arrays = [b.numpy() for b in buffers]
        destinations = [[a[row] for a in arrays] for row in range(len(refs))]
        statuses: list[Status]
        with collect_late_calls() as late:
            try:
                statuses = self._store.get_into(keys, destinations)
            except Exception as exc:  # noqa: BLE001 -- a store failure fails these jobs, never the engine
                log.warning(ConnectorLogEvent.LAYERWISE_GET_RAISED, error=repr(exc))
                statuses = [Status.TRANSFER_FAILED] * len(refs)
        if late:
            # The call still writes ``buffers``: keep them alive until it returned; never commit them.
            self._on_late_calls(list(late), buffers.clear)
        for (job, i), ref, status in zip(where, refs, statuses, strict=True):
            results[job.req_id][i] = LoadResult(ref.entry(rank), load_outcome(status))
            if status is not Status.OK:
                self._stats.add("load_failed_keys")
        self._stats.add("load_keys", len(keys))
        if late:
            return  # the buffers go with the late call (never reused)
        if sum(b.numel() for b in whole) <= _MAX_SPARE_BYTES:
            self._spare[group_index] = (
                whole  # free again once this group's commit below returned (same thread)
            )
        ok_jobs = {
            job.req_id
            for job in step.jobs
            if all(r.outcome is LoadOutcome.OK for r in results.get(job.req_id, []))
        }
        rows = [row for row, (job, _) in enumerate(where) if job.req_id in ok_jobs]
        if not rows:
            return
        self._commit_layers(step, group_index, mover, [refs[row].block_id for row in rows], rows, buffers)
        self._stats.add("load_bytes", len(rows) * mover.block_nbytes)

    def _commit_layers(
        self,
        step: _Step,
        group_index: int,
        mover: BlockMover,
        block_ids: list[int],
        rows: list[int],
        buffers: list[torch.Tensor],
    ) -> None:
        """Write ``rows`` of ``buffers`` into ``block_ids``, one layer at a time in layer order, marking
        each layer ready once written. Stops (writing nothing more) once the step is abandoned."""
        device = mover.device
        all_rows = len(rows) == buffers[0].shape[0]
        index = torch.tensor(block_ids, dtype=torch.long)
        stream = self._copy_stream
        if device.type == "cuda":
            assert stream is not None
            index = index.to(device)
            if step.fence is not None:
                stream.wait_event(step.fence)  # after whatever the compute stream queued for these blocks
        for layer in self._layers[group_index]:
            with step.lock:
                if step.abandoned:
                    return
                for k in layer.tensor_indices:
                    self._write_pages(mover.tensors[k], index, buffers[k], rows, all_rows, stream)
            step.layer_ready[layer.name].set()

    @staticmethod
    def _write_pages(
        dst: torch.Tensor,
        index: torch.Tensor,
        buffer: torch.Tensor,
        rows: Sequence[int],
        all_rows: bool,
        stream: torch.cuda.Stream | None,
    ) -> None:
        src = buffer if all_rows else buffer[torch.tensor(list(rows), dtype=torch.long)]
        src = src.view(dst.dtype).view(len(rows), *dst.shape[1:])
        if stream is None:
            dst.index_copy_(0, index, src)
            return
        with torch.cuda.stream(stream):
            dst.index_copy_(0, index, src.to(dst.device, non_blocking=True))
        stream.synchronize()  # the layer is ready only once its pages are on the device
