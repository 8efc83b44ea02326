"""An agentic trace replayed through real stores: the prefix tokens the store tier serves (``hybridkv bench agentic``).

Agentic traffic (vLLM AgentX traces: a median of 43 turns per session, ~142K input / 444 output tokens per
request, sub-agents in 44 % of sessions, > 96 % prefix reuse) keeps re-sending one growing prefix, and pauses
(tool calls, humans) long enough for a least-recently-used store to evict a session's prefix just before it
returns. This bench generates such a trace from a seed and replays it, request by request, through real stores
(``hybridkv.store.url.open_store``) at a capacity below the trace's working set, one store configuration
after another on the same trace, and counts the prompt tokens the store serves.

The trace (:func:`generate_trace`, pure: the same workload and seed give the same trace). Token counts are
the real ones divided by ``token_scale`` (64), the shape kept:

- ``num_sessions`` agent sessions arriving uniformly over ``session_arrival_window_s``; each belongs to one
  of ``num_tenants`` tenants (a tenant is a store namespace and a vLLM ``cache_salt``) and one of
  ``num_agent_types`` agent types, whose long system prompt (``system_prompt_tokens``) is shared by every
  session of that type and tenant.
- Turns per session: lognormal, median ``median_turns`` (43), clipped to ``[min_turns, max_turns]``. Turn 1
  sends the system prompt and a user task; every later turn re-sends the whole conversation plus the
  previous turn's model output (``model_output_median_tokens``) and a tool result
  (``tool_output_median_tokens``, lognormal): each prompt extends the session's previous prompt.
- Sub-agents: in ``subagent_session_share`` (44 %) of sessions, 1 to ``max_subagents_per_session`` forks,
  each after a random turn: a fork starts from the parent's current prefix plus a task, runs a few turns
  (lognormal, median ``subagent_median_turns``) of its own, and ends; the parent waits for it (a long tool
  call) and continues with the fork's result as its tool output.
- Clock (event-driven): each request takes ``model_median_s`` (lognormal) to answer, then the session
  pauses before its next turn: a tool call (short, frequent: median ``tool_pause_median_s``) or, with
  probability ``human_pause_probability``, a human (long, rare: median ``human_pause_median_s``). The
  requests of every session are merged in time order.
- One-off requests: ``one_off_share`` of all requests come from the ``background`` tenant, each with a
  unique prompt (median ``one_off_median_tokens``) that is never reused, spread uniformly over the trace.

Block hashes are a sha256 chain over ``block_tokens``-token blocks of token ids, with the tenant's salt mixed
into the first block (as vLLM does with ``cache_salt``); only whole blocks are hashed.

The replay (:func:`replay_trace`): the store access pattern of the connector, for one hybrid geometry (one
full-attention group with an entry per block, one Mamba group with a state at the hand-off boundaries; both
``block_tokens`` wide, TP 1), with the real key scheme (``hybridkv.lifecycle.keys.KeyScheme``, one namespace
per tenant). Per request in trace order: the connector's lookup (``hybridkv.lifecycle.lookup.LookupSearch``:
batched ``exists`` rounds; the hit is the deepest boundary where the Mamba state and every attention block
before it are stored, at most the prompt less one token), one ``get_into`` of the hit's entries into
preallocated buffers (``attention_value_bytes`` per block, ``state_value_bytes`` per state), and one ``put``
of the save the connector makes (``hybridkv.lifecycle.save.plan_save``): every whole prompt block past the hit
and the Mamba state at the prompt's last whole block (vLLM hands the state off there). The engine's own
prefix cache is taken as empty: the store is the only source of hit tokens.

What is counted, exactly:

- per request: prompt tokens, hit tokens (the loaded boundary; 0 if a load failed), bytes read and bytes
  written. Bytes written are the entries of the put that the store did not hold just before it: the bench
  asks ``exists`` on the put's keys right before the put (bookkeeping, not the connector's traffic; the
  entries it finds are touched, as the put would). Since the bench never removes keys, a tenant's
  **evicted bytes** at any moment are its bytes written so far less the bytes of its keys still stored.
  (One case escapes both counts alike: an entry present before a put, evicted by an earlier value of the
  same put and written again by it.)
- presence is read with one ``iter_keys`` every ``sample_every`` requests and at the end (default every 8
  on the memory store, where a listing copies the key table, and every 64 on the file store, where it reads
  every file's header: listing after every request would cost more than the replay itself). Since the bench
  never removes keys and only puts evict, a tenant's evicted bytes (written less still stored) are exact at
  every sample.
- **Bytes evicted by another tenant's puts while it was over its quota**, from what the store did: around
  every put of the background tenant (the one with a quota: ``background_quota_fraction`` of capacity; in
  the configurations without quotas the quota it would have) the bench lists the store's keys just before
  and just after the put. The other tenants' keys listed before and gone after were evicted by that put
  (nothing else runs meanwhile, and only puts evict). What the background held is counted as the store
  counts it: framed bytes (header, key and payload, ``FIXED_HEADER_SIZE + len(key) + payload``), before and
  after the put. A put after or before which it held more than its quota is an *over-quota put*; the other
  tenants' bytes it evicted are ``tenant_to_bytes_evicted_over_quota`` (payload bytes, per tenant), the ones
  the background's other puts evicted ``tenant_to_bytes_evicted_within_quota`` (capacity eviction: the store
  was full, and a tenant within its quota competes for capacity like any other). A store that enforces the
  quota keeps the first at 0; plain LRU does not. It costs two listings per background put (a tenth of the
  requests).

Configurations (:data:`CONFIGURATIONS`): ``lru`` (``memory://`` as it is: one LRU over everything),
``lru+quotas`` (the same with ``quotas=background:SIZE``), ``file-lru`` (``file://``: LRU by file mtime,
touched at most once a second, so over a replay of seconds it is close to first-in first-out) and
``file-lru+quotas`` (its directory's quota file), ``lru+sessions`` / ``file-lru+sessions`` (sessions retain
their prefix: ``Store.retain``). A configuration the store refuses (``StoreError``, e.g.
before quotas existed) is reported unavailable with the error. Capacities count framed bytes (a ~100-byte
header per value); the working set is the payload bytes of every distinct entry the trace saves.

Rounds: round ``r`` generates the trace of seed ``seed + r`` and runs every configuration on it, in an order
rotated by ``r``, each on a fresh empty store; figures are medians over rounds with min/max, and differences
against the baseline (the first configuration: ``lru``) are taken per round (same trace) first.
"""

