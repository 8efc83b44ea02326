"""``hybridkv bench serve``: the OpenAI server under a multi-turn load, with and without an external KV tier.

Per configuration one server process (``python -m vllm.entrypoints.openai.api_server``) with a local KV cache
deliberately smaller than the working set, driven over HTTP by ``concurrency`` client threads (the official
``openai`` SDK, through ``hybridkv_dev.devkit.openai_server.stream_request``):

- **multi-turn**: ``num_sessions`` conversations of ``num_turns`` turns through ``/v1/chat/completions``
  (streamed, greedy). Each turn resends the whole conversation: one of ``num_system_prompts`` system prompts
  shared across sessions, the user turns so far and the model's previous answers. Turns run in rounds (every
  session's turn 1, then every session's turn 2, ...), so between two turns of a session every other session
  runs one: the local cache has evicted the conversation by the time it comes back.
- **eviction probe** (the seed protocol): a target prompt, ``num_evict_prompts`` unique long prompts that push
  it out of the local cache, then the target again (``/v1/completions``).

Configurations: ``none`` (vLLM's local prefix cache only), ``hybridkv-file`` (the embedded file store),
``hybridkv-mooncake`` and ``mooncake-store`` (vLLM's in-tree ``MooncakeStoreConnector``) on one
``mooncake_master`` that the bench starts on 127.0.0.1 (run it inside a private network namespace: Mooncake
clients listen on 0.0.0.0). Plus ``hybridkv-chaos`` (a ``faulty+file://`` store that fails and corrupts) and
``hybridkv-full`` (a file store smaller than the working set). The stores hold the same bytes
(``ServerShape.store_capacity``): the file store's capacity, the peer's one global segment, and
``hybridkv-mooncake``'s two segments of half that (its scheduler and its worker each mount one).

Per configuration: TTFT (time to the first streamed content chunk) mean/p50/p99, end-to-end latency,
requests/s and output tokens/s, local and external hit tokens (``/metrics`` deltas, per turn), hybridkv's own
counters, errors, and greedy-token agreement with the ``none`` run (and of ``none`` with itself in a second
pass, where batching alone may change greedy tokens), with the reference's top-2 log-probability gap where
they differ (a flipped bfloat16 tie is about 0). After the load: nothing running or waiting,
``POST /reset_prefix_cache`` succeeds (no blocks stay pinned), the audit log is clean and every lifecycle in
it terminated.

Exactness (the **serial pass**): before its load, each configuration's server runs a few sessions one request
at a time, its evicted prefixes coming back from its tier; a no-connector server whose local cache keeps every
prefix runs the same requests. An external hit restores exactly what a local hit keeps, so hybridkv's greedy
tokens must equal that server's. (Not the small-cache ``none`` server's: a prefix recomputed after eviction
rounds differently and may flip a tie.) Every server computes on the same CPU cores
(``ServerShape.reserved_cpus``).

Repeated runs (``summarize_runs``): configurations run in the order given, so repeated runs rotate it
(``rotated``); the summary takes every ratio per run, then its median and [min, max], judges ``TARGETS`` at
those medians, and breaks each turn's time down (client TTFT, vLLM's queue and prefill, hybridkv's load job).

``--trace`` (``ServerShape.step_trace``): the hybridkv servers log one event per scheduler step, and the report's
``trace`` follows each resent-turn hit from its send through the steps to its first token, with every
configuration's vLLM queue and prefill time on those turns (``hybridkv_dev.bench.serve.trace``).
"""

from __future__ import annotations

from hybridkv.bench.harness import rotated

from hybridkv_dev.bench.record import RequestRecord as RequestRecord
from hybridkv_dev.bench.serve.bench import (
    ConfigRun as ConfigRun,
)
from hybridkv_dev.bench.serve.bench import (
    build_report as build_report,
)
from hybridkv_dev.bench.serve.bench import (
    run_serve_bench,
)
from hybridkv_dev.bench.serve.configuration import (
    audit_summary as audit_summary,
)
from hybridkv_dev.bench.serve.configuration import (
    check_after_load as check_after_load,
)
from hybridkv_dev.bench.serve.configuration import (
    divergence as divergence,
)
from hybridkv_dev.bench.serve.load import (
    LoadResult as LoadResult,
)
from hybridkv_dev.bench.serve.load import (
    counters as counters,
)
from hybridkv_dev.bench.serve.load import (
    run_load as run_load,
)
from hybridkv_dev.bench.serve.runs import (
    summarize_runs,
)
from hybridkv_dev.bench.serve.servers import (
    ServerShape as ServerShape,
)
from hybridkv_dev.bench.serve.servers import (
    local_cache_tokens as local_cache_tokens,
)
from hybridkv_dev.bench.serve.table import (
    format_runs_table,
    format_serve_table,
    plot_serve,
)
from hybridkv_dev.bench.serve.workload import (
    CONFIGS,
    EXACT_CONFIGS,
    Workload,
    conversation_messages,
)

__all__ = [
    "CONFIGS",
    "EXACT_CONFIGS",
    "Workload",
    "conversation_messages",
    "format_runs_table",
    "format_serve_table",
    "plot_serve",
    "rotated",
    "run_serve_bench",
    "summarize_runs",
]
