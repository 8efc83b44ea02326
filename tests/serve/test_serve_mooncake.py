"""The OpenAI server with ``HybridStoreConnector`` on a real ``mooncake_master`` under the multi-turn load
(``hybridkv bench serve``'s ``hybridkv-mooncake`` configuration at CI size).

One master on 127.0.0.1 and one server whose connector halves are Mooncake clients in embedded mode (each
mounts a segment), the local KV cache about a third of the working set. The load of
``tests/serve/test_serve_load.py``: sessions x turns through streamed ``/v1/chat/completions``, each turn
resending the conversation, then the eviction probe; once one request at a time, then three at a time.

What must hold: no failed request; resent turns and the probe's reuse take their prefix from Mooncake once the
local cache evicted it, with no failed load or save; after the load nothing runs or waits, the local prefix
cache resets (no block stays pinned), and the audit log replays cleanly with every lifecycle terminated.

Run with ``scripts/netns-run .venv/bin/python -m pytest tests/serve/test_serve_mooncake.py``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hybridkv_dev.bench.serve import run_load
from hybridkv_dev.devkit.openai_server import metric, metrics_samples
from support.mooncake import new_master
from support.serve import WORKLOAD, assert_clean_after, assert_no_errors, make_server

# One master and one server (about 20 s to start on an idle 2-core host), ~35 requests.
pytestmark = [pytest.mark.slow, pytest.mark.mooncake, pytest.mark.vllm, pytest.mark.timeout(1800)]


def test_multi_turn_load_on_mooncake_external_hits_nothing_pinned(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    master = new_master(tmp_path_factory)
    audit = tmp_path / "audit.jsonl"
    # Each connector half mounts its own segment; the working set (~40 blocks of both groups) fits in one.
    store = master.url(segment="128MiB", local_buffer="32MiB", timeout_ms=2000)
    server = make_server(tmp_path, store, audit, max_num_seqs=3)
    try:
        server.wait_healthy()
        first = run_load(server.base_url, WORKLOAD)
        assert_no_errors(first, "mooncake, concurrency 1")
        for turn in first.per_turn[1:]:
            assert turn["external_hit_tokens"] >= 128, f"no external hit on resent turn: {first.per_turn}"
        assert first.probe["external_hit_tokens"] >= 128, f"probe reuse missed Mooncake: {first.probe}"

        server.reset_prefix_cache()
        loaded = run_load(server.base_url, replace(WORKLOAD, concurrency=3))
        assert_no_errors(loaded, "mooncake, concurrency 3")
        assert loaded.totals["external_hit_tokens"] > 0, loaded.totals
        samples = metrics_samples(server.base_url)
        assert metric(samples, "vllm:hybridkv_load_failed_keys_total") == 0
        assert metric(samples, "vllm:hybridkv_save_failed_keys_total") == 0
        assert_clean_after(server, audit)
    finally:
        server.stop()
        master.stop()
