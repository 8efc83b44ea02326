"""Time to first token through a real in-process vLLM engine (``hybridkv bench ttft``), as pure functions
returning dicts.

One engine per family with ``HybridStoreConnector`` on a ``file://`` store (under ``/dev/shm`` when present).
Every round uses a fresh random prompt and times ``llm.generate`` of one request with ``max_tokens=1``
(wall clock, so scheduling, the connector's lookup, the load and the forward are all inside):

- ``cold``: the prompt was never seen (full prefill; the connector saves its blocks),
- ``local``: the same prompt again (vLLM's own device prefix cache hits),
- ``external``: the same prompt after ``llm.reset_prefix_cache()``, which drops the device prefix cache and
  keeps the store, so the prefix comes from this connector.

Saves run off the forward path; each timed request starts with the previous one's saves flushed (untimed),
so the measurements do not overlap a background write. A warm-up round (same steps, other prompt) is not
counted. Medians over rounds; the bytes the external hit loaded come from the worker's own ``load_bytes``
counter, and the copy floor divides them by a ``memcpy`` (``numpy.copyto``) of the same value size and count
measured in the same run.

Baselines, each its own engine on the same machine in the same run:

- ``baseline=True`` (non-hybrid families): vLLM's in-tree ``ExampleConnector`` (safetensors files per request,
  no HMA) on the same scratch filesystem, prefix caching off (as it requires), the same prompt sent twice: the
  second send is its external hit; its overhead uses the file-store engine's local hits.
- ``mooncake=True``: the bench starts a ``mooncake_master`` on 127.0.0.1 (so it must run in a loopback-only
  network namespace: ``scripts/netns-run hybridkv bench ttft --mooncake``) and adds hybridkv on ``mooncake://``
  and vLLM's in-tree ``MooncakeStoreConnector`` (embedded segment, TCP, non-hybrid families) with the same
  protocol. The latter runs in a spawned child that writes its samples and exits hard: in-process, its
  engine's teardown hangs in ``zmq.Context.term``.

Each row's overhead is the median over rounds of (external - local) of the same engine, with its [min, max];
it is divided by the memcpy floor (measured in this process) and by ``MooncakeStoreConnector``'s overhead.
The hit profile splits a hybridkv hit: lookup and load wall time from the connector's audit log
(``monotonic`` of ``lookup_started`` / ``hit_found`` / ``load_started`` / ``load_verified``), and the store's
own read, verify and a memcpy of the same bytes from a microbench in this process (``PROFILE_SOURCES``).
"""

from __future__ import annotations

from hybridkv_dev.bench.ttft.bench import (
    run_ttft_bench,
)
from hybridkv_dev.bench.ttft.connectors import (
    measure_mooncake_store_connector,
)
from hybridkv_dev.bench.ttft.engine import (
    DEFAULT_FAMILIES,
    default_scratch_dir,
    measure_store_path,
)
from hybridkv_dev.bench.ttft.engine import (
    _load_profile_from_audit as _load_profile_from_audit,
)
from hybridkv_dev.bench.ttft.rows import (
    PEER_CONNECTOR,
    PROFILE_COLUMNS,
    PROFILE_SOURCES,
    TABLE_COLUMNS,
    plot_report,
)
from hybridkv_dev.bench.ttft.rows import (
    _row as _row,
)

__all__ = [
    "DEFAULT_FAMILIES",
    "PEER_CONNECTOR",
    "PROFILE_COLUMNS",
    "PROFILE_SOURCES",
    "TABLE_COLUMNS",
    "default_scratch_dir",
    "measure_mooncake_store_connector",
    "measure_store_path",
    "plot_report",
    "run_ttft_bench",
]