from __future__ import annotations

from hybridkv_dev.bench.agentic.bench import (
    run_agentic_bench,
)
from hybridkv_dev.bench.agentic.replay import (
    DEFAULT_ATTENTION_VALUE_BYTES as DEFAULT_ATTENTION_VALUE_BYTES,
)
from hybridkv_dev.bench.agentic.replay import (
    DEFAULT_STATE_VALUE_BYTES as DEFAULT_STATE_VALUE_BYTES,
)
from hybridkv_dev.bench.agentic.replay import (
    ReplayResult,
    bench_geometry,
    replay_trace,
)
from hybridkv_dev.bench.agentic.stores import (
    CONFIGURATIONS,
    STORE_CHOICES,
    StoreConfiguration,
    configurations_for,
    opened_store,
)
from hybridkv_dev.bench.agentic.table import (
    TABLE_COLUMNS,
    describe_shape,
    evicted_by_background_table_rows,
    evicted_table_rows,
    plot_report,
)
from hybridkv_dev.bench.agentic.trace import (
    BACKGROUND_TENANT,
    TARGET_POINTS_OVER_LRU,
    AgenticTrace,
    AgenticWorkload,
    RequestKind,
    TraceChain,
    TraceRequest,
    agentic_tenants,
    block_hash_chain,
    generate_trace,
    tenant_salt,
)

__all__ = [
    "BACKGROUND_TENANT",
    "CONFIGURATIONS",
    "STORE_CHOICES",
    "TABLE_COLUMNS",
    "TARGET_POINTS_OVER_LRU",
    "AgenticTrace",
    "AgenticWorkload",
    "ReplayResult",
    "RequestKind",
    "StoreConfiguration",
    "TraceChain",
    "TraceRequest",
    "agentic_tenants",
    "bench_geometry",
    "block_hash_chain",
    "configurations_for",
    "describe_shape",
    "evicted_by_background_table_rows",
    "evicted_table_rows",
    "generate_trace",
    "opened_store",
    "plot_report",
    "replay_trace",
    "run_agentic_bench",
    "tenant_salt",
]
