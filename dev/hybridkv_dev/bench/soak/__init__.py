"""``hybridkv bench soak``: a long run of the OpenAI server that proves nothing leaks.

One server (``python -m vllm.entrypoints.openai.api_server``) with ``HybridStoreConnector`` on a chaos view of a
file store (``faulty+file://``: failed, corrupted and late gets and puts) whose capacity is below the working set,
and a local KV cache smaller than the working set too. Client threads send a fixed number of multi-turn chat
requests (streamed, greedy): ``num_sessions`` conversations are open at once, each ``num_turns`` turns long
(each turn resends the conversation), and a finished conversation's slot goes to a new one. Mixed in: every
``abort_every``-th request is aborted mid-stream (the client closes the stream after its first chunk), and after
every ``reset_every``-th request its client thread sends ``POST /reset_prefix_cache`` while the other threads'
requests run (every other reset also resets the connector: ``?reset_external=true``).

Every ``sample_every`` requests (at the end of the round that reaches it) the load pauses, the server is
settled (``settle``: a one-token request makes the engine step, so the connector's gauges are fresh) and one
sample is taken (``take_sample``):

- the server's processes (``/proc/<pid>`` of the API server and every descendant, the engine core among them):
  resident memory (``VmRSS``), threads (``task/``), open file descriptors (``fd/``), the number of processes;
- the connector's gauges on ``/metrics`` (docs/metrics.md): requests it follows, blocks pinned by save jobs,
  save bytes in flight, staging bytes out, late store calls pending, audit records queued; vLLM's requests
  running and waiting;
- the store's files (``hybridkv.store.file.layout``): ``objects/`` (count, bytes), ``tmp/``, ``spare/``.

Then a serial exactness pass: the same sessions one request at a time, once before the load and once after
it, each after a local and a connector reset: a soaked server must give its fresh self's greedy tokens exactly
(failed and corrupted loads recompute; nothing a late call wrote may reach a request). Compared request by
request with ``hybridkv_dev.bench.serve.divergence``.

Before all that (``baseline``, the default), the same load on a server without the connector: vLLM's own
memory drift under this load (its CPU worker's allocators grow for hundreds of requests), which the memory
bound is relative to. Every request has a deadline (``request_timeout_s``): a stranded request fails the run
instead of hanging it.

Verdict (``analyze_series``): per series, the samples after the warm-up cut (the first ``warmup_fraction``
of them), their least-squares slope per 100 requests, their spread (max - min) and rise (their max minus the
warm-up's max), each against the series' bounds (``series_bounds``; every bound says why it is that number).
The run passes when every series is within its bounds, no request failed (aborted ones excepted), none is
stranded (vLLM runs and queues nothing once settled, the connector follows nothing, every audit lifecycle
terminated), the audit log replays clean and the two serial passes are token-identical.

Samples are taken with the engine settled, not under load: what a series shows is what stays held between
requests, which is where a leak accumulates. ``settle`` waits at most a few seconds for late calls (``late_ms``)
to return: a hold that outlives that is reported.
"""

from __future__ import annotations

from hybridkv_dev.bench.soak.load import (
    LoadOutcome as LoadOutcome,
)
from hybridkv_dev.bench.soak.load import (
    SoakRequest as SoakRequest,
)
from hybridkv_dev.bench.soak.plan import (
    CONNECTOR_GAUGES,
    HELD_GAUGES,
    SoakPlan,
)
from hybridkv_dev.bench.soak.plan import (
    DEFAULT_CHAOS as DEFAULT_CHAOS,
)
from hybridkv_dev.bench.soak.plan import (
    SOAK_WORKLOAD as SOAK_WORKLOAD,
)
from hybridkv_dev.bench.soak.run import (
    run_soak,
)
from hybridkv_dev.bench.soak.samples import (
    connector_sample,
    process_tree,
    process_tree_sample,
    settle,
    store_files_sample,
    take_sample,
)
from hybridkv_dev.bench.soak.table import (
    SERIES_COLUMNS,
    format_soak_table,
    plot_soak,
)
from hybridkv_dev.bench.soak.table import (
    build_soak_report as build_soak_report,
)
from hybridkv_dev.bench.soak.verdict import (
    SeriesBound,
    analyze_series,
    series_bounds,
)
from hybridkv_dev.bench.soak.verdict import (
    least_squares_slope as least_squares_slope,
)

__all__ = [
    "CONNECTOR_GAUGES",
    "HELD_GAUGES",
    "SERIES_COLUMNS",
    "SeriesBound",
    "SoakPlan",
    "analyze_series",
    "connector_sample",
    "format_soak_table",
    "plot_soak",
    "process_tree",
    "process_tree_sample",
    "run_soak",
    "series_bounds",
    "settle",
    "store_files_sample",
    "take_sample",
]
