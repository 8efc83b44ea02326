"""``HybridStoreConnector``: vLLM's KV-connector interface as a thin facade over the two halves.

Configure with ``kv_connector="HybridStoreConnector"``, ``kv_connector_module_path="hybridkv.connector"``
(or the ``hybridkv`` general plugin), ``kv_role="kv_both"``, ``kv_load_failure_policy="recompute"``; see
:mod:`hybridkv.connector.config` for ``kv_connector_extra_config``.
"""

from __future__ import annotations

import enum
import threading
import time
from typing import TYPE_CHECKING, Any

import structlog
from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.log_events import ConnectorLogEvent
from hybridkv.connector.metadata import HybridStoreMetadata
from hybridkv.connector.stats import HybridStoreStats, build_stats, with_gauges
from hybridkv.connector.vllm_compat import (
    in_process_kv_cache_access,
    settle_before_prefix_cache_reset,
    this_process_connector,
)
from hybridkv.lifecycle.geometry import Geometry
from hybridkv.lifecycle.table import State
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    import torch
    from hybridkv.connector.scheduler.side import SchedulerSide
    from hybridkv.connector.worker.side import WorkerSide
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = structlog.get_logger(__name__)

#: the longest ``reset_prefix_cache`` waits for in-flight saves to settle before vLLM checks its blocks
SETTLE_TIMEOUT_S = 10.0
#: the longest ``unregister_kv_caches`` (sleep) waits for transfers that still own KV memory
SUSPEND_TIMEOUT_S = 30.0


def hit_source(store: str) -> CacheHitSource:
    """The tier a store URL's hits come from (the store registry's ``tier``)."""
    from hybridkv.store.kinds import StoreTier
    from hybridkv.store.url import store_kind

    return {
        StoreTier.DISK: CacheHitSource.DISK,
        StoreTier.HOST: CacheHitSource.HOST,
        StoreTier.EXTERNAL: CacheHitSource.EXTERNAL_UNSPECIFIED,
    }[store_kind(store).tier]


def divergent_local_hits_safe(geometry: Geometry) -> bool:
    """Whether vLLM's divergent local hits can be completed exactly on ``geometry``: the rules of every
    group say so (``KindRules.exact_under_divergent_local_hits``: full attention and recurrent groups, not a
    sliding window). vLLM uses them only on models with a recurrent group."""
    return all(group.rules.exact_under_divergent_local_hits for group in geometry.groups)


class HybridStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """External prefix cache that stays exact for hybrid models (full / sliding window / Mamba groups)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        tc = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra_config(
            tc.kv_connector_extra_config, model=str(vllm_config.model_config.model)
        )
        if tc.kv_load_failure_policy != "recompute" and len(kv_cache_config.kv_cache_groups) > 1:
            # A hybrid model's loads fail request-level (failed_recving); under "fail" vLLM turns each one
            # (an entry evicted since the lookup, a store timeout) into an error for the user instead of a
            # recompute, so a best-effort cache would fail requests that need no external bytes at all.
            raise ValueError(
                f"hybridkv: kv_load_failure_policy={tc.kv_load_failure_policy!r} with a hybrid model "
                f"({len(kv_cache_config.kv_cache_groups)} KV cache groups) would fail a request whenever "
                f"its external load fails; set kv_load_failure_policy='recompute'"
            )
        if self.config.layerwise:
            check_layerwise_supported(kv_cache_config, bool(vllm_config.scheduler_config.async_scheduling))
        if tc.kv_load_failure_policy != "recompute":
            log.warning(
                ConnectorLogEvent.LOAD_FAILURE_POLICY_NOT_RECOMPUTE,
                policy=tc.kv_load_failure_policy,
            )
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            from hybridkv.connector.scheduler.side import SchedulerSide

            self._sched = SchedulerSide(vllm_config, kv_cache_config, self.config)
        else:
            from hybridkv.connector.worker.side import WorkerSide

            self._worker = WorkerSide(vllm_config, kv_cache_config, self.config)
        self._source = hit_source(self.config.store)
        self._divergent_local_hits = False
        if self.config.divergent_local_hits and self._sched is not None:
            geometry = self._sched.geo.geometry
            self._divergent_local_hits = divergent_local_hits_safe(geometry)
            if not self._divergent_local_hits:
                log.warning(
                    ConnectorLogEvent.DIVERGENT_LOCAL_HITS_OFF,
                    group_kinds=sorted({group.kind.value for group in geometry.groups}),
                    reason="needs full-attention and recurrent groups only (no sliding window)",
                )
        #: the scheduler's gauges as last exported (a gauge missing: never exported)
        self._gauges_reported: dict[str, int] = {}
        self._settle_lock = threading.Lock()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a preempted request just recomputes

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """With ``divergent_local_hits`` on a full-attention + recurrent model: vLLM may hand the connector a
        local full-attention hit whose recurrent state at that depth is not local. The lookup answers only
        boundaries past that hit, and every load restores each recurrent group's state at its own boundary
        (never one at the local hit), so the request resumes on a state loaded for its boundary."""
        return self._divergent_local_hits

    @property
    def scheduler_side(self) -> SchedulerSide:
        assert self._sched is not None, "scheduler-side call on a worker-role HybridStoreConnector"
        return self._sched

    @property
    def worker_side(self) -> WorkerSide:
        assert self._worker is not None, "worker-side call on a scheduler-role HybridStoreConnector"
        return self._worker

    def worker_side_if_any(self) -> WorkerSide | None:
        """The worker half, or None on a scheduler-role connector or after ``shutdown``."""
        return self._worker

    # ------------------------------------------------------------------ worker role
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    # -- sleep mode (vLLM 0.33; 0.32 never calls these) ------------------------------------------------
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        return True  # the external tier lives outside the KV cache; the worker drains before it is released

    def unregister_kv_caches(self) -> None:
        """Before the KV cache memory is released: finish queued loads and saves and wait for late store
        calls, then touch nothing.

        Raises ``RuntimeError`` (the worker stays awake) when some transfer still owns KV memory after
        ``SUSPEND_TIMEOUT_S``: releasing that memory under a running copy would corrupt whatever is mapped
        there next, so sleep is refused instead and may be retried.
        """
        if not self.worker_side.suspend(SUSPEND_TIMEOUT_S):
            raise RuntimeError(
                f"hybridkv: store transfers still own KV cache memory after {SUSPEND_TIMEOUT_S:.0f} s; "
                "refusing to release it for sleep (retry once the store answers)"
            )

    def restore_kv_caches(self) -> None:
        self.worker_side.resume()

    # -- vLLM 0.34 (older releases never call it) -------------------------------------------------------
    @classmethod
    def kv_cache_access(cls, kv_transfer_config: KVTransferConfig) -> enum.IntFlag:
        """``KVCacheAccess.IN_PROCESS``: the workers reach the KV cache only with in-process copies (torch
        ops on the tensors ``register_kv_caches`` handed over; no RDMA registration, no export to another
        process), so any allocation works, vLLM 0.34's extensible KV cache included. Its release around
        a weight update goes through ``unregister_kv_caches`` / ``restore_kv_caches`` (above)."""
        return in_process_kv_cache_access()

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """vLLM 0.34: keep lookahead block hashes on (``num_hash_lookahead_tokens`` L = the drafter's prefill
        lookahead) with this connector: True for every configuration.

        vLLM asks with the transfer config alone, before the model's KV-cache groups exist, so nothing here
        can see the geometry; the decision per geometry is made at start (``resolve_geometry``), and every
        geometry this connector serves keeps the promise under L, because each rule that L changes is
        followed as vLLM's coordinator follows it:

        - lookups: vLLM turns the EAGLE drop off, so the geometry has ``eagle`` off and the agreed
          boundary is the coordinator's without a drop (full / MLA, sliding window, Mamba, under DCP too);
        - keys are vLLM's block hashes, which now also cover the L tokens after each block: an entry is
          reused only where the tokens the drafter's KV in it read agree;
        - saves key a block only once its hash exists and its KV is final (not within the last L - 1
          re-prefilled tokens of a chunk); Mamba states come from vLLM's hand-offs, which it places at
          ``floor((N - max(1, L)) / H) * H``; what becomes savable only with the request's last hash
          update is saved when the request finishes (``request_finished``);
        - L is in the key fingerprint: engines with different L never read each other's entries.

        Where a geometry cannot be served at all (a Mamba group not in ``align`` mode, a sliding window
        under DCP, pipeline or prefill context parallelism) the connector refuses to start as it does
        without L, so answering True never opens a geometry that answering False would have kept safe.
        vLLM 0.32 and 0.33 never call this (L stays 0 there, and keys are unchanged)."""
        return True

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HybridStoreMetadata), f"unexpected metadata {type(meta).__name__}"
        self.worker_side.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # async mode: a loading request is not scheduled until its load finished, nothing to wait for
        if self.config.layerwise:
            self.worker_side.wait_for_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return None  # saves are whole blocks, enqueued in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HybridStoreMetadata), f"unexpected metadata {type(meta).__name__}"
        self.worker_side.enqueue_saves(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done, failed = self.worker_side.transfer_results()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        # async mode: failures are request-level (failed_recving), legal on hybrid models too. layerwise
        # mode (one KV cache group only): every block of a failed load, so vLLM recomputes it whole.
        if self.config.layerwise:
            return self.worker_side.end_layerwise_step()
        return set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        meta: KVConnectorWorkerMetadata | None = self.worker_side.worker_meta()
        return meta

    def get_kv_connector_stats(self) -> HybridStoreStats | None:
        if self._worker is not None:
            # Every rank sends its gauges each step: aggregated over ranks by max (stats.PER_RANK_GAUGES).
            # Gauges first: reading them adds the per-tenant counters to the stats taken next.
            gauges = self._worker.gauges()
            return with_gauges(self._worker.stats.take(), gauges)
        if self._sched is None:
            return None
        # The scheduler's gauges (the breaker as 0 or 1, what it holds) are exported whenever they changed.
        now = {"breaker_open": int(self.breaker_open()), **self._sched.gauges()}
        changed = {name: value for name, value in now.items() if self._gauges_reported.get(name) != value}
        self._gauges_reported.update(changed)
        return with_gauges(self._sched.stats.take(), changed)

    def breaker_open(self) -> bool:
        """Whether the scheduler's lookup circuit breaker is open now (lookups answer "miss")."""
        return self._sched is not None and self._sched.lookup_breaker_open

    # ------------------------------------------------------------------ scheduler role
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """Keep vLLM's manager; its ``reset_prefix_cache`` settles in-flight saves first
        (:func:`~hybridkv.connector.vllm_compat.settle_before_prefix_cache_reset` says why)."""
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler_side.bind_kv_cache_manager(kv_cache_manager)
        settle_before_prefix_cache_reset(kv_cache_manager, self.settle_saves)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self.scheduler_side.bind_block_pool(gpu_block_pool)

    def settle_saves(self, timeout: float = SETTLE_TIMEOUT_S) -> bool:
        """Finish every in-flight save now and release its pins; True when none is left.

        Works when the worker half lives in this process (TP=1: in-process or multiprocess engine core with
        the uniprocess executor). Otherwise it returns False and the pins are released by the next engine
        steps, which vLLM keeps taking while ``has_pending_push_work()``.
        """
        sched = self._sched
        if sched is None or not sched.has_pending_push_work():
            return True
        worker = _local_worker()
        if worker is None:
            return False
        with self._settle_lock:
            # Jobs not yet sent (finish-time partial tails): what the next build_meta would send besides
            # step saves (no step is scheduled). Between steps there are no pending loads (they leave in
            # the same schedule() that planned them).
            meta = sched.take_unplanned_meta()
            if meta.loads:
                worker.start_load(meta)
            if meta.saves:
                worker.enqueue_saves(meta)
            flushed = worker.flush(timeout)
            wm = worker.worker_meta()
            if wm is not None:
                sched.on_worker_meta(wm)
        settled = not sched.has_pending_push_work()
        if not settled:
            log.warning(ConnectorLogEvent.SAVES_IN_FLIGHT_AFTER_SETTLING, flushed=flushed, timeout_s=timeout)
        return settled

    def on_new_request(self, request: Request) -> None:
        self.scheduler_side.track(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        answer: tuple[int | None, bool] = self.scheduler_side.lookup(request, num_computed_tokens)
        return answer

    def may_load_async(self, request: Request) -> bool:
        """vLLM 0.34 (``--max-num-inflight-kv-loads``): whether ``get_num_new_matched_tokens`` may answer
        ``load_kv_async=True`` for ``request``; such requests may start their load while the running batch
        is full. vLLM asks when the request enters the waiting queues, right after ``on_new_request``.

        True unless the request surely loads nothing asynchronously: loads off (a producer, an engine that
        cannot use loaded KV), layer-wise loads (synchronous), a request that reads no cached prefix
        (prompt scoring), a prompt without one full hash block, a lifecycle that cannot hit (``REFUSED``)
        or whose lookup already answered a miss (``MISS``: a request re-entering the queue), or a store
        the lookup would not ask (circuit open, a call hung, a namespace reset: the lookup misses).

        A lookup still in flight answers True: at the first ask every lookup is (``on_new_request`` has
        just started it), so False there would turn the hook off for every new request. That costs
        nothing while the lookup runs (vLLM's "ask again" skips the request without holding back other
        loads); a lookup that then misses holds back the asynchronous loads behind it until a running
        slot frees, as vLLM documents for a false positive, and is then scheduled in arrival order as
        before."""
        sched = self._sched
        if sched is None or not sched.can_load or self.config.layerwise:
            return False
        if getattr(request, "skip_reading_prefix_cache", False) or getattr(
            request, "skip_reading_external_kv", False
        ):
            return False
        if not request.block_hashes:
            return False
        lc = sched.lifecycle(request.request_id)
        if lc is not None and lc.current in (State.MISS, State.REFUSED):
            return False
        return sched.answers.store_usable()

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler_side.after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        return {self._source: num_external_tokens} if num_external_tokens > 0 else {}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta: KVConnectorMetadata = self.scheduler_side.build_meta(scheduler_output)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_side.on_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler_side.request_finished(request, (block_ids,))
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Under lookahead hashes the KV its last hash update made savable is queued first, its blocks
        pinned by the save job (vLLM may free them now: False, never a deferred free)."""
        self.scheduler_side.request_finished(request, block_ids)
        return False, None

    def register_finished_partial_tail(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
        partial_tail_offloads: list[tuple[int, int, int]],
    ) -> bool:
        self.scheduler_side.finished_partial_tail(request, partial_tail_offloads, block_ids)
        return False  # the save job pins its own blocks

    def take_events(self) -> list[KVCacheEvent]:
        events: list[KVCacheEvent] = self.scheduler_side.take_events()
        return events

    def has_pending_push_work(self) -> bool:
        pending: bool = self.scheduler_side.has_pending_push_work()
        return pending

    def reset_cache(self) -> bool | None:
        """Remove this deployment's namespace from the store (``reset_prefix_cache(reset_connector=True)``).

        Returns False, never raises, when the store fails: a reset must not take the engine down.
        """
        try:
            done: bool = self.scheduler_side.reset_cache()
        except Exception as exc:  # noqa: BLE001 -- the store's failure is reported, the engine keeps serving
            log.warning(ConnectorLogEvent.RESET_CACHE_RAISED, error=repr(exc))
            return False
        return done

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """``load_mode: layerwise`` needs PIECEWISE CUDA graphs: a full graph replays the forward without
        ``wait_for_layer_load``, so every layer would read its pages before the load wrote them."""
        return (extra_config or {}).get("load_mode") == "layerwise"

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HybridStoreStats | None:
        return build_stats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        from hybridkv.connector.stats import build_prom

        return build_prom(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Idempotent: ends the worker's threads (after writing queued saves) and closes the stores."""
        worker, self._worker = self._worker, None
        sched, self._sched = self._sched, None
        if worker is None and sched is None:
            return
        t0 = time.monotonic()
        if worker is not None:
            worker.shutdown()
        if sched is not None:
            sched.shutdown()
        log.info(
            ConnectorLogEvent.CONNECTOR_SHUT_DOWN,
            role="worker" if worker is not None else "scheduler",
            seconds=round(time.monotonic() - t0, 3),
        )


def check_layerwise_supported(kv_cache_config: KVCacheConfig, async_scheduling: bool) -> None:
    """Refuse ``load_mode: layerwise`` (``ValueError`` naming the key) where it cannot be kept exact.

    A layerwise load feeds the step that uses it, so a failed one must make vLLM discard that step's
    output for the request and recompute its blocks. vLLM 0.32 does that only through block-level
    ``invalid_block_ids`` (``Scheduler._handle_invalid_blocks``: truncate ``num_computed_tokens`` at the
    first invalid block, skip the request's sampled token), and it raises ``RuntimeError`` there for a
    model with more than one KV cache group; ``failed_recving`` is ignored for a running request
    (``_handle_failed_recving`` acts only on ``WAITING_FOR_REMOTE_KVS``). So a hybrid model has no safe way
    to report a failed layerwise load, and neither has a Mamba-only model (whose state layers never call
    ``wait_for_layer_load``): layerwise mode takes models with one attention group only.

    Async scheduling (vLLM's default on GPU; always off on CPU) schedules the request's next step before
    the failed step's output arrives, and ``_handle_invalid_blocks`` does not mark that in-flight step's
    output stale: its token, computed on the failed pages, would be appended. So layerwise mode also needs
    async scheduling off.
    """
    from vllm.v1.kv_cache_interface import AttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, AttentionSpec):
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        raise ValueError(
            "kv_connector_extra_config['load_mode']: 'layerwise' needs a model with one attention KV cache "
            f"group, this model has {len(groups)} ({kinds}); vLLM can recompute a failed synchronous load only "
            "from block-level load errors, which it rejects for several groups. Use load_mode 'async'."
        )
    if async_scheduling:
        raise ValueError(
            "kv_connector_extra_config['load_mode']: 'layerwise' needs async scheduling off "
            "(--no-async-scheduling): with it, vLLM runs the request's next step before it learns that a "
            "layer-wise load failed, and does not discard that step's token. Or use load_mode 'async'."
        )


def _local_worker() -> WorkerSide | None:
    """The worker half of this process's worker-role connector, if this process runs one."""
    group = this_process_connector()
    return group.worker_side_if_any() if isinstance(group, HybridStoreConnector) else None
