"""vLLM's real ``Scheduler`` with and without the connector at production geometry (``hybridkv bench
scheduler``), as pure functions returning dicts.

The geometry is Kimi-K3-like (``k3_configs``): MLA with block 64 sharded by DCP 8 (a 512-token span),
a replicated Mamba / linear-attention state in align mode with block 64, hash unit 64, TP 8. A stream of
requests (prompts up to 128K tokens; a mix of hits on prefixes a previous request saved and misses) is
added a few per step; every ``schedule()`` call is timed. Scheduled requests are finished right away (the
bench measures the scheduler's decision, not prefill), so the pool never fills.

Rounds interleave the configurations (medians over rounds, with the spread; ratios within a round). Like
vLLM's ``EngineCore``, each run freezes the start-up heap before it serves. Per store URL (e.g.
``faulty+memory://...?delay_ms=5``: a store with that much latency per call), and once without the
connector, it reports: ``schedule()`` p50/p99, lookups per second, store round trips and
keys per lookup (p50/max; the probing search), hit tokens found, and the hit tokens the synchronous full
scan (every candidate key in one call, the old lookup) finds over the same store contents.

Steps are split into busy ones (they scheduled tokens) and idle ones (they scheduled nothing: requests waiting for
their lookups, and ``idle_steps`` calls after the stream drained, which give the no-connector run its idle steps),
and each step into the connector's own calls on the scheduler thread (every scheduler-side hook vLLM calls:
``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``, ``request_finished*``,
``update_connector_output``, ...) and vLLM's part of ``schedule()``.

``peer``: vLLM's in-tree ``MooncakeStoreConnector`` in both lookup modes (``lookup_async`` false and true) and,
on vLLM 0.34, asynchronous with lookup prefetch on (``lookup_prefetch_limit``, ``PEER_PREFETCH_LIMIT``), on
the same geometry (it supports MLA + Mamba align with DCP), the same stream and a real ``mooncake_master``
(:mod:`hybridkv_dev.bench.scheduler_peer`: its worker of rank 0 serves the lookups from a child process, and the
stream's stored prefixes are planted under its own keys), interleaved with the other configurations; hybridkv
on the same Mooncake deployment is its like-for-like row.
"""

from __future__ import annotations

from hybridkv_dev.bench.scheduler.bench import (
    run_scheduler_bench,
)
from hybridkv_dev.bench.scheduler.drive import (
    PeerSpec,
)
from hybridkv_dev.bench.scheduler.k3 import (
    K3_BLOCK,
    K3_DCP,
    k3_configs,
    k3_request,
    saved_entries,
)
from hybridkv_dev.bench.scheduler.k3 import (
    full_scan_hit as full_scan_hit,
)
from hybridkv_dev.bench.scheduler.k3 import (
    k3_scheduler as k3_scheduler,
)
from hybridkv_dev.bench.scheduler.k3 import (
    store_prefix as store_prefix,
)
from hybridkv_dev.bench.scheduler.summary import (
    HOOK_COLUMNS,
    SCHEDULER_COLUMNS,
    hook_rows,
)
from hybridkv_dev.bench.scheduler_peer import PEER_CONNECTOR, peer_lookup_server, peer_unavailable_reason

__all__ = [
    "HOOK_COLUMNS",
    "K3_BLOCK",
    "K3_DCP",
    "PEER_CONNECTOR",
    "SCHEDULER_COLUMNS",
    "PeerSpec",
    "hook_rows",
    "k3_configs",
    "k3_request",
    "peer_lookup_server",
    "peer_unavailable_reason",
    "run_scheduler_bench",
    "saved_entries",
]
