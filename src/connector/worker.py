"""The worker half of ``HybridStoreConnector``: block bytes in and out of the store, off the forward path.

Contracts:

- ``register_kv_caches`` learns, per group, each layer's per-block page (attention pages, raw Mamba state
  pages, or a list of tensors per layer sharing one storage) and builds one
  :class:`~hybridkv.connector.datapath.BlockMover` per group. A group block's value is the concatenation of
  that block's bytes across the group's layers, in the group's layer order, passed to the store as per-layer
  parts. Host (CPU) caches: the parts are the pages themselves (zero copies for contiguous pages, one
  staging copy otherwise). CUDA caches: batches go through a bounded pool of pinned host slabs
  (``_STAGING_SLABS`` slabs of about one PUT wave each) on side streams; see ``datapath``.
- Loads run on a thread. Every load job this rank receives is reported in ``finished_recving`` once done;
  a job with any non-OK block is also in ``failed_recving`` (request-level, safe for hybrid models).
  ``get_block_ids_with_load_errors`` is always empty. In ``load_mode: layerwise`` loads are instead
  synchronous to the step that uses them (see :mod:`hybridkv.connector.layerwise`): never in
  ``finished_recving``; every block of a failed job is in ``get_block_ids_with_load_errors`` of that step.
- Saves are enqueued in ``wait_for_save`` (on CPU the forward already finished, so the bytes are final; on
  CUDA a fence event is recorded on the compute stream there, and the save thread's device->host copies
  wait on it; the scheduler pins the source blocks until every rank reports the job). One kind of block
  is not final there: a full-attention *tail* saved under a boundary inside it (the key boundary is not a
  multiple of the group's span), which the next steps keep appending to. On the host path it is copied in
  ``wait_for_save`` (one page per group per such save) and the store gets that copy, so the checksum and
  the stored bytes are one consistent snapshot; on CUDA the staging slab is that copy already. They go out in PUT
  waves of at most ``put_wave_bytes`` (CUDA: also one group and one staging slab per wave); at most
  ``_MAX_WAVES_IN_FLIGHT`` waves' bytes are queued per rank, beyond that a job is dropped and counted (a
  slow or full store never stalls the engine). ``NO_SPACE`` drops the wave; so does a staging pool that
  stays exhausted for ``_SAVE_STAGING_WAIT_S`` (counted as ``put_wave_drops``).
- Loads (CUDA): store -> pinned slab -> device blocks, in batches of at most one slab; the host->device
  copies wait on a fence recorded in ``start_load_kv`` and have completed before the job is reported.
- Buffer ownership: a KV page range, private host buffer or staging slab handed to a store call belongs to
  that call until it has really returned, even when the call raised. A call that answered ``TIMEOUT`` but
  goes on (``hybridkv.store.base.collect_late_calls``; a split read collects every share's, the raising
  share's included) keeps its buffers quarantined: a slab goes back to the pool, a private buffer is
  dropped, only when every call that touched it returned. So that a late call never owns KV memory, a
  transfer whose store may answer late (:func:`_may_answer_late`: Mooncake, ``file://`` on a network or
  FUSE file system, ``faulty+`` with ``get_late`` / ``put_late``, any store the worker does not know) never
  hands it the pages: CUDA goes through its slabs anyway; on the host path a load reads into a private
  buffer and copies the OK blocks into the pages only once every call of the batch returned, and a save
  hands the store a private copy taken before the call. The job is then reported at once (a load failed, a
  save with its outcomes), so a late call that never returns holds no request, no pinned block and no
  in-flight budget; at most ``_MAX_QUARANTINED_BATCHES`` host batches stay quarantined, beyond that a load
  fails at once (``NOT_ATTEMPTED``) and a save wave is dropped rather than allocating more. Only where the
  store cannot answer late (memory, file on a local file system) does the host path hand the pages
  themselves to the call (zero copies); if such a store answers late anyway, the job is reported only once
  the call returned (vLLM keeps a request's blocks while it waits for its load; the scheduler's pins hold
  a save's source blocks), and ``flush`` and ``suspend`` wait for that call, within their timeout.
"""

from __future__ import annotations

import functools
import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np
import structlog
import torch
from hybridkv.connector.config import AUTO_KERNEL_MAX_BATCH_BYTES, CUDA_COPY_DIRECTIONS, ConnectorConfig
from hybridkv.connector.datapath import BlockMover, Fence, PinnedPool, StagedBlocks, StagingContext
from hybridkv.connector.layerwise import LayerTensors, LayerwiseLoads
from hybridkv.connector.log_events import ConnectorLogEvent
from hybridkv.connector.metadata import (
    BlockRef,
    HybridStoreMetadata,
    HybridStoreWorkerMetadata,
    LoadJob,
    LoadResult,
    SaveJob,
    SaveOutcome,
    SaveResult,
)
from hybridkv.connector.stats import StatsBox
from hybridkv.connector.stores import open_connector_store
from hybridkv.connector.vllm_geometry import ConnectorGeometry, resolve_geometry
from hybridkv.lifecycle.keys import KeyScheme
from hybridkv.lifecycle.kinds import KIND_RULES
from hybridkv.lifecycle.load import LoadOutcome
from hybridkv.store.base import Status, Value, collect_late_calls

log = structlog.get_logger(__name__)

T = TypeVar("T")

