"""The OpenAI server of the multi-turn load tests (``tests/serve/test_serve_load.py`` and
``tests/serve/test_serve_mooncake.py``): the CI-size workload, a server over a tiny GDN hybrid with a local KV
cache too small for the sessions, and the checks after a load."""

from __future__ import annotations

from pathlib import Path

from hybridkv.demo.tiny_models import DEFAULT_MODELS_DIR, build_tiny_model
from hybridkv_dev.bench.serve import LoadResult, Workload, audit_summary, check_after_load
from hybridkv_dev.devkit.openai_server import OpenAIServer, hybridkv_transfer_config

#: CI size: 4 sessions x 3 turns, turn prompts of ~200-750 tokens (1-6 blocks of 128).
WORKLOAD = Workload(
    num_sessions=4,
    num_turns=3,
    concurrency=1,
    num_system_prompts=2,
    system_prompt_words=60,
    user_turn_words=50,
    max_tokens=8,
    num_evict_prompts=3,
    evict_prompt_words=250,
)
#: About 12 blocks of 128 tokens for both KV groups together (vLLM: ~1,100 tokens): about a third of the
#: working set, and the smallest cache that admits a 1,024-token request.
KV_CACHE_BYTES = 6 << 20
MAX_MODEL_LEN = 1024
#: The same OpenMP cores with and without a connector (vLLM reserves one more core when one is configured):
#: a different thread count rounds differently in bfloat16 and flips greedy ties.
SAME_CORES_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def make_server(
    tmp_path: Path,
    store: str | None,
    audit: Path | None,
    *,
    max_num_seqs: int,
    kv_cache_bytes: int = KV_CACHE_BYTES,
    name: str = "server",
    step_trace: bool = False,
) -> OpenAIServer:
    """The load tests' server: ``store`` None runs no connector; ``step_trace`` logs the connector's
    ``hybridkv step`` events (``hybridkv_dev.bench.serve.trace``)."""
    model = build_tiny_model("qwen3_next", DEFAULT_MODELS_DIR)
    kv = None
    if store is not None:
        trace = {"step_trace": True} if step_trace else {}
        kv = hybridkv_transfer_config(store, namespace="serve-load", audit_log=str(audit), **trace)
    return OpenAIServer(
        model,
        tmp_path / f"{name}.log",
        kv_transfer_config=kv,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=MAX_MODEL_LEN,
        kv_cache_memory_bytes=kv_cache_bytes,
        extra_env=SAME_CORES_ENV,
    )


def assert_no_errors(load: LoadResult, what: str) -> None:
    failed = [(r.phase, r.session, r.turn, r.error) for r in load.records if not r.ok]
    assert not failed, f"{what}: failed requests {failed}"
    expected = WORKLOAD.num_sessions * WORKLOAD.num_turns + WORKLOAD.num_evict_prompts + 2
    assert len(load.records) == expected, f"{what}: {len(load.records)} requests, expected {expected}"


def assert_clean_after(server: OpenAIServer, audit: Path) -> None:
    after = check_after_load(server, None)
    assert after["running"] == 0 and after["waiting"] == 0, f"requests left after the load: {after}"
    assert after["reset_attempts"] is not None, "the local prefix cache never reset: blocks stay pinned"
    rc = server.stop()
    assert rc is not None, "server did not exit within the timeout after SIGINT"
    summary = audit_summary(audit)
    assert summary["audit_ok"] is True, f"audit log violations: {summary}"
    assert summary["audit_lifecycles"] > 0, "the audit log recorded no lifecycle"
    assert summary["audit_unterminated"] == 0, f"lifecycles left open after shutdown: {summary}"
    assert summary["audit_dropped"] == 0, summary
    log = server.log_text()
    assert " ERROR " not in log.partition("shutdown triggered")[0], "errors while serving"
