"""The scheduler half of ``HybridStoreConnector``: vLLM's scheduler hooks over the request lifecycle.

This half keeps vLLM's hooks and the per-request state (:class:`~hybridkv.connector.scheduler.request_state.
RequestState`: the lifecycle plus what the connector holds for it); the work lives in small modules:

- lookup answering (``get_num_new_matched_tokens``): :mod:`hybridkv.connector.scheduler.lookup_answers`;
- the namespace gate and reset epochs: :mod:`hybridkv.connector.scheduler.namespace_gate`;
- store maintenance (invalidation removes, resets, the manifest): :mod:`hybridkv.connector.scheduler.maintenance`;
- a hit's load (bound to vLLM's allocation, judged once every rank reported):
  :class:`~hybridkv.connector.scheduler.loads.SchedulerLoads`;
- the save path (which blocks to save when, save jobs, pins, ``BlockStored``):
  :class:`~hybridkv.connector.scheduler.save_planner.SavePlanner`.

The lifecycle decides (``hybridkv.lifecycle``: candidate keys, agreed boundary, load plan, retry cap,
invalid keys, the state machine and its audit); this half drives it from vLLM's hooks and moves the
results between vLLM, the store and the workers.

Contracts:

- ``lookup`` reports only tokens every prefix-cacheable group can restore from entries present on every
  TP/DCP rank, found by a few batched ``exists`` rounds off the scheduler thread, bounded by
  ``lookup_budget_ms``; a slow or failing store is a miss and opens a short circuit breaker. Repeated asks
  with unchanged inputs reuse the answer, within one reset epoch: nothing learnt before a namespace reset
  is loaded after it (``hit_revoked``, and the table's ``answer_current`` guard on ``start_load``).
- Loads are async (``(n, True)``), or with ``load_mode: layerwise`` synchronous to the step that uses
  them (``(n, False)``, one attention group only; see :mod:`hybridkv.connector.worker.layerwise`); the
  per-group plan is bound to the request's real block table in ``update_state_after_alloc``.
- Saves: full attention and SWA positionally from the current tables as prompt blocks complete; Mamba only
  from ``boundary_state_offloads`` and ``register_finished_partial_tail``. Source blocks are pinned
  (``touch``) until every rank reports the wave, then freed.
- A failed load truncates: vLLM restarts the request from 0 (``failed_recving`` from the workers, policy
  ``recompute``), and its next lookup is the one retry: an ordinary lookup capped at the retry cap (the
  largest boundary no faulted entry stands in the way of), which may hit and load an earlier boundary the
  store still serves. Only definite faults (``MISSING``, ``CORRUPT``) remove entries; timeouts, transport
  errors and unattempted blocks keep theirs (counted as ``load_transient_faults``). The request's load and
  save bookkeeping is reset so the retry's load (or the recompute) starts clean and re-saves what was
  invalidated.
- No store call on the scheduler thread without a deadline: lookups wait at most ``lookup_budget_ms``;
  invalidation removes run on a maintenance thread (bounded queue: when full, the removal is dropped and
  counted); ``reset_cache`` waits at most ``reset_wait_s`` for its ``remove_prefix`` (see there).
- Never an assert on vLLM's numbers: external tokens vLLM allocated that do not match the plan (or a plan
  block on the null block, a lifecycle in the wrong state, an answer from before a reset) refuse the hit
  (``hit_refused``, audited with the reason; ``REFUSED``): an empty load job that every worker reports
  failed, so vLLM recomputes the request.
- KV events follow the store: ``BlockStored`` only for waves every rank stored (token range: the block's
  first token up to the key boundary), ``BlockRemoved`` once an invalidation removal returned,
  ``AllBlocksCleared`` once a namespace reset's removal returned.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import TYPE_CHECKING

import structlog
from hybridkv.audit.sinks import JsonLinesAuditSink
from hybridkv.connector.capabilities import connector_roles
from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.identity import start_scheme, weights_after_reset
from hybridkv.connector.log_events import ConnectorLogEvent
from hybridkv.connector.metadata import (
    HybridStoreMetadata,
    HybridStoreWorkerMetadata,
)
from hybridkv.connector.scheduler.layerwise_breaker import LAYERWISE_PAUSED, LayerwiseBreaker
from hybridkv.connector.scheduler.loads import SchedulerLoads
from hybridkv.connector.scheduler.lookup_answers import LookupAnswers
from hybridkv.connector.scheduler.lookup_process import ProcessLookupService
from hybridkv.connector.scheduler.lookup_service import LookupRunner, LookupService
from hybridkv.connector.scheduler.namespace_gate import NamespaceGate
from hybridkv.connector.scheduler.request_state import RequestState
from hybridkv.connector.scheduler.save_planner import RequestSaves, SavePlanner
from hybridkv.connector.scheduler.sessions import RequestSession, SessionRetention
from hybridkv.connector.scheduler.step_trace import StepTrace
from hybridkv.connector.scheduler.store_events import StoreEvents
from hybridkv.connector.scheduler.store_upkeep import StoreUpkeep
from hybridkv.connector.scheduler.vllm_blocks import PrefixCacheGuard
from hybridkv.connector.stats import InjectedFaults, StatsBox
from hybridkv.connector.stores import open_connector_store, store_url
from hybridkv.connector.vllm_geometry import ConnectorGeometry, resolve_geometry
from hybridkv.lifecycle.keys import KeyScheme
from hybridkv.lifecycle.machine import LifecycleMachine, RequestLifecycle
from hybridkv.lifecycle.sink import AuditSink
from hybridkv.lifecycle.table import State
from hybridkv.store.breaker import BreakerState, CircuitBreaker
from hybridkv.store.url import lookup_client_url, store_kind

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import BlockStored, KVCacheEvent
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = structlog.get_logger(__name__)

#: Consecutive failed or over-budget lookup rounds that open the lookup circuit, and for how long. One
#: slow round (a GC pause, a store failover) does not make the cache cold; a store that keeps failing is
#: not hammered, and is probed again after a second.
_BREAKER_FAILURES = 3
_BREAKER_OPEN_S = 1.0
#: The longest ``reset_cache`` waits for the namespace removal before answering (the engine core waits).
RESET_WAIT_S = 1.0


class SchedulerSide:
    """Scheduler-role state. One per engine core; driven from the scheduler thread only."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: ConnectorConfig) -> None:
        self.cfg = cfg
        self.geo: ConnectorGeometry = resolve_geometry(
            vllm_config, kv_cache_config, cfg.namespace, check_vllm_sizes=True
        )
        self.geo = dataclasses.replace(self.geo, scheme=start_scheme(self.geo.scheme, cfg.weights_version))
        self.store = open_connector_store(cfg)
        self.audit: AuditSink | None = JsonLinesAuditSink(cfg.audit_log) if cfg.audit_log else None
        # From here the machine holds the engine's key scheme (``scheme``); the geometry keeps the start one.
        self.machine = LifecycleMachine(self.geo.scheme, sink=self.audit)
        self.stats = StatsBox()
        self._injected_faults = InjectedFaults(self.stats, self.store)
        self._reqs: dict[str, RequestState] = {}
        self.events = StoreEvents(self.geo)
        # Lookups are MISS without touching the store while it is open, until a probe round succeeds.
        self.lookup_breaker = CircuitBreaker(num_failures_to_open=_BREAKER_FAILURES, reset_s=_BREAKER_OPEN_S)
        self._all_ranks = frozenset(self.geo.ranks)
        self.prefix_cache = PrefixCacheGuard(self.geo)
        self.saves = SavePlanner(self.geo, self.machine, self.stats, self, self._all_ranks)
        self.lookups: LookupRunner
        if cfg.lookup_process:
            self.lookups = ProcessLookupService(
                lookup_client_url(store_url(cfg)),
                breaker=self.lookup_breaker,
                budget_s=cfg.lookup_budget_ms / 1000.0,
                breaker_failures=_BREAKER_FAILURES,
                breaker_reset_s=_BREAKER_OPEN_S,
            )
        else:
            self.lookups = LookupService(
                self.store, breaker=self.lookup_breaker, budget_s=cfg.lookup_budget_ms / 1000.0
            )
        #: resets and the gate they close (lookups miss, nothing is saved, while a removal runs): the
        #: engine's lifecycle, audited (``engine_started`` now)
        self.gate = NamespaceGate(
            self.machine, weights_source="declared" if cfg.weights_version else "checkpoint"
        )
        self.answers = LookupAnswers(
            cfg, self.machine, self.lookups, self.lookup_breaker, self.gate, self.stats
        )
        # Store calls that may take long and nobody on the scheduler thread waits for (past a deadline).
        self.upkeep = StoreUpkeep(self.events, self.gate, self.stats)
        #: session hints: what a session's requests store or load stays retained (``connector/scheduler/sessions.py``)
        self.sessions = SessionRetention(self.store, self.upkeep.submit, self.stats)
        #: hits bound to vLLM's allocation (load jobs), and their verdicts once every rank reported
        self.loads = SchedulerLoads(
            cfg,
            self.geo,
            self.machine,
            self.store,
            prefix_cache=self.prefix_cache,
            sessions=self.sessions,
            upkeep=self.upkeep,
            stats=self.stats,
        )
        #: layer-wise mode: hits are withheld for a while after a load missed its deadline (``layerwise.py``)
        self.layerwise_breaker = LayerwiseBreaker(self.stats)
        self.reset_wait_s = RESET_WAIT_S
        #: ``step_trace: true``: one DEBUG event per scheduler step (``connector/scheduler/step_trace.py``)
        self.step_trace: StepTrace | None = StepTrace() if cfg.step_trace else None
        # Off the scheduler thread: engine start never waits on the store.
        self.upkeep.submit(lambda: self.geo.publish_manifest(self.store, self.scheme), lambda _fut: None)
        self.can_save, self.can_load, loads_off = connector_roles(vllm_config)
        if loads_off is not None:
            log.warning(ConnectorLogEvent.LOADS_DISABLED, reason=loads_off, saves=self.can_save)
        log.info(
            ConnectorLogEvent.SCHEDULER_GEOMETRY,
            store=self.store.url,
            saves=self.can_save,
            loads=self.can_load,
            **self.geo.describe(),
        )
        if store_kind(cfg.store).process_local and len(self.geo.ranks) > 1:
            log.warning(ConnectorLogEvent.MEMORY_STORE_IS_PROCESS_LOCAL)

    @property
    def scheme(self) -> KeyScheme:
        """This engine's key scheme now: the lifecycle machine's, its one holder (the geometry's at start; a
        reset rotates its weights tag there, ``NamespaceGate.rotate_weights``)."""
        return self.machine.scheme

    def bind_block_pool(self, pool: BlockPool) -> None:
        self.prefix_cache.block_pool = pool
        self.saves.bind_block_pool(pool)

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self.prefix_cache.kv_cache_manager = manager

    def track(self, request: Request) -> None:
        """Start following a request (``on_new_request``): its prompt blocks may be saved, and its lookup
        starts now, in the background, so the answer is usually in when vLLM first asks."""
        r = self._track(request)
        if self.can_load:
            self.answers.prefetch(r)

    def _track(self, request: Request) -> RequestState:
        r = self._reqs.get(request.request_id)
        if r is None:
            session = self.sessions.session_of(
                request.request_id, getattr(request, "kv_transfer_params", None)
            )
            r = RequestState(
                request=request,
                lc=self.machine.new_request(
                    request.request_id, None if session is None else session.hint.audit_detail()
                ),
                saves=RequestSaves(request),
            )
            r.saves.session = session
            self._reqs[request.request_id] = r
        return r

    # ------------------------------------------------------------------ lookup
    @property
    def lookup_breaker_open(self) -> bool:
        """Whether lookups answer "miss" without asking the store (until the next probe)."""
        return self.lookup_breaker.state is BreakerState.OPEN or self.lookups.stalled()

    @property
    def namespace_closed(self) -> bool:
        """Whether a namespace reset is unfinished (or failed): lookups miss and nothing is saved, so no
        entry from before the reset is ever served."""
        return self.gate.closed

    def lookup(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens``: never waits on the store (see :mod:`.lookup_answers`)."""
        r = self._track(request)
        if not self.can_load:
            return 0, False
        num_external, load_async = self.answers.answer(r, num_computed_tokens)
        if num_external and self.cfg.layerwise and not self.layerwise_breaker.may_offer():
            # Its load would stall the whole step again on a store that just missed the deadline.
            r.lc.decline(LAYERWISE_PAUSED)
            self.stats.add("layerwise_hits_withheld")
            num_external, load_async = 0, False
        if self.step_trace is not None:
            self.step_trace.answered(request.request_id, num_external)
        return num_external, load_async

    # ------------------------------------------------------------------ allocation
    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """``update_state_after_alloc``: bind the request's load plan to the blocks vLLM allocated
        (:meth:`SchedulerLoads.after_alloc`)."""
        self.loads.after_alloc(request, self._reqs.get(request.request_id), blocks, num_external_tokens)

    # ------------------------------------------------------------------ per step
    def take_unplanned_meta(self) -> HybridStoreMetadata:
        """The jobs queued outside step planning (load jobs, finish-time tail saves), each sent once.

        ``build_meta`` starts from this; between steps it is everything the next step would send besides
        its own positional and state saves (``HybridStoreConnector.settle_saves``)."""
        return HybridStoreMetadata(
            scheme=self.scheme, loads=self.loads.take_pending(), saves=self.saves.take_unsent()
        )

    def build_meta(self, so: SchedulerOutput) -> HybridStoreMetadata:
        """``build_connector_meta``: this step's message to every worker.

        Carries every load job queued since the last step (each is sent exactly once) and the save jobs:
        those created between steps (finish-time tails) plus, when this half saves and no namespace
        reset is unfinished, one job per scheduled request whose step completes blocks to save (see
        :meth:`SavePlanner.step_job`). Every save job's source blocks are pinned from here until every
        rank reported it. With ``step_trace``, logs the step's event once the message is built.
        """
        meta = self._build_meta(so)
        if self.step_trace is not None:
            self.step_trace.emit(so, meta)
        return meta

    def _build_meta(self, so: SchedulerOutput) -> HybridStoreMetadata:
        """``build_meta``'s message (see there)."""
        if so.total_num_scheduled_tokens == 0:
            # Nothing to compute: let lookups in flight run instead of the engine loop's empty steps
            # (``LookupService.wait_for_progress``); a step with work never waits here.
            self.lookups.wait_for_progress(self.lookups.idle_step_wait_s)
        meta = self.take_unplanned_meta()
        bs = so.kv_connector_block_state
        if bs is None or not self.can_save or self.namespace_closed:
            return meta
        progress: dict[str, int] = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            progress[rid] = cr.num_computed_tokens[i]
        for rid in sorted(set(progress) | set(bs.boundary_state_offloads)):
            r = self._reqs.get(rid)
            if r is None:
                continue
            done = progress.get(rid, 0) + so.num_scheduled_tokens.get(rid, 0)
            job = self.saves.step_job(
                r.saves, done, bs, bs.boundary_state_offloads.get(rid, []), r.loading_boundary
            )
            if job is not None:
                meta.saves.append(job)
        return meta

    def finished_partial_tail(
        self,
        request: Request,
        tails: list[tuple[int, int, int]],
        block_ids: tuple[list[int], ...] | None = None,
    ) -> None:
        """A finish-time Mamba tail hand-off (and, from ``block_ids``, the full-attention tail it needs)."""
        r = self._reqs.get(request.request_id)
        if r is None or not self.can_save or self.namespace_closed:
            return
        self.saves.finished_partial_tail(r.saves, tails, block_ids, r.loading_boundary)

    # ------------------------------------------------------------------ worker results
    def on_output(self, out: KVConnectorOutput) -> None:
        """``update_connector_output``: take the ranks' results of this step.

        A load is judged once every rank reported it (``VERIFIED``, or ``TRUNCATED`` with invalidations
        queued for its definitely bad entries); save results go to the planner, which finishes the jobs
        every rank finished. Results for requests or jobs no longer tracked are ignored.
        """
        wm = out.kv_connector_worker_meta
        if isinstance(wm, HybridStoreWorkerMetadata):
            self.on_worker_meta(wm)

    def on_worker_meta(self, wm: HybridStoreWorkerMetadata) -> None:
        """The aggregated worker metadata of one step (see ``on_output``)."""
        ranks = self._all_ranks
        if self.cfg.layerwise:  # every job's results, tracked or not: a missed deadline stalled the step
            self.layerwise_breaker.on_load_results(wm.loads.values())
        judged: list[str] = []
        for rid, load_results in wm.loads.items():
            r = self._reqs.get(rid)
            if r is not None and r.load is not None and r.collect(load_results, ranks):
                self.loads.judge(r)
                judged.append(rid)
        self.saves.on_results(wm)
        if self.step_trace is not None:
            self.step_trace.output(judged)

    def wait_maintenance(self, timeout: float) -> bool:
        """Wait until every store maintenance call queued so far returned (tests, shutdown)."""
        return self.upkeep.wait(timeout)

    @property
    def reset_epoch(self) -> int:
        """Namespace resets requested so far (a save job remembers the epoch it was created in)."""
        return self.machine.epoch

    def publish_stored(
        self, epoch: int, stored: list[tuple[int, bytes, BlockStored]], session: RequestSession | None
    ) -> None:
        """Queue the ``BlockStored`` events of a wave every rank stored, created in reset ``epoch``, and
        retain its entries for the request's ``session`` (if any).

        A reset since the job was created, or an invalidation removal still pending for a block, may
        remove what was just stored: then nothing (or not that block) is published rather than something
        untrue."""
        if epoch != self.machine.epoch or self.gate.closed:
            return
        self.upkeep.stored(self.store, self.scheme, stored)
        if session is not None:
            self.sessions.retain(session, self.scheme, [(g, block_hash) for g, block_hash, _ in stored])

    def take_events(self) -> list[KVCacheEvent]:
        return self.upkeep.take_events(self.store)

    # ------------------------------------------------------------------ lifetime
    def request_finished(self, request: Request, block_ids: tuple[list[int], ...] | None = None) -> None:
        """The request left vLLM (finished, aborted): stop following it. Under lookahead hashes
        (vLLM 0.34), first the prompt KV that only its last hash update made savable is queued
        (``SavePlanner.finished_lookahead_save``; ``block_ids``: its block table, by vLLM group)."""
        r = self._reqs.pop(request.request_id, None)
        if r is None:
            return
        if block_ids is not None and self.can_save and not self.namespace_closed:
            self.saves.finished_lookahead_save(r.saves, block_ids, self._final_tokens(request))
        r.abandon_search()  # a finished or aborted request's lookup stops (a queued one never runs)
        self.lookups.forget(request.request_id)
        if r.lc.current is not State.EVICTED:
            r.lc.evict("finished")
        if r.saves.session is not None:
            self.sessions.finished(r.saves.session, self.scheme)

    def _final_tokens(self, request: Request) -> int:
        """Tokens of ``request`` whose KV the workers wrote and will not rewrite: computed, less the steps
        still in flight (vLLM 0.34's async scheduling counts them ahead) and the re-prefilled tail of
        lookahead hashes."""
        in_flight = int(getattr(request, "num_in_flight_tokens", 0)) - int(
            getattr(request, "num_stale_output_tokens", 0)
        )
        computed = request.num_computed_tokens - max(0, in_flight)
        return self.scheme.geometry.num_final_tokens(computed)

    def has_pending_push_work(self) -> bool:
        return self.saves.has_work()

    # ------------------------------------------------------------------ inspection (tests, benches, tools)
    def lifecycle(self, request_id: str) -> RequestLifecycle | None:
        """The current lifecycle of a tracked request (None once finished or never seen)."""
        r = self._reqs.get(request_id)
        return r.lc if r is not None else None

    def loaded_boundary(self, request_id: str) -> int:
        """Tokens the tracked request restored from this store (0: none, or not tracked)."""
        r = self._reqs.get(request_id)
        return r.saves.loaded_boundary if r is not None else 0

    def tracked_request_ids(self) -> list[str]:
        """The requests this half follows (from ``on_new_request`` until ``request_finished``)."""
        return list(self._reqs)

    def gauges(self) -> dict[str, int]:
        """What this half holds now (``stats.GAUGES``): requests followed, blocks pinned by save jobs, audit
        records not yet written."""
        self._injected_faults.count()  # a faulty+ view's injections (its lookups' exists faults)
        # Only the JSON-lines sink queues (another sink hands records on synchronously).
        audit = self.audit
        num_queued = audit.stats()["num_queued"] if isinstance(audit, JsonLinesAuditSink) else 0
        return {
            "tracked_requests": len(self._reqs),
            "pinned_blocks": self.saves.num_pinned_blocks,
            "audit_queued_records": num_queued,
        }

    def is_idle(self) -> bool:
        """No tracked request, no load job waiting to be sent, no save job unsent or in flight."""
        return not self._reqs and not self.loads.pending and not self.saves.has_work()

    def reset_cache(self) -> bool:
        """Remove this deployment's namespace (``reset_prefix_cache(reset_connector=True)``).

        The removal runs on the maintenance thread; this waits at most ``reset_wait_s`` for it. From the
        call on, lookups miss and no save starts until the removal returned, so no entry from before the
        reset is ever served, and saves created before it publish no ``BlockStored``; ``AllBlocksCleared``
        follows the removal. Returns True when the removal finished in time, or is still running (the
        reset is in effect for every request: vLLM counts it as done, and ``pause_generation``'s cache
        reset does not fail the engine over a slow store); False when the store raised (or the
        maintenance queue is full): vLLM's ``reset_prefix_cache`` then reports failure, and lookups keep
        missing until a later reset succeeds.
        """
        self.gate.begin_reset()  # and a new reset epoch
        prefix = self.scheme.prefix
        for r in self._reqs.values():
            r.forget_facts("namespace reset")  # what lookups learnt about the store predates it
        # Jobs planned before the reset but not sent yet would be written under the keys of after it.
        self.saves.drop_unsent("namespace reset")
        self._rotate_weights_tag()

        fut = self.upkeep.remove_namespace(
            self.store, prefix, lambda: self.geo.publish_manifest(self.store, self.scheme)
        )
        if fut is None:
            return False
        try:
            fut.exception(timeout=self.reset_wait_s)
        except concurrent.futures.TimeoutError:
            self.stats.add("reset_timeouts")
            log.warning(ConnectorLogEvent.RESET_CACHE_STILL_RUNNING, prefix=prefix)
            return True
        return fut.exception() is None

    def _rotate_weights_tag(self) -> None:
        """Give this engine's keys the fingerprint of the weights it holds after this reset.

        A reset may follow an in-engine weight update, or not (vLLM resets the connector on pauses,
        sleeps and failed local resets too), so a count of resets names nothing: the tag is the name the
        operator's ``weights_version_file`` gives the weights now (unchanged: the keys stay), else a fresh
        nonce that nothing but this engine ever reads (``identity.weights_after_reset``). The change is
        the engine's ``weights_rotated`` audit record (the gate is closed meanwhile)."""
        previous = self.scheme.fingerprint
        weights = weights_after_reset(self.scheme.weights_tag, self.cfg.weights_version_file)
        scheme = self.scheme.with_weights_tag(weights.tag)
        # The one write: every reader (lookups, saves, the worker metadata, the manifest) follows the machine.
        self.gate.rotate_weights(scheme, weights_source=weights.source, reason=weights.reason)
        log.info(
            ConnectorLogEvent.WEIGHTS_TAG_ROTATED,
            weights_tag=scheme.weights_tag,
            weights_source=weights.source,
            reason=weights.reason,
            fingerprint=scheme.fingerprint,
            previous_fingerprint=previous,
        )

    def shutdown(self) -> None:
        self.saves.release_all()
        self.upkeep.shutdown()
        self.lookups.close()
        if self.audit is not None:
            self.audit.close()
        self.store.close()