_MAX_WAVES_IN_FLIGHT = 4
#: Longest pause of one engine step waiting for an in-flight load (see ``WorkerSide.transfer_results``).
_LOAD_YIELD_S = 0.005
#: CUDA: pinned host slabs per worker (one save wave + one load batch in flight, one spare).
_STAGING_SLABS = 3
#: CUDA: how long the save thread waits for a free slab before dropping the wave (off the engine's path).
_SAVE_STAGING_WAIT_S = 0.5
#: CUDA: how long the load thread waits for a free slab before failing the job (the request recomputes).
_LOAD_STAGING_WAIT_S = 5.0
#: Threads that read one load batch from the store: the load thread and ``_LOAD_READERS - 1`` helpers, each
#: reading (and verifying) its own contiguous share of the keys. One thread reads a file-store hit at about
#: half of memcpy speed (the kernel's copy out of tmpfs pages) and then checksums it; two threads overlap
#: one key's checksum with another key's read and use a second core (measured on the 2-core dev VM, 65 MB
#: in 31 keys: 18 -> 12.6 ms with the second core idle; 20.9 -> 20.3 ms inside an engine while another job
#: held about one core).
_LOAD_READERS = 2
#: A batch smaller than this is read by the load thread alone (the hand-off costs more than it saves).
_SPLIT_READ_MIN_BYTES = 4 << 20
#: Host path: private load/save batches a late store call may keep at once (see "Buffer ownership").
_MAX_QUARANTINED_BATCHES = 8
#: ``shutdown``: the least time given to closing the store, even once its budget is spent.
_CLOSE_STORE_MIN_S = 1.0
#: The phases of :attr:`WorkerSide.load_timings` (seconds, summed over load jobs), in time order.
LOAD_PHASES = ("queue_s", "targets_s", "store_s", "commit_s", "report_s")
#: The engine thread's side of :attr:`WorkerSide.load_timings` while loads are in flight.
ENGINE_PHASES = ("engine_steps", "engine_busy_s")


@dataclass
class _LateOwnership:
    """What store calls that answered before returning still own: their completion handles and the batches
    (slabs, private buffers, or KV pages) they read or write. Nothing here is reused until every call in
    ``calls`` is done. ``owns_kv_pages``: some batch is the KV pages themselves (a direct-path batch of a
    store that was not expected to answer late), so the job may be reported only once the calls returned."""

    calls: list[Future[object]] = field(default_factory=list)
    batches: list[StagedBlocks] = field(default_factory=list)
    owns_kv_pages: bool = False

    def take(self, late: list[Future[object]], batches: list[StagedBlocks], *, kv_pages: bool) -> None:
        self.calls.extend(late)
        self.batches.extend(batches)
        self.owns_kv_pages = self.owns_kv_pages or kv_pages


