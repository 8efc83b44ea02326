"""The load on one server: the multi-turn sessions, the eviction probe, and the counters read around them."""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hybridkv_dev.bench.record import RequestRecord, request_record
from hybridkv_dev.bench.serve.workload import Workload, conversation_messages, seeded_words
from hybridkv_dev.devkit.openai_server import (
    metric,
    metrics_samples,
    stream_request,
)

# --- the load -----------------------------------------------------------------------------------------------


#: Prometheus counters read as deltas around each phase: vLLM's (local and external prefix hits, requests)
#: and the connector's own.
_VLLM_COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "local_query_tokens": "vllm:prefix_cache_queries_total",
    "local_hit_tokens": "vllm:prefix_cache_hits_total",
    "external_query_tokens": "vllm:external_prefix_cache_queries_total",
    "external_hit_tokens": "vllm:external_prefix_cache_hits_total",
    "requests_succeeded": "vllm:request_success_total",
    "preemptions": "vllm:num_preemptions_total",
}


#: vLLM's per-request phase histograms (sum and count): where a request's time goes, seen by the engine.
VLLM_PHASES = {
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
}


def counters(samples: Mapping[str, float]) -> dict[str, float]:
    """vLLM's prefix-cache counters, its per-request phase histograms (``<phase>_s_sum``/``_count``) and every
    ``vllm:hybridkv_*_total`` counter, by short name."""
    out = {short: metric(samples, name) for short, name in _VLLM_COUNTERS.items()}
    for phase, name in VLLM_PHASES.items():
        out[f"{phase}_s_sum"] = metric(samples, f"{name}_sum")
        out[f"{phase}_s_count"] = metric(samples, f"{name}_count")
    names = {re.sub(r"\{.*", "", key) for key in samples}
    for name in sorted(names):
        match = re.fullmatch(r"vllm:hybridkv_(\w+)_total", name)
        if match and match.group(1) != "group_loaded_blocks":
            out[f"hybridkv_{match.group(1)}"] = metric(samples, name)
    return out


def _delta(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def _settled_counters(base_url: str, num_succeeded: float, timeout_s: float = 10.0) -> dict[str, float]:
    """Counters once ``num_succeeded`` requests are counted (stats reach the API server with engine outputs)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = counters(metrics_samples(base_url))
        if now["requests_succeeded"] >= num_succeeded or time.monotonic() > deadline:
            time.sleep(0.3)  # the connector's counters ride on the next stats message
            return counters(metrics_samples(base_url))
        time.sleep(0.2)


@dataclass
class LoadResult:
    records: list[RequestRecord] = field(default_factory=list)
    per_turn: list[dict[str, float]] = field(default_factory=list)
    probe: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    totals: dict[str, float] = field(default_factory=dict)


def run_load(
    base_url: str,
    workload: Workload,
    *,
    progress: Callable[[int], None] | None = None,
    probe: bool = True,
) -> LoadResult:
    """Drive ``workload`` against the server at ``base_url``; never raises on a failed request."""
    result = LoadResult()
    answers: dict[int, list[str]] = {s: [] for s in range(workload.num_sessions)}
    start_counters = counters(metrics_samples(base_url))
    num_sent = 0

    def one_turn(session: int, turn: int) -> RequestRecord:
        body = {
            "model": "tiny",
            "messages": conversation_messages(workload, session, answers[session]),
            "max_tokens": workload.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        if workload.num_top_logprobs:
            body.update(logprobs=True, top_logprobs=workload.num_top_logprobs)
        record = request_record("turn", session, turn, stream_request(base_url, "/v1/chat/completions", body))
        if progress is not None:
            progress(1)
        return record

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workload.concurrency, thread_name_prefix="client") as pool:
        for turn in range(workload.num_turns):
            before = counters(metrics_samples(base_url))
            records = list(pool.map(lambda s, t=turn: one_turn(s, t), range(workload.num_sessions)))
            num_sent += len(records)
            for record in records:
                # A failed turn still continues the conversation (with an empty answer), so later turns run.
                answers[record.session].append(record.text if record.ok else "(no answer)")
            result.records.extend(records)
            after = _settled_counters(base_url, start_counters["requests_succeeded"] + num_sent)
            result.per_turn.append({"turn": float(turn), **_delta(after, before)})
        if probe:
            result.probe = _eviction_probe(base_url, workload, result, progress)
    result.wall_s = time.perf_counter() - start
    num_probe = sum(1 for r in result.records if r.phase != "turn")
    end = _settled_counters(base_url, start_counters["requests_succeeded"] + num_sent + num_probe)
    result.totals = _delta(end, start_counters)
    return result


def _eviction_probe(
    base_url: str, workload: Workload, result: LoadResult, progress: Callable[[int], None] | None
) -> dict[str, float]:
    """The seed protocol, one request at a time: target, unique long prompts, target again. Returns the
    counter deltas of the final reuse request."""
    rng = random.Random(f"probe-{workload.seed}")
    target = "Probe target. " + seeded_words(rng, workload.evict_prompt_words)
    body: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": workload.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if workload.num_top_logprobs:
        body["logprobs"] = workload.num_top_logprobs

    def send(phase: str, index: int, prompt: str) -> RequestRecord:
        record = request_record(
            phase, -1, index, stream_request(base_url, "/v1/completions", {**body, "prompt": prompt})
        )
        result.records.append(record)
        if progress is not None:
            progress(1)
        return record

    sent_before = counters(metrics_samples(base_url))["requests_succeeded"]
    send("probe-target", 0, target)
    for index in range(workload.num_evict_prompts):
        send(
            "probe-evict", index, f"Unique prompt {index}. " + seeded_words(rng, workload.evict_prompt_words)
        )
    before = _settled_counters(base_url, sent_before + 1 + workload.num_evict_prompts)
    send("probe-reuse", 0, target)
    after = _settled_counters(base_url, sent_before + 2 + workload.num_evict_prompts)
    return _delta(after, before)
