"""The OpenAI server with ``HybridStoreConnector`` under a multi-turn load, with a local KV cache too small
for the sessions (``hybridkv bench serve``'s load at CI size).

One server per test (a tiny GDN hybrid, text prompts through the model's tokenizer and chat template, a local
KV cache of about 10 blocks), the same workload as the bench (``hybridkv.bench.serve.run_load``):
sessions x turns through streamed ``/v1/chat/completions``, each turn resending the conversation, then the
eviction probe (a prompt, unique long prompts, the prompt again through ``/v1/completions``).

What must hold: no failed request; resent turns and the probe's reuse take their prefix from the store
once the local cache evicted it; greedy tokens at concurrency 1 do not depend on where a prefix came from
(they equal a no-connector server's whose local cache keeps every prefix, and a second pass after
``reset_prefix_cache``, every prefix then from the store, gives the same tokens);
after the load nothing runs or waits and the local prefix cache resets (no block stays pinned); the audit
log replays cleanly and every lifecycle in it terminated. The second test does it through a chaos store
(failed and corrupted gets, failed puts) whose capacity is smaller than the working set.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from hybridkv.bench.serve import LoadResult, divergence, run_load
from hybridkv.devkit.openai_server import metric, metrics_samples, vllm_bench_serve_command
from support.serve import WORKLOAD, assert_clean_after, assert_no_errors, make_server

# Each test starts one server (about 20 s on an idle 2-core host, minutes on a busy one) and sends ~110 requests.
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1800)]


def _tokens(load: LoadResult) -> dict[tuple[str, int, int], list[int]]:
    return {(r.phase, r.session, r.turn): r.token_ids for r in load.records}


def test_multi_turn_load_external_hits_exact_tokens_nothing_pinned(tmp_path: Path) -> None:
    # The reference: no connector, a local cache that keeps every prefix (every resent turn a local hit).
    reference_server = make_server(
        tmp_path, None, None, max_num_seqs=1, kv_cache_bytes=64 << 20, name="reference"
    )
    try:
        reference_server.wait_healthy()
        reference = run_load(reference_server.base_url, WORKLOAD)
    finally:
        reference_server.stop()
    assert_no_errors(reference, "reference")
    assert reference.totals["local_hit_tokens"] > 0 and reference.totals["preemptions"] == 0, reference.totals

    audit = tmp_path / "audit.jsonl"
    server = make_server(tmp_path, f"file://{tmp_path}/store?capacity=256MiB", audit, max_num_seqs=3)
    try:
        server.wait_healthy()
        first = run_load(server.base_url, WORKLOAD)
        assert_no_errors(first, "concurrency 1")
        # Resent turns: the conversation so far was evicted locally by the other sessions' turns.
        for turn in first.per_turn[1:]:
            assert turn["external_hit_tokens"] >= 128, f"no external hit on resent turn: {first.per_turn}"
        assert first.probe["external_hit_tokens"] >= 128, f"probe reuse missed the store: {first.probe}"
        assert first.totals["hybridkv_load_failed_keys"] == 0, first.totals
        # An external hit restores exactly what a local hit keeps: one request at a time, the same greedy
        # tokens as the server that never evicted, request by request.
        assert divergence(first.records, reference.records).differing == (), "tokens differ from a local hit"
        assert _tokens(first) == _tokens(reference)

        # Every prefix from the store now: the same greedy tokens, request by request.
        server.reset_prefix_cache()
        again = run_load(server.base_url, WORKLOAD)
        assert_no_errors(again, "concurrency 1, second pass")
        assert _tokens(again) == _tokens(first), "greedy tokens depend on where the prefix came from"
        assert again.totals["external_hit_tokens"] > first.totals["external_hit_tokens"], (
            first.totals,
            again.totals,
        )

        # Concurrency 3 on a cache that holds about one conversation: waiting, preemption, loads and saves
        # interleave.
        server.reset_prefix_cache()
        loaded = run_load(server.base_url, replace(WORKLOAD, concurrency=3))
        assert_no_errors(loaded, "concurrency 3")
        assert loaded.totals["external_hit_tokens"] > 0, loaded.totals
        samples = metrics_samples(server.base_url)
        assert metric(samples, "vllm:hybridkv_load_failed_keys_total") == 0
        assert metric(samples, "vllm:hybridkv_save_failed_keys_total") == 0

        # vLLM's own client drives the same server: chat completions, random prompts of its tokenizer.
        flags = [
            "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
            "--dataset-name", "random", "--random-input-len", "300", "--random-output-len", "8",
            "--num-prompts", "4", "--max-concurrency", "2", "--ignore-eos", "--disable-tqdm",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "vllm-bench.json",
        ]  # fmt: skip
        bench = subprocess.run(
            vllm_bench_serve_command(server.base_url, Path(server.model), *flags),
            check=False,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert bench.returncode == 0, bench.stdout[-2000:] + bench.stderr[-2000:]
        result = json.loads((tmp_path / "vllm-bench.json").read_text())
        assert result["completed"] == 4 and result["failed"] == 0, result
        assert_clean_after(server, audit)
    finally:
        server.stop()


def test_multi_turn_load_chaos_store_smaller_than_working_set(tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    # 6 MiB hold about 10 blocks of this model (both groups), about half of what the sessions save: the
    # store evicts while the load runs. (At 3 MiB, with these fault rates, a run sometimes found no hit at
    # all to restore: two or three hits per run, each possibly failed or corrupted.)
    store = (
        f"faulty+file://{tmp_path}/store?capacity=6MiB"
        "&get_fail=0.15&put_fail=0.1&exists_fail=0.05&corrupt=0.1&seed=3"
    )
    server = make_server(tmp_path, store, audit, max_num_seqs=3)
    try:
        server.wait_healthy()
        first = run_load(server.base_url, WORKLOAD)
        assert_no_errors(first, "chaos, concurrency 1")
        server.reset_prefix_cache()
        again = run_load(server.base_url, WORKLOAD)
        assert_no_errors(again, "chaos, concurrency 1, second pass")
        # Failed and corrupted loads are recomputed: the tokens never change.
        assert _tokens(again) == _tokens(first), "greedy tokens changed under store faults"
        loaded = run_load(server.base_url, replace(WORKLOAD, concurrency=3))
        assert_no_errors(loaded, "chaos, concurrency 3")
        samples = metrics_samples(server.base_url)
        faults = metric(samples, "vllm:hybridkv_load_failed_keys_total") + metric(
            samples, "vllm:hybridkv_save_failed_keys_total"
        )
        assert faults > 0, "the chaos store injected no fault the connector saw"
        assert metric(samples, "vllm:external_prefix_cache_hits_total") > 0, "no hit survived the chaos"
        assert_clean_after(server, audit)
    finally:
        server.stop()