class _Readers:
    """The helper threads of split reads (``submit`` returns the call's future).

    Daemon threads: a store call that never returns must not hold up shutdown or interpreter exit (a
    ``ThreadPoolExecutor``'s workers are joined at exit)."""

    def __init__(self, num_threads: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(num_threads)
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


def _may_answer_late(store: object, op: str) -> bool:
    """Whether a ``op`` call ("get" or "put") of ``store`` may answer ``TIMEOUT`` while it goes on using
    its buffers (see "Buffer ownership").

    The store says (``answers_late``, which every backend of ``open_store`` declares: memory never; file
    where its directory is on a file system that may hang, or with ``timeout_ms``; Mooncake always;
    ``faulty+`` with ``get_late`` / ``put_late`` or where its inner backend does). Any other store object is
    assumed to answer late: it gets private buffers, never KV pages.
    """
    assert op in ("get", "put"), f"_may_answer_late: unknown op {op!r}"
    # Looked up on the class, not the instance: a wrapper that forwards unknown attributes to a store
    # (``__getattr__``) would otherwise answer for that store, while its own calls may answer late.
    if not callable(getattr(type(store), "answers_late", None)):
        return True
    return bool(store.answers_late(op))  # type: ignore[attr-defined]


class _Outbox:
    """What this rank still has to report to the scheduler: finished loads (for ``finished_recving`` /
    ``failed_recving``) and the per-entry results and finished save jobs (for the worker metadata).

    Filled by the transfer threads, emptied by the engine thread; ``WorkerSide``'s lock guards it. A
    load's results go out in the worker metadata of the step that reported the load finished, never
    before: the scheduler judges a load only once vLLM knows it finished.
    """

    def __init__(self) -> None:
        #: request id -> whether its load succeeded, for loads not yet reported as finished
        self._finished_loads: dict[str, bool] = {}
        #: the results of those loads, held back until they are reported
        self._held_load_results: dict[str, list[LoadResult]] = {}
        self._load_results: dict[str, list[LoadResult]] = {}
        self._save_results: dict[int, list[SaveResult]] = {}
        self._finished_saves: list[int] = []

    @property
    def has_finished_loads(self) -> bool:
        return bool(self._finished_loads)

    def load_judged(self, results: dict[str, list[LoadResult]]) -> None:
        """Layer-wise loads: vLLM learns their fate in this step's output, so their results go out now."""
        for req_id, load_results in results.items():
            self._load_results.setdefault(req_id, []).extend(load_results)

    def load_finished(self, req_id: str, ok: bool, results: list[LoadResult]) -> None:
        self._finished_loads[req_id] = ok
        self._held_load_results[req_id] = results

    def save_finished(self, job_id: int, results: list[SaveResult]) -> None:
        self._save_results.setdefault(job_id, []).extend(results)
        self._finished_saves.append(job_id)

    def take_finished_loads(self) -> tuple[set[str], set[str]]:
        """(finished, failed) request ids since the last call; their results join the next metadata."""
        done, self._finished_loads = self._finished_loads, {}
        for req_id, results in self._held_load_results.items():
            self._load_results.setdefault(req_id, []).extend(results)
        self._held_load_results = {}
        return set(done), {req_id for req_id, ok in done.items() if not ok}

    def take_metadata(self, tp_rank: int) -> HybridStoreWorkerMetadata | None:
        """Everything reportable since the last call, or None when there is nothing."""
        meta = HybridStoreWorkerMetadata(
            loads=self._load_results,
            saves=self._save_results,
            saves_done={job_id: [tp_rank] for job_id in self._finished_saves},
        )
        self._load_results, self._save_results, self._finished_saves = {}, {}, []
        return None if meta.is_empty() else meta


def _as_store_buffers(parts: list[list[np.ndarray]]) -> list[Value]:
    """Per-block numpy parts as store values. numpy arrays are buffers; its stubs declare the buffer
    protocol only for Python >= 3.12, hence the cast."""
    return cast("list[Value]", parts)


def _ranks(tp_size: int, dcp_size: int) -> tuple[int, int]:
    """This worker's (TP rank, DCP rank) from vLLM's parallel state, for a deployment of ``tp_size`` x
    ``dcp_size`` (from the vLLM config).

    No distributed environment at all (vLLM's world group not initialized): this process is not a worker
    of a distributed engine -- a single-process engine, a tool, or a test harness that sets the ranks
    itself -- so (0, 0). Every vLLM worker initializes the world group and the model-parallel groups before
    it registers its KV caches; once it has, a rank that cannot be read (an API that changed, a group that
    is missing, a group size that is not the configured one) raises RuntimeError naming what could not be
    read: a wrong rank would load and save other ranks' entries.
    """
    try:
        from vllm.distributed import parallel_state
    except ImportError as exc:
        raise RuntimeError(
            f"hybridkv: cannot import vllm.distributed.parallel_state to read the TP rank: {exc}"
        ) from exc
    if getattr(parallel_state, "_WORLD", None) is None:
        return 0, 0
    try:
        tp_group = parallel_state.get_tp_group()
        tp, tp_world = int(tp_group.rank_in_group), int(tp_group.world_size)
    except Exception as exc:
        raise RuntimeError(
            f"hybridkv: cannot read this worker's tensor-parallel rank from vLLM's parallel state "
            f"(vllm.distributed.parallel_state.get_tp_group().rank_in_group): {exc!r}"
        ) from exc
    if tp_world != tp_size:
        raise RuntimeError(
            f"hybridkv: vLLM's tensor-parallel group has {tp_world} ranks, the config says {tp_size}"
        )
    if dcp_size == 1:
        return tp, 0
    try:
        dcp = int(parallel_state.get_dcp_group().rank_in_group)
    except Exception as exc:
        raise RuntimeError(
            f"hybridkv: cannot read this worker's decode-context-parallel rank (dcp size {dcp_size}) from "
            f"vLLM's parallel state (vllm.distributed.parallel_state.get_dcp_group().rank_in_group): {exc!r}"
        ) from exc
    return tp, dcp


def _kernel_directions(cuda_copy: str) -> frozenset[str]:
    """The directions ``cuda_copy`` routes through the copy kernel, none when Triton is missing under
    ``auto``. Raises ValueError naming the key when ``kernel`` was asked for and Triton is missing."""
    directions = CUDA_COPY_DIRECTIONS[cuda_copy]
    if directions:
        try:
            import hybridkv.connector.copy_kernels  # noqa: F401 -- Triton present?
        except ImportError as exc:
            if cuda_copy == "kernel":
                raise ValueError(
                    f"kv_connector_extra_config['cuda_copy']: {cuda_copy!r} needs Triton, which cannot be "
                    f"imported ({exc}); use 'dma' or 'auto'"
                ) from exc
            log.warning(ConnectorLogEvent.COPY_KERNEL_UNAVAILABLE, cuda_copy=cuda_copy, error=str(exc))
            return frozenset()
    return directions


class WorkerSide:
    """Worker-role state. One per worker process (TP rank)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig) -> None:
        self.cfg = cfg
        # Layer names and group order only: keys come from the scheduler's KeyScheme in the metadata.
        self.geo: ConnectorGeometry = resolve_geometry(
            vllm_config, kv_cache_config, cfg.namespace, check_vllm_sizes=False
        )
        self.store = open_connector_store(cfg)
        self.stats = StatsBox()
        self.tp_rank, self.dcp_rank = 0, 0
        self._movers: dict[int, BlockMover] = {}  # sgid -> the group's block mover
        self._staging: StagingContext | None = None  # CUDA caches only
        self._lock = threading.Lock()
        # Signalled when a load finishes; ``transfer_results`` waits on it briefly (see there).
        self._load_finished = threading.Condition(self._lock)
        self._num_loads_in_flight = 0
        self._outbox = _Outbox()  # guarded by _lock
        self._inflight_bytes = 0
        # Jobs whose report waits for late store calls that own KV pages, and batches (of any job) that late
        # calls still own (see "Buffer ownership"); signalled on the lock when a late call returns.
        self._num_late_jobs = 0
        self._num_quarantined_batches = 0
        self._late_returned = threading.Condition(self._lock)
        #: host batches refused (load failed, save wave dropped) because too many were quarantined
        self.num_quarantine_refusals = 0
        #: store calls that answered before returning and kept their buffers quarantined (tests, debugging)
        self.num_late_store_calls = 0
        #: open full-attention tails copied in ``wait_for_save`` (host path)
        self.num_tail_snapshots = 0
        # Items: (scheme, job, fence, enqueued at perf_counter) to run, a threading.Event to set once every
        # load before it finished, or None to stop.
        self._load_q: queue.Queue[tuple[KeyScheme, LoadJob, Fence, float] | threading.Event | None] = (
            queue.Queue()
        )
        self._readers = _Readers(_LOAD_READERS - 1, "hybridkv-read")
        #: Where async load jobs spend their time (seconds summed over jobs, guarded by ``_lock``; the bench's
        #: hit profile): ``jobs``; ``queue_s`` from ``start_load`` to the load thread taking the job;
        #: ``targets_s`` building the destinations; ``store_s`` inside the store's ``get_into`` (read +
        #: verify); ``commit_s`` moving staged bytes into the pages; ``report_s`` from the job's end to the
        #: engine thread taking it in ``transfer_results``; ``engine_steps`` the engine's calls of
        #: ``transfer_results`` while loads were in flight, ``engine_busy_s`` its time between them (the
        #: engine thread's own step work, which holds the GIL the load threads need between system calls).
        self.load_timings: dict[str, float] = dict.fromkeys(("jobs", *LOAD_PHASES, *ENGINE_PHASES), 0.0)
        # perf_counter when ``transfer_results`` last returned with loads in flight, else None
        self._engine_back_at: float | None = None
        # request id -> perf_counter when its load finished, until ``transfer_results`` reports it
        self._load_finished_at: dict[str, float] = {}
        self._suspended = False  # sleep mode: the KV cache memory is released
        # Items: (scheme, job, bytes, fence, snapshots) to write, a threading.Event to set once everything
        # before it is written (flush), or None to stop. ``snapshots``: position in ``job.blocks`` -> parts
        # copied in ``wait_for_save`` (open tails, host path), used instead of the live pages.
        self._save_q: queue.Queue[
            tuple[KeyScheme, SaveJob, int, Fence, dict[int, list[np.ndarray]]] | threading.Event | None
        ] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._load_loop, name="hybridkv-load", daemon=True),
            threading.Thread(target=self._save_loop, name="hybridkv-save", daemon=True),
        ]
        for th in self._threads:
            th.start()
        self._layerwise: LayerwiseLoads | None = None
        if cfg.layerwise:
            self._layerwise = LayerwiseLoads(
                store=self.store,
                stats=self.stats,
                tp_rank=lambda: self.tp_rank,
                # Layer-wise loads read into private buffers: a late call holds no report.
                on_late_calls=lambda late, then: self._after_late_calls(_LateOwnership(calls=late), then),
            )

    # ------------------------------------------------------------------ layout
    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor | Sequence[torch.Tensor]],
        *,
        staging: StagingContext | None = None,
    ) -> None:
        """Bind the engine's KV tensors (vLLM's ``register_kv_caches``).

        ``staging``: route every transfer through these slabs (the staged path CUDA caches take) even
        for host caches; None: CUDA caches get pinned slabs sized from ``put_wave_bytes``, host caches
        are read and written in place.
        """
        topology = self.geo.geometry.topology
        self.tp_rank, self.dcp_rank = _ranks(topology.tp_size, topology.dcp_size)
        dcp = topology.dcp_size
        assert self.tp_rank % dcp == self.dcp_rank, (
            f"dcp rank {self.dcp_rank} != tp rank {self.tp_rank} % dcp {dcp}"
        )
        per_group: dict[int, list[list[torch.Tensor]]] = {}
        devices: set[torch.device] = set()
        for g in self.geo.groups:
            per_layer: list[list[torch.Tensor]] = []
            for name in g.layer_names:
                assert name in kv_caches, f"group {g.gid}: layer {name!r} has no registered KV cache"
                t = kv_caches[name]
                tensors: list[torch.Tensor] = list(t) if isinstance(t, (list, tuple)) else [t]  # type: ignore[list-item]
                for x in tensors:
                    assert x.device.type in ("cpu", "cuda"), (
                        f"layer {name!r}: HybridStoreConnector needs host or CUDA KV, got {x.device}"
                    )
                    devices.add(x.device)
                per_layer.append(tensors)
            per_group[g.sgid] = per_layer
        assert len(devices) <= 1, f"KV caches on several devices: {sorted(map(str, devices))}"
        device = next(iter(devices)) if devices else torch.device("cpu")
        if staging is not None:
            self._staging = staging
        elif device.type == "cuda":
            block_max = max(
                sum(int(x[0].numel()) * x.element_size() for layer in pl for x in layer)
                for pl in per_group.values()
            )
            n_tensors = max(sum(len(layer) for layer in pl) for pl in per_group.values())
            # One slab holds one PUT wave (a wave ends at the first block that reaches put_wave_bytes).
            slab = self.cfg.put_wave_bytes + block_max + 256 * n_tensors
            self._staging = StagingContext(
                device,
                PinnedPool(slab, _STAGING_SLABS * slab, pin=True),
                kernel_directions=_kernel_directions(self.cfg.cuda_copy),
                kernel_max_batch_bytes=AUTO_KERNEL_MAX_BATCH_BYTES if self.cfg.cuda_copy == "auto" else None,
            )
            # Pin one slab now: page-locking it took ~0.1 s (128 MiB, H200 host), which the first transfer
            # would otherwise wait for -- on a load, the first hit.
            pinned_slab = self._staging.pool.acquire()
            assert pinned_slab is not None, "a fresh staging pool has a slab to give"
            self._staging.pool.release(pinned_slab)
        self._movers = {sgid: BlockMover(pl, staging=self._staging) for sgid, pl in per_group.items()}
        if self._layerwise is not None:
            layers: dict[int, list[LayerTensors]] = {}
            for g in self.geo.groups:
                first = 0
                layers[g.sgid] = []
                for name, tensors in zip(g.layer_names, per_group[g.sgid], strict=True):
                    layers[g.sgid].append(LayerTensors(name, tuple(range(first, first + len(tensors)))))
                    first += len(tensors)
            self._layerwise.register(self._movers, layers)
        log.info(
            ConnectorLogEvent.WORKER_GEOMETRY,
            tp_rank=self.tp_rank,
            dcp_rank=self.dcp_rank,
            store=self.store.url,
            device=str(device),
            staging_bytes=self._staging.pool.budget_bytes if self._staging is not None else 0,
            copy_kernel={
                sgid: sorted(m.kernel_directions) or m.kernel_unsupported
                for sgid, m in self._movers.items()
                if m.is_staged
            },
            block_bytes={g.sgid: self.block_nbytes(g.sgid) for g in self.geo.groups},
            **self.geo.describe(),
        )

    def _load_results(self, job: LoadJob, outcome: LoadOutcome) -> list[LoadResult]:
        return [LoadResult(ref.entry(self.tp_rank), outcome) for ref in job.blocks]

    def _save_results(self, job: SaveJob, outcome: SaveOutcome) -> list[SaveResult]:
        return [SaveResult(ref.entry(self.tp_rank), outcome) for ref in job.blocks]

    def block_nbytes(self, sgid: int) -> int:
        """Bytes of one block of store group ``sgid`` (all its layers)."""
        return int(self._movers[sgid].block_nbytes)

    def group_tensors(self, sgid: int) -> list[torch.Tensor]:
        """The registered KV cache tensors of store group ``sgid``, in the group's layer order; index one
        with a block id for that block's page (inspection: tests and tools)."""
        return list(self._movers[sgid].tensors)

    def _fence(self) -> Fence:
        """CUDA: an event on the current (compute) stream; transfers queued after it wait for it."""
        return self._staging.fence() if self._staging is not None else None

    def _batches(self, refs: Sequence[BlockRef], positions: Sequence[int]) -> list[list[list[int]]]:
        """Rounds of per-group batches (positions into ``refs``) whose targets are held at once.

        Host caches: one round, one batch per group (no slabs, so no limit). CUDA: one batch per round,
        one group and at most one slab per batch.
        """
        by_group: dict[int, list[int]] = {}
        for i in positions:
            by_group.setdefault(refs[i].sgid, []).append(i)
        if self._staging is None:
            return [list(by_group.values())]
        rounds: list[list[list[int]]] = []
        for sgid, idxs in by_group.items():
            cap = self._movers[sgid].max_blocks
            rounds.extend([idxs[a : a + cap]] for a in range(0, len(idxs), cap))
        return rounds

    # ------------------------------------------------------------------ loads
    def start_load(self, meta: HybridStoreMetadata) -> None:
        if not meta.loads:
            return
        if self._layerwise is not None:
            # Asleep: the KV cache memory is released; the step's jobs fail without a write (recomputed).
            self.stats.add("layerwise_load_steps")
            self._layerwise.start(meta, self._fence(), write=not self._suspended)
            return
        if self._suspended:
            # The KV cache memory is released while the engine sleeps: never write into it. Every job is
            # reported failed, so vLLM recomputes those requests.
            for job in meta.loads:
                self._finish_load(
                    job, False, self._load_results(job, LoadOutcome.TRANSPORT_ERROR), queued=False
                )
            return
        fence = self._fence()
        with self._lock:
            self._num_loads_in_flight += len(meta.loads)
        now = time.perf_counter()
        for job in meta.loads:
            self._load_q.put((meta.scheme, job, fence, now))

    def wait_for_layer(self, layer_name: str) -> None:
        """Layer-wise mode: block until ``layer_name``'s pages of this step's loads are written."""
        if self._layerwise is not None:
            self._layerwise.wait_for_layer(layer_name)

    def end_layerwise_step(self) -> set[int]:
        """Layer-wise mode, after the forward: the step's load-error block ids (its results join the next
        worker metadata, which vLLM takes in this same step)."""
        if self._layerwise is None:
            return set()
        failed, results = self._layerwise.end_step()
        with self._lock:
            self._outbox.load_judged(results)
        return failed

    def _finish_load(self, job: LoadJob, ok: bool, results: list[LoadResult], *, queued: bool = True) -> None:
        with self._lock:
            self._outbox.load_finished(job.req_id, ok, results)
            if queued:
                self._load_finished_at[job.req_id] = time.perf_counter()
                self._num_loads_in_flight -= 1
            self._load_finished.notify_all()

    def suspend(self, timeout: float = 30.0) -> bool:
        """Sleep mode (vLLM 0.33 ``unregister_kv_caches``): finish every queued load and save and wait for
        every late store call to return, then refuse to touch the KV cache until ``resume``.

        Returns False when that did not happen within ``timeout``: some transfer may still read or write KV
        memory, so the caller must not release it (the worker is then left awake, as if never suspended).
        """
        self._suspended = True
        deadline = time.monotonic() + timeout
        loads_drained = threading.Event()
        self._load_q.put(loads_drained)
        drained = loads_drained.wait(timeout) and self.flush(max(0.0, deadline - time.monotonic()))
        if not drained:
            self._suspended = False
        return drained

    def resume(self) -> None:
        """Wake-up (vLLM 0.33 ``restore_kv_caches``): the KV cache is mapped again at the same addresses."""
        self._suspended = False

    def _load_loop(self) -> None:
        while (item := self._load_q.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
                continue
            scheme, job, fence, enqueued = item
            owned = _LateOwnership()
            started = time.perf_counter()
            self._add_load_timing("queue_s", started - enqueued)
            try:
                ok, results = self._load_job(scheme, job, fence, owned)
            except Exception as exc:  # noqa: BLE001 -- a store bug must not kill the engine: the request recomputes
                log.warning(ConnectorLogEvent.LOAD_RAISED, request_id=job.req_id, error=repr(exc))
                ok = False
                results = self._load_results(job, LoadOutcome.TRANSPORT_ERROR)
            self.stats.add("load_job_seconds", time.perf_counter() - started)
            self._add_load_timing("jobs", 1)
            if not owned.calls:
                self._finish_load(job, ok, results)
            elif owned.owns_kv_pages:
                # The late call writes the request's KV pages: report only once it returned, so vLLM cannot
                # free (and reuse) them before.
                self._after_late_calls(owned, functools.partial(self._finish_load, job, ok, results))
            else:
                # The late call writes only its slab or private buffer: the job is over for the KV pages,
                # its buffers are not.
                self._finish_load(job, ok, results)
                self._after_late_calls(owned, lambda: None)

    def _after_late_calls(self, owned: _LateOwnership, then: Callable[[], None]) -> None:
        """Once every call in ``owned`` really returned: release its batches, then run ``then``.

        Until then the batches count as quarantined, and a job that ``owns_kv_pages`` as waiting (see
        ``flush``)."""
        with self._lock:
            self.num_late_store_calls += len(owned.calls)
            self._num_quarantined_batches += len(owned.batches)
            if owned.owns_kv_pages:
                self._num_late_jobs += 1
        num_left = [len(owned.calls)]
        count_lock = threading.Lock()

        def returned(_call: Future[object]) -> None:
            with count_lock:
                num_left[0] -= 1
                if num_left[0]:
                    return
            for batch in owned.batches:
                batch.release()
            try:
                then()
            finally:
                with self._lock:
                    self._num_quarantined_batches -= len(owned.batches)
                    if owned.owns_kv_pages:
                        self._num_late_jobs -= 1
                    self._late_returned.notify_all()

        for call in owned.calls:
            call.add_done_callback(returned)

    def _wait_kv_late_calls(self, timeout: float) -> bool:
        """Wait until no job waits for a late store call that owns KV pages; False after ``timeout``."""
        with self._lock:
            return self._late_returned.wait_for(lambda: self._num_late_jobs == 0, timeout)

    def wait_late_calls(self, timeout: float) -> bool:
        """Wait until every late store call has returned and its quarantined buffers are released (tests,
        shutdown); False after ``timeout`` seconds."""
        with self._lock:
            return self._late_returned.wait_for(
                lambda: self._num_late_jobs == 0 and self._num_quarantined_batches == 0, timeout
            )

    def _quarantine_full(self) -> bool:
        """Host path: whether a new private batch must be refused (too many held by late calls)."""
        with self._lock:
            full = self._num_quarantined_batches >= _MAX_QUARANTINED_BATCHES
            if full:
                self.num_quarantine_refusals += 1
            return full

    def _load_job(
        self, scheme: KeyScheme, job: LoadJob, fence: Fence, owned: _LateOwnership
    ) -> tuple[bool, list[LoadResult]]:
        refs = job.blocks
        keys = [scheme.key(ref.sgid, self.tp_rank, ref.block_hash) for ref in refs]
        if not refs:
            return False, []  # a hit the scheduler declined after vLLM allocated it: report it failed
        # None: never attempted (staging stayed exhausted, or too many host batches quarantined); reported
        # NOT_ATTEMPTED, which keeps the entry.
        statuses: list[Status | None] = [None] * len(refs)
        nbytes = 0
        # Host path: a store call that may answer late writes a private buffer, never the pages.
        private = self._staging is None and _may_answer_late(self.store, "get")
        for batches in self._batches(refs, range(len(refs))):
            if private and self._quarantine_full():
                continue  # fail fast rather than allocate without bound
            held: list[tuple[StagedBlocks, list[int]]] = []
            try:
                started = time.perf_counter()
                for idxs in batches:
                    mover = self._movers[refs[idxs[0]].sgid]
                    sb = mover.scatter_targets(
                        [refs[i].block_id for i in idxs],
                        after=fence,
                        timeout=_LOAD_STAGING_WAIT_S,
                        private=private,
                    )
                    if sb is not None:  # else staging stayed exhausted: these blocks stay TRANSFER_FAILED
                        held.append((sb, idxs))
                order = [i for _, idxs in held for i in idxs]
                if not order:
                    continue
                destinations = _as_store_buffers([p for sb, _ in held for p in sb.parts])
                read_started = time.perf_counter()
                late: list[Future[object]] = []
                try:
                    got = self._read_into(
                        [keys[i] for i in order],
                        destinations,
                        sum(self.block_nbytes(refs[i].sgid) for i in order),
                        late,
                    )
                finally:
                    # Also when a share raised: the late calls still write these destinations.
                    if late:
                        kv_pages = self._staging is None and not private
                        owned.take(late, [sb for sb, _ in held], kv_pages=kv_pages)
                        held = []
                read_ended = time.perf_counter()
                self._add_load_timing("targets_s", read_started - started)
                self._add_load_timing("store_s", read_ended - read_started)
                for i, st in zip(order, got, strict=True):
                    statuses[i] = st
                if late:  # the calls still write these destinations (now owned): never commit them
                    continue
                for sb, idxs in held:
                    flags = [statuses[i] is Status.OK for i in idxs]
                    sb.commit(flags)
                    nbytes += sum(flags) * self.block_nbytes(refs[idxs[0]].sgid)
                self._add_load_timing("commit_s", time.perf_counter() - read_ended)
            finally:
                for sb, _ in held:
                    sb.release()
        results = []
        for ref, status in zip(refs, statuses, strict=True):
            if status is not Status.OK:
                self.stats.add("load_failed_keys")
            outcome = LoadOutcome.NOT_ATTEMPTED if status is None else LoadOutcome.from_status(status.value)
            results.append(LoadResult(ref.entry(self.tp_rank), outcome))
        self.stats.add("load_keys", len(keys))
        self.stats.add("load_bytes", nbytes)
        return all(st is Status.OK for st in statuses), results

    def _read_into(
        self, keys: list[str], destinations: list[Value], nbytes: int, late: list[Future[object]]
    ) -> list[Status]:
        """``store.get_into(keys, destinations)``: the statuses in key order. Appends to ``late`` the calls
        that answered while still writing their destinations (see "Buffer ownership") -- every share's,
        also when some share raised.

        A batch of at least ``_SPLIT_READ_MIN_BYTES`` is split into ``_LOAD_READERS`` contiguous shares of
        keys: this thread reads the first, the helper readers the others, at once (each share's checksum
        runs right after its own reads, while the bytes are in cache). Returns or raises only once every
        share's call has returned; an exception of any share propagates (the job fails, the request
        recomputes), after ``late`` has every share's late calls.
        """
        num_shares = min(_LOAD_READERS, len(keys)) if nbytes >= _SPLIT_READ_MIN_BYTES else 1
        bounds = [len(keys) * share // num_shares for share in range(num_shares + 1)]
        shares_late: list[list[Future[object]]] = [[] for _ in range(num_shares)]
        helpers = [
            self._readers.submit(
                functools.partial(self._read_share, keys[a:b], destinations[a:b], shares_late[share])
            )
            for share, (a, b) in enumerate(itertools.pairwise(bounds[1:]), start=1)
        ]
        try:
            statuses = self._read_share(keys[: bounds[1]], destinations[: bounds[1]], shares_late[0])
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
        self, keys: list[str], destinations: list[Value], late: list[Future[object]]
    ) -> list[Status]:
        """One thread's ``get_into``; appends the late calls it left to ``late``, also when it raises
        (``collect_late_calls`` is per thread)."""
        with collect_late_calls() as share_late:
            try:
                return list(self.store.get_into(keys, destinations))
            finally:
                late.extend(share_late)

    def _add_load_timing(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.load_timings[phase] += seconds

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished_recving, failed_recving) since the last call; failed is a subset of finished.

        While loads are in flight and none has finished, waits up to ``_LOAD_YIELD_S`` for one. The engine
        thread calls this every step; while a request waits for its load the engine loop spins through empty
        steps, and without this pause the load thread gets the GIL back only once per switch interval
        after every blocking call (measured: a 30 ms load took 1.2 s inside a request). Waiting releases
        the GIL, so the load runs at full speed; steps with no load in flight never wait.
        """
        with self._lock:
            if self._engine_back_at is not None:
                self.load_timings["engine_steps"] += 1
                self.load_timings["engine_busy_s"] += time.perf_counter() - self._engine_back_at
            if self._num_loads_in_flight and not self._outbox.has_finished_loads:
                self._load_finished.wait(_LOAD_YIELD_S)
            finished, failed = self._outbox.take_finished_loads()
            now = time.perf_counter()
            for req_id in finished:
                at = self._load_finished_at.pop(req_id, None)
                if at is not None:
                    self.load_timings["report_s"] += now - at
            self._engine_back_at = now if self._num_loads_in_flight else None
            return finished, failed

    # ------------------------------------------------------------------ saves
    def enqueue_saves(self, meta: HybridStoreMetadata) -> None:
        """Queue the step's saves (called from ``wait_for_save``, on the engine thread; never waits).

        CUDA: first records the fence on the current stream, so the save thread's device->host copies read
        the blocks only after every kernel this step queued before ``wait_for_save``.
        """
        if self._layerwise is not None and not self._layerwise.saves_allowed(meta):
            # A layer-wise load of this step failed: the step computed on its pages, so none of its KV may
            # reach the store (vLLM discards the step for that request and recomputes).
            for job in meta.saves:
                self.stats.add("layerwise_dropped_saves")
                self._finish_save(job, self._save_results(job, SaveOutcome.DROPPED))
            return
        if not meta.saves:
            return
        fence = self._fence()
        budget = self.cfg.put_wave_bytes * _MAX_WAVES_IN_FLIGHT
        for job in meta.saves:
            nbytes = sum(self.block_nbytes(ref.sgid) for ref in job.blocks)
            with self._lock:
                # Asleep: the blocks' memory is released, there is nothing valid to read.
                admit = not self._suspended and (
                    self._inflight_bytes == 0 or self._inflight_bytes + nbytes <= budget
                )
                if admit:
                    self._inflight_bytes += nbytes
            if admit:
                self._save_q.put((meta.scheme, job, nbytes, fence, self._snapshot_open_tails(job)))
            else:
                self.stats.add("put_wave_drops")
                self._finish_save(job, self._save_results(job, SaveOutcome.DROPPED))

    def _snapshot_open_tails(self, job: SaveJob) -> dict[int, list[np.ndarray]]:
        """Host path: private copies of the job's blocks the next steps may still write (see the module
        docstring), by position in ``job.blocks``. Engine thread; one page copy per open tail."""
        if self._staging is not None:
            return {}
        snapshots: dict[int, list[np.ndarray]] = {}
        for i, ref in enumerate(job.blocks):
            group = self.geo.groups[ref.sgid]
            if KIND_RULES[group.kind].stores_partial_tails and ref.key_boundary % group.span:
                snapshots[i] = self._movers[ref.sgid].snapshot(ref.block_id)
        self.num_tail_snapshots += len(snapshots)  # engine thread only
        return snapshots

    def _finish_save(self, job: SaveJob, results: list[SaveResult]) -> None:
        with self._lock:
            self._outbox.save_finished(job.job_id, results)

    def _save_loop(self) -> None:
        while (item := self._save_q.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
                continue
            scheme, job, nbytes, fence, snapshots = item
            owned = _LateOwnership()
            try:
                results = self._put_job(scheme, job, fence, owned, snapshots)
            except Exception as exc:  # noqa: BLE001 -- a store failure must never reach the engine
                log.warning(ConnectorLogEvent.SAVE_RAISED, request_id=job.req_id, error=repr(exc))
                results = self._save_results(job, SaveOutcome.TRANSPORT_ERROR)
            if owned.owns_kv_pages:
                # A late put still reads the source pages: the job's pins and in-flight bytes are released
                # only once it returned.
                self._after_late_calls(owned, functools.partial(self._end_save, job, nbytes, results))
            else:
                # A late put reads only its slab or private copy, which stay quarantined until it returned.
                self._end_save(job, nbytes, results)
                if owned.calls:
                    self._after_late_calls(owned, lambda: None)

    def _end_save(self, job: SaveJob, nbytes: int, results: list[SaveResult]) -> None:
        with self._lock:
            self._inflight_bytes -= nbytes
        self._finish_save(job, results)

    def _put_job(
        self,
        scheme: KeyScheme,
        job: SaveJob,
        fence: Fence,
        owned: _LateOwnership,
        snapshots: dict[int, list[np.ndarray]],
    ) -> list[SaveResult]:
        keys = [scheme.key(ref.sgid, self.tp_rank, ref.block_hash) for ref in job.blocks]
        status: dict[int, SaveOutcome] = {}
        # Insert-if-absent makes duplicates harmless; asking first saves reading and sending the bytes.
        for i, st in enumerate(self.store.exists(keys)):
            if st.is_ok:
                status[i] = SaveOutcome.OK
                self.stats.add("save_skipped_keys")
        todo = [i for i in range(len(keys)) if i not in status]
        staged = self._staging is not None
        # Host path: a put that may answer late reads a private copy, never the live pages.
        private = not staged and _may_answer_late(self.store, "put")
        wave: list[int] = []
        wave_bytes = 0
        for i in todo:
            sgid = job.blocks[i].sgid
            # CUDA: a wave is one group's batch that fits one staging slab.
            if (
                wave
                and staged
                and (sgid != job.blocks[wave[0]].sgid or len(wave) >= self._movers[sgid].max_blocks)
            ):
                self._put_wave(job, keys, wave, status, fence, owned, snapshots, private)
                wave, wave_bytes = [], 0
            wave.append(i)
            wave_bytes += self.block_nbytes(sgid)
            if wave_bytes >= self.cfg.put_wave_bytes:
                self._put_wave(job, keys, wave, status, fence, owned, snapshots, private)
                wave, wave_bytes = [], 0
        if wave:
            self._put_wave(job, keys, wave, status, fence, owned, snapshots, private)
        # A block absent from ``status`` was never sent (its staging stayed exhausted).
        return [
            SaveResult(ref.entry(self.tp_rank), status.get(i, SaveOutcome.DROPPED))
            for i, ref in enumerate(job.blocks)
        ]

    def _put_wave(
        self,
        job: SaveJob,
        keys: list[str],
        wave: list[int],
        status: dict[int, SaveOutcome],
        fence: Fence,
        owned: _LateOwnership,
        snapshots: dict[int, list[np.ndarray]],
        private: bool,
    ) -> None:
        """Put the blocks at positions ``wave``; ``private``: from a private copy (see "Buffer ownership")."""
        for batches in self._batches(job.blocks, wave):
            if private and self._quarantine_full():  # drop rather than copy without bound
                self.stats.add("put_wave_drops")
                continue
            held: list[tuple[StagedBlocks, list[int]]] = []
            try:
                for idxs in batches:
                    mover = self._movers[job.blocks[idxs[0]].sgid]
                    sb = mover.gather(
                        [job.blocks[i].block_id for i in idxs],
                        after=fence,
                        timeout=_SAVE_STAGING_WAIT_S,
                        private=private,
                    )
                    if sb is None:  # staging stayed exhausted: drop these blocks (never stall)
                        self.stats.add("put_wave_drops")
                        continue
                    held.append((sb, idxs))
                order = [i for _, idxs in held for i in idxs]
                if not order:
                    continue
                values = _as_store_buffers(
                    [snapshots.get(i, p) for i, p in zip(order, (p for sb, _ in held for p in sb.parts))]
                )
                with collect_late_calls() as late:
                    try:
                        statuses = self.store.put([keys[i] for i in order], values)
                    finally:
                        # Also when it raised: the call still reads these values; keep them out of use.
                        if late:
                            kv_pages = self._staging is None and not private
                            owned.take(late, [sb for sb, _ in held], kv_pages=kv_pages)
                            held = []
            finally:
                for sb, _ in held:
                    sb.release()
            self.stats.add("save_calls")
            if any(st is Status.NO_SPACE for st in statuses):
                self.stats.add("put_wave_drops")
            for i, st in zip(order, statuses, strict=True):
                status[i] = SaveOutcome.from_status(st)
                if st.is_ok:
                    self.stats.add("save_keys")
                    self.stats.add("save_bytes", self.block_nbytes(job.blocks[i].sgid))
                else:
                    self.stats.add("save_failed_keys")

    def worker_meta(self) -> HybridStoreWorkerMetadata | None:
        """The results to send the scheduler this step (``build_connector_worker_meta``), or None."""
        with self._lock:
            return self._outbox.take_metadata(self.tp_rank)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every save queued so far is written and reported, and no late store call owns KV
        pages (shutdown; sleep; ``reset_prefix_cache``; tests). False on timeout.

        Late calls that own only quarantined buffers (slabs, private copies) are not waited for: they hold
        no job, and they may never return (``wait_late_calls`` waits for them)."""
        deadline = time.monotonic() + timeout
        marker = threading.Event()
        self._save_q.put(marker)
        return marker.wait(timeout) and self._wait_kv_late_calls(max(0.0, deadline - time.monotonic()))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Write the queued saves, stop the threads and close the store, in at most about ``timeout`` seconds
        (plus ``_CLOSE_STORE_MIN_S``) even when a store call never returns: every thread is a daemon, and
        what is still running then is left behind."""
        deadline = time.monotonic() + timeout

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        if self._layerwise is not None:
            self._layerwise.close()
        self.flush(left())
        self._load_q.put(None)
        self._save_q.put(None)
        for th in self._threads:
            th.join(left())
        self._readers.shutdown()
        self.wait_late_calls(left())  # close the store under no late call, when they return in time
        closer = threading.Thread(target=self.store.close, name="hybridkv-close-store", daemon=True)
        closer.start()
        closer.join(max(left(), _CLOSE_STORE_MIN_S))
        if self._staging is not None:
            self._staging.close()
