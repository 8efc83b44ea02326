"""Every structlog event the connector logs (the store's are ``hybridkv.store.base.StoreLogEvent``).

The docs name some of them (docs/failure-semantics.md, docs/operations.md): operators grep for these
strings, so they are data here, used at the call sites, and the docs tests read this table.
"""

from __future__ import annotations

import enum

__all__ = ["ConnectorLogEvent"]


class ConnectorLogEvent(enum.StrEnum):
    """A connector log line's event (its first, human-readable field)."""

    CONNECTOR_SHUT_DOWN = "hybridkv connector shut down"
    LOAD_FAILURE_POLICY_NOT_RECOMPUTE = (
        "hybridkv: kv_load_failure_policy is not 'recompute'; a failed load will fail its request"
    )
    SAVES_IN_FLIGHT_AFTER_SETTLING = "hybridkv: saves still in flight after settling"
    RESET_CACHE_RAISED = "hybridkv reset_cache failed"
    LOOKUP_ROUND_FAILED = "hybridkv lookup round failed"
    SCHEDULER_GEOMETRY = "hybridkv scheduler geometry"
    HIT_DECLINED = "hybridkv: hit declined; request recomputes"
    SESSION_HINT_REFUSED = "hybridkv: session hint refused; the request is served without retention"
    LOAD_FAILED = "hybridkv load failed; request recomputes"
    LOADS_DISABLED = "hybridkv: loads disabled; this engine cannot use external KV (saves continue)"
    DIVERGENT_LOCAL_HITS_OFF = "hybridkv: divergent_local_hits stays off for this model"
    MODEL_IDENTITY_UNRESOLVED = (
        "hybridkv: model weights not found locally; keys identify the model by its name and revision only"
    )
    MEMORY_STORE_IS_PROCESS_LOCAL = (
        "hybridkv: memory:// is process-local; with several worker processes use file:// or mooncake://"
    )
    INVALIDATION_DROPPED = "hybridkv invalidation dropped: maintenance queue full"
    RESET_CACHE_DROPPED = "hybridkv reset_cache dropped: maintenance queue full; lookups miss until a reset"
    LOOKUP_WHILE_LOADING = "hybridkv: lookup while loading; load abandoned"
    LOOKUP_FAILED = "hybridkv lookup failed; miss"
    LOOKUP_OVER_BUDGET = "hybridkv lookup over budget; miss"
    LOOKUP_PROCESS_EXITED = "hybridkv lookup process exited; its lookups miss, it is started again"
    INVALIDATION_FAILED = "hybridkv invalidation failed"
    RESET_CACHE = "hybridkv reset_cache"
    RESET_CACHE_FAILED = "hybridkv reset_cache failed; lookups miss until a reset succeeds"
    WEIGHTS_TAG_ROTATED = (
        "hybridkv keys rotated to a new weights tag (a reset: KV from now on may come from updated weights)"
    )
    RESET_CACHE_STILL_RUNNING = "hybridkv reset_cache still running; lookups miss until it finishes"
    MANIFEST_NOT_WRITTEN = "hybridkv manifest not written"
    WORKER_GEOMETRY = "hybridkv worker geometry"
    COPY_KERNEL_UNAVAILABLE = "hybridkv: copy kernel unavailable (Triton); CUDA transfers use DMA"
    LOAD_RAISED = "hybridkv load raised"
    SAVE_RAISED = "hybridkv save raised"
    LAYERWISE_LOAD_RAISED = "hybridkv layer-wise load raised"
    LAYERWISE_GET_RAISED = "hybridkv layer-wise get raised"
    LAYERWISE_OVER_BUDGET = "hybridkv: layer-wise loads over their wait budget; recomputed"
    #: ``step_trace: true``, DEBUG: one per scheduler step (``connector/scheduler/step_trace.py``)
    STEP = "hybridkv step"
    LAYERWISE_UNWAITED = "hybridkv: layers never waited for their loads; recomputed"
