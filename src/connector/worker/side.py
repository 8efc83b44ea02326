"""The worker half of ``HybridStoreConnector``: block bytes in and out of the store, off the forward path.

:class:`WorkerSide` is a facade over the worker's pipelines; each module states its own contract:

- :mod:`~hybridkv.connector.worker.context`: ``register_kv_caches`` builds one
  :class:`~hybridkv.connector.datapath.movers.BlockMover` per group. A group block's value is the concatenation of
  that block's bytes across the group's layers, in the group's layer order, passed to the store as per-layer
  parts. Host (CPU) caches: the parts are the pages themselves (zero copies for contiguous pages, one
  staging copy otherwise). CUDA caches: batches go through a bounded pool of pinned host slabs on side
  streams (:mod:`~hybridkv.connector.datapath.staging`, :mod:`~hybridkv.connector.datapath.movers`).
- :mod:`~hybridkv.connector.worker.load_pipeline`: async loads run on a thread. Every load job this rank receives
  is reported in ``finished_recving`` once done; a job with any non-OK block is also in ``failed_recving``
  (request-level, safe for hybrid models). ``get_block_ids_with_load_errors`` is always empty.
- :mod:`~hybridkv.connector.worker.layerwise`: in ``load_mode: layerwise`` loads are instead synchronous to the
  step that uses them: never in ``finished_recving``; every block of a failed job is in
  ``get_block_ids_with_load_errors`` of that step.
- :mod:`~hybridkv.connector.worker.save_pipeline`: saves are enqueued in ``wait_for_save`` and go out in PUT waves
  on a thread, within an in-flight budget (a slow or full store never stalls the engine).
- :mod:`~hybridkv.connector.worker.ownership`: the late-call contract -- a buffer handed to a store call belongs to
  that call until it really returned; a late call never owns KV memory of a reported job.
- :mod:`~hybridkv.connector.worker.outbox`: what this rank still owes the scheduler.
- :mod:`~hybridkv.connector.worker.load_probe`: the load profile a benchmark may install
  (:meth:`WorkerSide.install_load_probe`); production has none and times nothing.

Sleep mode: while suspended (``suspend`` .. ``resume``) the KV cache memory is released, so no transfer
touches it: loads fail (recomputed), saves are dropped.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import structlog
import torch
from hybridkv.connector.config import LOAD_MODES, ConnectorConfig
from hybridkv.connector.datapath.movers import StagingContext, block_mover
from hybridkv.connector.datapath.staged_mover import StagedMover
from hybridkv.connector.identity import start_scheme
from hybridkv.connector.log_events import ConnectorLogEvent
from hybridkv.connector.metadata import HybridStoreMetadata, HybridStoreWorkerMetadata
from hybridkv.connector.stats import InjectedFaults, StatsBox
from hybridkv.connector.stores import open_connector_store
from hybridkv.connector.vllm_geometry import ConnectorGeometry, resolve_geometry
from hybridkv.connector.worker.context import (
    WorkerContext,
    group_tensors,
    layer_tensors,
    read_ranks,
    staging_for,
)
from hybridkv.connector.worker.cpus import worker_cpus_for
from hybridkv.connector.worker.layerwise import LayerwiseLoads
from hybridkv.connector.worker.load_pipeline import LoadPipeline
from hybridkv.connector.worker.load_probe import LoadProbe
from hybridkv.connector.worker.outbox import Outbox
from hybridkv.connector.worker.ownership import LateOwnership, Quarantine
from hybridkv.connector.worker.save_pipeline import SavePipeline
from hybridkv.connector.worker.tenant_metrics import TenantMetrics
from hybridkv.lifecycle.load import LoadOutcome
from hybridkv.store.base import Store
from hybridkv.store.file import effective_capacity_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = structlog.get_logger(__name__)

#: Longest pause of one engine step waiting for an in-flight load (see ``WorkerSide.transfer_results``).
_LOAD_YIELD_S = 0.005
#: ``shutdown``: the least time given to closing the store, even once its budget is spent.
_CLOSE_STORE_MIN_S = 1.0


class WorkerSide:
    """Worker-role state. One per worker process (TP rank); the connector's worker hooks call it."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: ConnectorConfig) -> None:
        # Layer names and group order only: keys come from the scheduler's KeyScheme in the metadata.
        geo: ConnectorGeometry = resolve_geometry(
            vllm_config, kv_cache_config, cfg.namespace, check_vllm_sizes=False
        )
        # Tagged as the scheduler's start scheme, so the geometry log line shows the fingerprint the keys
        # use (a reset's later tag reaches the workers in each step's ``meta.scheme``).
        geo = dataclasses.replace(geo, scheme=start_scheme(geo.scheme, cfg.weights_version))
        # Before any thread starts: a CPU list this worker may not use stops the engine here, naming the key.
        cpus = worker_cpus_for(cfg.worker_cpus)
        self._ctx = WorkerContext(
            cfg=cfg, geo=geo, store=open_connector_store(cfg), stats=StatsBox(), cpus=cpus
        )
        self._suspended = False  # sleep mode: the KV cache memory is released
        self._outbox = Outbox()
        self._quarantine = Quarantine()
        self._loads = LoadPipeline(self._ctx, self._outbox, self._quarantine)
        self._saves = SavePipeline(self._ctx, self._outbox, self._quarantine)
        self._tenant_metrics = TenantMetrics(self._ctx.stats)
        self._injected_faults = InjectedFaults(self._ctx.stats, self._ctx.store)
        self._layerwise: LayerwiseLoads | None = None
        if cfg.layerwise:
            self._layerwise = LayerwiseLoads(
                store=self._ctx.store,
                stats=self._ctx.stats,
                tp_rank=lambda: self._ctx.tp_rank,
                cpus=cpus,
                # Layer-wise loads read into private buffers: a late call holds no report.
                on_late_calls=lambda late, then: self._quarantine.hold_until_returned(
                    LateOwnership(calls=late), then
                ),
            )

    # ------------------------------------------------------------------ state the connector and tools read
    @property
    def cfg(self) -> ConnectorConfig:
        return self._ctx.cfg

    @property
    def geo(self) -> ConnectorGeometry:
        return self._ctx.geo

    @property
    def stats(self) -> StatsBox:
        return self._ctx.stats

    @property
    def store(self) -> Store:
        """The store the load and save pipelines use (a harness may swap in a wrapper: next job on)."""
        return self._ctx.store

    @store.setter
    def store(self, store: Store) -> None:
        self._ctx.store = store

    @property
    def tp_rank(self) -> int:
        """This worker's TP rank (read from vLLM in ``register_kv_caches``; a harness may set it)."""
        return self._ctx.tp_rank

    @tp_rank.setter
    def tp_rank(self, rank: int) -> None:
        self._ctx.tp_rank = rank

    @property
    def dcp_rank(self) -> int:
        return self._ctx.dcp_rank

    @dcp_rank.setter
    def dcp_rank(self, rank: int) -> None:
        self._ctx.dcp_rank = rank

    @property
    def num_quarantine_refusals(self) -> int:
        """Host batches refused (load failed, save wave dropped) because too many were quarantined."""
        return self._quarantine.num_refusals

    @property
    def num_late_store_calls(self) -> int:
        """Store calls that answered before returning and kept their buffers quarantined."""
        return self._quarantine.num_late_calls

    def gauges(self) -> dict[str, int]:
        """This rank's gauges (``stats.PER_RANK_GAUGES``): save bytes in flight, staging bytes out (pinned
        slabs and private host buffers, late calls' included), late store calls not yet returned; a
        ``file://`` store's effective capacity; and, for a store with quotas, the per-tenant ones
        (``hybridkv.connector.worker.tenant_metrics``, which adds the per-tenant counters to ``stats`` at the same
        time)."""
        ctx = self._ctx
        self._injected_faults.count()
        staging_bytes_out = ctx.host_buffers.num_bytes_out
        if ctx.staging is not None:
            staging_bytes_out += ctx.staging.pool.in_use * ctx.staging.pool.slab_bytes
        gauges = {
            "save_inflight_bytes": self._saves.num_inflight_bytes,
            "staging_bytes_out": staging_bytes_out,
            "late_calls_pending": self._quarantine.num_calls_pending,
            **self._tenant_metrics.gauges(ctx.store),
        }
        capacity = effective_capacity_of(ctx.store)  # file:// only
        if capacity is not None:
            gauges["store_effective_capacity_bytes"] = capacity
        return gauges

    @property
    def num_tail_snapshots(self) -> int:
        """Open full-attention tails copied in ``wait_for_save`` (host path)."""
        return self._saves.num_tail_snapshots

    def block_nbytes(self, group_index: int) -> int:
        """Bytes of one block of store group ``group_index`` (all its layers)."""
        return self._ctx.block_nbytes(group_index)

    def group_tensors(self, group_index: int) -> list[torch.Tensor]:
        """The registered KV cache tensors of store group ``group_index``, in the group's layer order; index one
        with a block id for that block's page (inspection: tests and tools)."""
        return list(self._ctx.group_to_mover[group_index].tensors)

    # ------------------------------------------------------------------ benchmark hooks
    def install_load_probe(self, probe: LoadProbe | None) -> None:
        """Time the async loads queued from now on into ``probe`` (None: stop timing). Benchmarks only: the
        default is none, and then the load path does no timing work at all."""
        self._loads.probe = probe

    @property
    def has_layerwise_loads(self) -> bool:
        """Whether this worker was started with ``load_mode: layerwise`` (it has the layer-wise pipeline)."""
        return self._layerwise is not None

    def switch_load_mode(self, mode: str) -> None:
        """Benchmarks only, between requests (the engine idle): take this worker's next loads in ``mode``.
        A worker started in layer-wise mode keeps its layer-wise pipeline, so it can switch back."""
        assert mode in LOAD_MODES, f"switch_load_mode: unknown load mode {mode!r} (one of {LOAD_MODES})"
        assert self._layerwise is not None, (
            "switch_load_mode needs a worker started with load_mode 'layerwise'"
        )
        self._ctx.cfg = dataclasses.replace(self._ctx.cfg, load_mode=mode)

    # ------------------------------------------------------------------ layout
    def register_kv_caches(
        self,
        kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
        *,
        staging: StagingContext | None = None,
    ) -> None:
        """Bind the engine's KV tensors (vLLM's ``register_kv_caches``).

        ``staging``: route every transfer through these slabs (the staged path CUDA caches take) even
        for host caches; None: CUDA caches get pinned slabs sized from ``put_wave_bytes``, host caches
        are read and written in place.
        """
        ctx = self._ctx
        topology = ctx.geo.geometry.topology
        ctx.tp_rank, ctx.dcp_rank = read_ranks(topology.tp_size, topology.dcp_size)
        dcp = topology.dcp_size
        assert ctx.tp_rank % dcp == ctx.dcp_rank, (
            f"dcp rank {ctx.dcp_rank} != tp rank {ctx.tp_rank} % dcp {dcp}"
        )
        group_to_layers, device = group_tensors(ctx.geo, kv_caches)
        if staging is not None:
            ctx.staging = staging
        elif device.type == "cuda":
            ctx.staging = staging_for(device, group_to_layers, ctx.cfg)
        ctx.group_to_mover = {
            group_index: block_mover(layers, staging=ctx.staging)
            for group_index, layers in group_to_layers.items()
        }
        if self._layerwise is not None:
            self._layerwise.register(ctx.group_to_mover, layer_tensors(ctx.geo, group_to_layers))
        log.info(
            ConnectorLogEvent.WORKER_GEOMETRY,
            tp_rank=ctx.tp_rank,
            dcp_rank=ctx.dcp_rank,
            store=ctx.store.url,
            device=str(device),
            staging_bytes=ctx.staging.pool.budget_bytes if ctx.staging is not None else 0,
            copy_kernel={
                group_index: sorted(m.kernel_directions) or m.kernel_unsupported
                for group_index, m in ctx.group_to_mover.items()
                if isinstance(m, StagedMover)
            },
            block_bytes={g.group_index: ctx.block_nbytes(g.group_index) for g in ctx.geo.groups},
            **ctx.geo.describe(),
        )

    # ------------------------------------------------------------------ loads
    def start_load(self, meta: HybridStoreMetadata) -> None:
        """``start_load_kv``: start the step's loads (async: queued; layer-wise: this step's)."""
        if not meta.loads:
            return
        if self._layerwise is not None and self._ctx.cfg.layerwise:
            # Asleep: the KV cache memory is released; the step's jobs fail without a write (recomputed).
            self._ctx.stats.add("layerwise_load_steps")
            self._layerwise.start(meta, self._ctx.fence(), write=not self._suspended)
            return
        if self._suspended:
            # The KV cache memory is released while the engine sleeps: never write into it. Every job is
            # reported failed, so vLLM recomputes those requests.
            for job in meta.loads:
                results = self._ctx.load_results(job, LoadOutcome.TRANSPORT_ERROR)
                self._outbox.load_finished(job.req_id, False, results, owed=False)
            return
        self._loads.submit(meta.scheme, list(meta.loads), self._ctx.fence())

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
        self._outbox.load_judged(results)
        return failed

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished_recving, failed_recving) since the last call; failed is a subset of finished.

        While loads are in flight and none has finished, waits up to ``_LOAD_YIELD_S`` for one. The engine
        thread calls this every step; while a request waits for its load the engine loop spins through empty
        steps, and without this pause the load thread gets the GIL back only once per switch interval
        after every blocking call (a load then takes many times longer: docs/performance.md, "Figures
        behind design choices"). Waiting releases
        the GIL, so the load runs at full speed; steps with no load in flight never wait.
        """
        probe = self._loads.probe
        if probe is not None:
            probe.engine_step_began()
        finished, failed, num_loads_owed = self._outbox.take_finished_loads(_LOAD_YIELD_S)
        if probe is not None:
            probe.engine_step_ended(finished, loads_in_flight=bool(num_loads_owed))
        return finished, failed

    # ------------------------------------------------------------------ saves
    def enqueue_saves(self, meta: HybridStoreMetadata) -> None:
        """Queue the step's saves (called from ``wait_for_save``, on the engine thread; never waits)."""
        if self._layerwise is not None and not self._layerwise.saves_allowed(meta):
            # A layer-wise load of this step failed: the step computed on its pages, so none of its KV may
            # reach the store (vLLM discards the step for that request and recomputes).
            for _job in meta.saves:
                self._ctx.stats.add("layerwise_dropped_saves")
            self._saves.drop(list(meta.saves))
            return
        # Asleep: the blocks' memory is released, there is nothing valid to read.
        self._saves.submit(meta.scheme, list(meta.saves), admit=not self._suspended)

    def worker_meta(self) -> HybridStoreWorkerMetadata | None:
        """The results to send the scheduler this step (``build_connector_worker_meta``), or None."""
        return self._outbox.take_metadata(self._ctx.tp_rank)

    # ------------------------------------------------------------------ quiescence
    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every save queued so far is written and reported, and no late store call owns KV
        pages (shutdown; sleep; ``reset_prefix_cache``; tests). False on timeout.

        Late calls that own only quarantined buffers (slabs, private copies) are not waited for: they hold
        no job, and they may never return (``wait_late_calls`` waits for them)."""
        deadline = time.monotonic() + timeout
        return self._saves.drain(timeout) and self._quarantine.wait_kv_pages_free(
            max(0.0, deadline - time.monotonic())
        )

    def wait_late_calls(self, timeout: float) -> bool:
        """Wait until every late store call has returned and its quarantined buffers are released (tests,
        shutdown); False after ``timeout`` seconds."""
        return self._quarantine.wait_all_returned(timeout)

    def suspend(self, timeout: float = 30.0) -> bool:
        """Sleep mode (vLLM 0.33 ``unregister_kv_caches``): finish every queued load and save and wait for
        every late store call to return, then refuse to touch the KV cache until ``resume``.

        Returns False when that did not happen within ``timeout``: some transfer may still read or write KV
        memory, so the caller must not release it (the worker is then left awake, as if never suspended).
        """
        self._suspended = True
        deadline = time.monotonic() + timeout
        drained = self._loads.drain(timeout) and self.flush(max(0.0, deadline - time.monotonic()))
        if not drained:
            self._suspended = False
            return False
        self._ctx.host_buffers.drop_idle()  # a sleeping engine gives its memory back
        return True

    def resume(self) -> None:
        """Wake-up (vLLM 0.33 ``restore_kv_caches``): the KV cache is mapped again at the same addresses."""
        self._suspended = False

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
        self._loads.stop()
        self._ctx.host_buffers.drop_idle()
        self._saves.stop()
        self._loads.join(left())
        self._saves.join(left())
        self.wait_late_calls(left())  # close the store under no late call, when they return in time
        closer = threading.Thread(target=self._ctx.store.close, name="hybridkv-close-store", daemon=True)
        closer.start()
        closer.join(max(left(), _CLOSE_STORE_MIN_S))
        if self._ctx.staging is not None:
            self._ctx.staging.close()
