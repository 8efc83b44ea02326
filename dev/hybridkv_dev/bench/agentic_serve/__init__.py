"""The agentic trace replayed through real engines (``hybridkv bench agentic-serve``): external hit tokens,
TTFT and store bytes written, per KV-tier configuration at one store capacity.

``hybridkv bench agentic`` replays its seeded agentic trace (:mod:`hybridkv_dev.bench.agentic`: sessions of ~43
turns re-sending a growing prefix, sub-agent forks, tool and human pauses, tenants, one-off requests of a
``background`` tenant) at store level. This bench sends the same trace's prompts to vLLM's OpenAI server, one
server per configuration and round, and reads what the engines did.

The trace (:func:`build_serve_trace`): :func:`hybridkv_dev.bench.agentic.generate_trace` of
:func:`serve_workload`, whose token counts are the real ones divided by ``token_scale`` (default 256, the
store bench's 64: every token knob of ``AgenticWorkload`` times 64 / ``token_scale``) so that prompts fit the
tiny model's ``max_model_len``; ``num_sessions`` sessions (default 8) arriving over a window scaled like the
session count (the store bench's 24 sessions over 30 minutes), so that about as many sessions are live at
once. The trace's blocks are the engine's (``block_tokens``, passed to vLLM as ``--block-size``). Requests
whose prompt does not fit (more than ``max_model_len - max_tokens`` tokens: the longest sessions' last
turns, a rare long one-off) are left out and counted, then the trace is cut to its first ``max_requests``
requests in time order (counted too). Token ids (drawn from 150,000) are mapped into the model's vocabulary
(``3 + id % (vocab - 3)``, past pad/bos/eos), which keeps every shared prefix shared.

The replay (:func:`replay_trace`): requests in trace order through streamed ``/v1/completions`` with the
prompt as a token-id list, ``max_tokens`` (4) greedy tokens, ``ignore_eos``, and ``cache_salt`` =
``salt:<tenant>`` (vLLM 0.32's completions API takes it: vLLM mixes it into the first block's hash, so each
tenant's blocks, hence their store keys, are its own; the store namespace is one per configuration). The
trace's clock is compressed: each request is sent once the requests it follows are answered (at concurrency
1, the previous one; at 2, the previous request of its session, of its parent or of its sub-agents), never
waiting for the trace's pauses, so a replay of an hour of trace takes about a minute. TTFT is the time to
the first streamed token. Before the replay two short prompts (less than a block: nothing to cache) warm the
server up.

Configurations (:data:`CONFIGURATIONS`), all with the same store capacity C = ``capacity_fraction`` (0.25)
of the trace's working set (the KV bytes of every distinct whole prompt block, per tenant: the tiny Llama's
``layers x 2 x kv_heads x head_dim x 2 bytes`` per token), and the same local KV cache (``kv_cache_mib``,
smaller than C):

- ``file-lru``: ``HybridStoreConnector`` on ``file://DIR?capacity=C`` (a fresh directory per run).
- ``file-lru+sessions``: the same, each request of a session or sub-agent carrying
  ``kv_transfer_params = {"hybridkv_session": {"id": "<tenant>/chain-<n>", "ttl_s": 3600, "end": <is it
  the chain's last request in the replay>}}`` (``hybridkv.connector.scheduler.sessions``); one-offs carry none.
- ``mooncake-store``: vLLM's in-tree ``MooncakeStoreConnector`` (embedded mode, TCP) on a fresh
  ``mooncake_master`` per run on 127.0.0.1, its one worker mounting a global segment of C bytes (so the pool
  is C); run the bench inside ``scripts/netns-run``. (Not ``hybridkv_dev.bench.serve.server_for``, which fixes
  that segment at 512 MiB; the servers here are built with the same ``OpenAIServer`` and
  ``hybridkv_transfer_config``, and the same reserved CPU so every engine computes on the same cores.)
- ``none``: no connector: the floor (vLLM's local prefix cache only).

Counted per configuration and round, from ``/metrics`` deltas over the replay (``hybridkv_dev.bench.serve.counters``):
prompt tokens (the replay's own sum; vLLM's counter is reported next to it), external hit tokens
(``vllm:external_prefix_cache_hits_total``: what the connector loaded, the same counter for every
connector) and local hit tokens, their shares of the prompt tokens, TTFT p50/p99 over the requests that
succeeded, failed requests, and store bytes written: hybridkv's ``vllm:hybridkv_save_bytes_total`` (keys
already stored are skipped, not rewritten), Mooncake's ``vllm:mooncake_store_operation_bytes_total`` of its
``save_put`` operations (after its own existence check; statuses ``ok`` and ``partial_failure``), ``None``
for ``none`` (no store). The share served from the store over the trace (the plot) is the external hit
share per window of requests (counters read at each window's end, the first round).

Rounds: round ``r`` builds the trace of seed ``seed + r`` (its own working set and C) and runs every
configuration on it in an order rotated by ``r``, each on a fresh server and store; figures are medians over
rounds with [min, max], and the points against ``file-lru`` are taken per round (same trace) first.
"""

from __future__ import annotations

from hybridkv_dev.bench.agentic_serve.bench import (
    run_agentic_serve_bench,
)
from hybridkv_dev.bench.agentic_serve.replay import (
    replay_trace,
)
from hybridkv_dev.bench.agentic_serve.table import (
    TABLE_COLUMNS,
    describe_report,
    plot_report,
)
from hybridkv_dev.bench.agentic_serve.trace import (
    BASELINE,
    CONFIGURATIONS,
    MOONCAKE_CONFIGURATION,
    SESSIONS_CONFIGURATION,
    ReplayRequest,
    ServeSetup,
    ServeTrace,
    attention_block_bytes,
    build_serve_trace,
    request_body,
    serve_workload,
)
from hybridkv_dev.bench.agentic_serve.trace import (
    bench_model as bench_model,
)

__all__ = [
    "BASELINE",
    "CONFIGURATIONS",
    "MOONCAKE_CONFIGURATION",
    "SESSIONS_CONFIGURATION",
    "TABLE_COLUMNS",
    "ReplayRequest",
    "ServeSetup",
    "ServeTrace",
    "attention_block_bytes",
    "build_serve_trace",
    "describe_report",
    "plot_report",
    "replay_trace",
    "request_body",
    "run_agentic_serve_bench",
    "serve_workload",
]
