"""``hybridkv bench serve``: the OpenAI server under a multi-turn load, with and without an external KV tier.

Per configuration one server process (``python -m vllm.entrypoints.openai.api_server``) with a local KV cache
deliberately smaller than the working set, driven over HTTP by ``concurrency`` client threads (the official
``openai`` SDK, through ``hybridkv.devkit.openai_server.stream_request``):

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
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from hybridkv.devkit.mooncake import MooncakeMaster
from hybridkv.devkit.net import NETNS_HINT, loopback_only_namespace
from hybridkv.devkit.openai_server import (
    OpenAIServer,
    StreamResult,
    hybridkv_transfer_config,
    metric,
    metrics_samples,
    stream_request,
)
from hybridkv.store.params import parse_size

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

CONFIGS: tuple[str, ...] = (
    "none",
    "hybridkv-file",
    "hybridkv-mooncake",
    "mooncake-store",
    "hybridkv-chaos",
    "hybridkv-full",
)
MOONCAKE_CONFIGS = frozenset({"hybridkv-mooncake", "mooncake-store"})
#: Configurations whose serial pass must reproduce the reference's greedy tokens exactly: every evicted prefix
#: comes back from the store (no faults, room for all of it).
EXACT_CONFIGS = frozenset({"hybridkv-file", "hybridkv-mooncake"})
#: Faults of ``hybridkv-chaos``: failed and corrupted gets, failed puts and existence checks.
CHAOS_PARAMS = "get_fail=0.1&put_fail=0.1&exists_fail=0.05&corrupt=0.05&seed=7"

_WORDS = [
    "cache",
    "store",
    "block",
    "prefix",
    "token",
    "session",
    "turn",
    "answer",
    "question",
    "model",
    "layer",
    "state",
    "window",
    "memory",
    "latency",
    "request",
    "system",
    "user",
    "engine",
    "worker",
    "scheduler",
    "load",
    "save",
    "evict",
    "hit",
    "miss",
    "key",
    "value",
    "batch",
    "stream",
    "queue",
    "policy",
    "budget",
    "replica",
    "master",
    "segment",
    "lease",
    "timeout",
    "retry",
    "audit",
    "metric",
    "counter",
    "gauge",
    "trace",
    "config",
]


@dataclass(frozen=True)
class Workload:
    """What the clients send. Sizes are in words (about 3.3 tokens each with the tiny models' tokenizer)."""

    num_sessions: int = 16
    num_turns: int = 4
    concurrency: int = 2
    num_system_prompts: int = 2
    system_prompt_words: int = 100
    user_turn_words: int = 60
    max_tokens: int = 16
    num_evict_prompts: int = 6
    evict_prompt_words: int = 400
    seed: int = 0
    #: top log-probabilities asked per generated token (0: none): how near a tie each greedy choice was,
    #: which tells batching noise from a wrong token where two runs disagree
    num_top_logprobs: int = 2

    def __post_init__(self) -> None:
        for name in ("num_sessions", "num_turns", "concurrency", "num_system_prompts", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"Workload.{name} must be >= 1, got {getattr(self, name)}")


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def system_prompt(workload: Workload, index: int) -> str:
    rng = random.Random(f"system-{workload.seed}-{index}")
    return f"You are assistant number {index}. " + _words(rng, workload.system_prompt_words)


def user_turn(workload: Workload, session: int, turn: int) -> str:
    rng = random.Random(f"user-{workload.seed}-{session}-{turn}")
    return f"Session {session}, question {turn}: " + _words(rng, workload.user_turn_words) + "?"


def conversation_messages(workload: Workload, session: int, answers: Sequence[str]) -> list[dict[str, str]]:
    """The messages of ``session``'s turn ``len(answers)``: its system prompt, then each earlier user turn
    followed by the model's answer to it, then the new user turn."""
    messages = [{"role": "system", "content": system_prompt(workload, session % workload.num_system_prompts)}]
    for turn, answer in enumerate(answers):
        messages.append({"role": "user", "content": user_turn(workload, session, turn)})
        messages.append({"role": "assistant", "content": answer})
    messages.append({"role": "user", "content": user_turn(workload, session, len(answers))})
    return messages


# --- the load -----------------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    phase: str  # "turn" | "probe-target" | "probe-evict" | "probe-reuse"
    session: int
    turn: int
    ok: bool
    error: str | None
    ttft_s: float | None
    latency_s: float
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int]
    text: str
    #: the response id (vLLM's request id in the audit log is this plus a suffix)
    response_id: str = ""
    #: per generated token, the log-probability gap between the chosen token and the runner-up (greedy: how
    #: near a tie the choice was); empty when the load did not ask for log-probabilities
    top2_gaps: list[float] = field(default_factory=list)


def _record(phase: str, session: int, turn: int, result: StreamResult) -> RequestRecord:
    return RequestRecord(
        phase=phase,
        session=session,
        turn=turn,
        ok=result.ok,
        error=result.error,
        ttft_s=result.ttft_s,
        latency_s=result.latency_s,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        token_ids=list(result.token_ids),
        text=result.text,
        response_id=result.response_id,
        top2_gaps=[top[0][1] - top[1][1] for top in result.top_logprobs if len(top) >= 2],
    )


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
_VLLM_PHASES = {
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
}


def counters(samples: Mapping[str, float]) -> dict[str, float]:
    """vLLM's prefix-cache counters, its per-request phase histograms (``<phase>_s_sum``/``_count``) and every
    ``vllm:hybridkv_*_total`` counter, by short name."""
    out = {short: metric(samples, name) for short, name in _VLLM_COUNTERS.items()}
    for phase, name in _VLLM_PHASES.items():
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
        record = _record("turn", session, turn, stream_request(base_url, "/v1/chat/completions", body))
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
    target = "Probe target. " + _words(rng, workload.evict_prompt_words)
    body: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": workload.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if workload.num_top_logprobs:
        body["logprobs"] = workload.num_top_logprobs

    def send(phase: str, index: int, prompt: str) -> RequestRecord:
        record = _record(
            phase, -1, index, stream_request(base_url, "/v1/completions", {**body, "prompt": prompt})
        )
        result.records.append(record)
        if progress is not None:
            progress(1)
        return record

    sent_before = counters(metrics_samples(base_url))["requests_succeeded"]
    send("probe-target", 0, target)
    for index in range(workload.num_evict_prompts):
        send("probe-evict", index, f"Unique prompt {index}. " + _words(rng, workload.evict_prompt_words))
    before = _settled_counters(base_url, sent_before + 1 + workload.num_evict_prompts)
    send("probe-reuse", 0, target)
    after = _settled_counters(base_url, sent_before + 2 + workload.num_evict_prompts)
    return _delta(after, before)


# --- servers per configuration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerShape:
    """The server's limits: the local KV cache (bytes) is what the bench makes too small."""

    kv_cache_bytes: int = 12 << 20
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048
    store_capacity: str = "1GiB"
    full_store_capacity: str = "4MiB"
    #: CPU cores vLLM's CPU backend leaves to other processes (``VLLM_CPU_NUM_OF_RESERVED_CPU``), the same
    #: for every configuration: unset, vLLM reserves one core more when any KV connector is configured, so on
    #: a 2-core host the no-connector server would compute on 1 OpenMP thread and every connector server on 2
    #: (a different speed, and different bf16 rounding that flips greedy near-ties).
    reserved_cpus: int = 1
    #: the local cache of the serial pass's reference server: large enough for every prefix to stay local
    reference_kv_cache_bytes: int = 256 << 20

    @property
    def store_capacity_bytes(self) -> int:
        """``store_capacity`` in bytes: every store configuration's size (a Mooncake pool's too)."""
        return parse_size(self.store_capacity, what="store_capacity")


#: Processes of one TP 1 hybridkv server that open its ``mooncake://`` URL, each mounting its ``segment``:
#: the scheduler and the worker.
MOONCAKE_MOUNTS_PER_SERVER = 2


def server_for(
    config: str,
    model: Path,
    workdir: Path,
    shape: ServerShape,
    workload: Workload,
    master: MooncakeMaster | None,
    *,
    log_name: str | None = None,
) -> tuple[OpenAIServer, Path | None]:
    """Start the server of ``config``; returns it and its audit log path (hybridkv configurations)."""
    audit: Path | None = None
    env: dict[str, str] = {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(shape.reserved_cpus)}
    kv: dict[str, Any] | None = None
    store_dir = workdir / f"store-{config}"
    if config.startswith("hybridkv"):
        audit = workdir / f"audit-{config}.jsonl"
        if config == "hybridkv-mooncake":
            assert master is not None, "hybridkv-mooncake needs the mooncake master"
            # The same pool bytes as every other configuration: this URL opens a client in the scheduler
            # and one in the worker, each mounting half of it (puts go to the worker's half first, the
            # default placement).
            segment = shape.store_capacity_bytes // MOONCAKE_MOUNTS_PER_SERVER
            store = f"mooncake://{master.address}?segment={segment}&local_buffer=128MiB&timeout_ms=2000"
            env["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
        elif config == "hybridkv-chaos":
            store = f"faulty+file://{store_dir}?capacity={shape.store_capacity}&{CHAOS_PARAMS}"
        elif config == "hybridkv-full":
            store = f"file://{store_dir}?capacity={shape.full_store_capacity}"
        else:
            store = f"file://{store_dir}?capacity={shape.store_capacity}"
        kv = hybridkv_transfer_config(store, namespace=f"bench-{config}", audit_log=str(audit))
    elif config == "mooncake-store":
        assert master is not None, "mooncake-store needs the mooncake master"
        mooncake_config = workdir / "mooncake-store.json"
        mooncake_config.write_text(
            json.dumps(
                {
                    "mode": "embedded",
                    "metadata_server": "P2PHANDSHAKE",
                    "master_server_address": master.address,
                    # The peer's scheduler has no store client: its one worker mounts the whole pool.
                    "global_segment_size": shape.store_capacity_bytes,
                    "local_buffer_size": 128 << 20,
                    "protocol": "tcp",
                    "device_name": "",
                }
            )
        )
        env.update(MOONCAKE_CONFIG_PATH=str(mooncake_config), MC_TCP_BIND_ADDRESS="127.0.0.1")
        kv = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
    elif config != "none":
        raise ValueError(f"unknown serve configuration {config!r}; expected one of {CONFIGS}")
    server = OpenAIServer(
        model,
        workdir / (log_name or f"server-{config}.log"),
        kv_transfer_config=kv,
        max_model_len=shape.max_model_len,
        max_num_seqs=workload.concurrency,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        kv_cache_memory_bytes=shape.kv_cache_bytes,
        extra_env=env,
    )
    return server, audit


_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")
_CORE_IDS = re.compile(r"local_rank=0, core ids=\[([\d, ]*)\]")


def engine_core_ids(server_log: str) -> list[int] | None:
    """The CPU cores vLLM bound the engine's OpenMP threads to (CPU backend), or None when not logged."""
    match = _CORE_IDS.search(server_log)
    return [int(x) for x in match.group(1).split(",") if x.strip()] if match else None


def local_cache_tokens(server_log: str) -> int | None:
    """The local KV cache size vLLM logged at start (tokens), or None."""
    match = _KV_TOKENS.search(server_log)
    return int(match.group(1).replace(",", "")) if match else None


# --- one configuration ---------------------------------------------------------------------------------------


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def summarize(load: LoadResult) -> dict[str, Any]:
    turns = [r for r in load.records if r.phase == "turn"]
    ok = [r for r in turns if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    resent = [r.ttft_s for r in ok if r.turn > 0 and r.ttft_s is not None]
    latencies = [r.latency_s for r in ok]
    turn_wall = load.wall_s
    reuse = [r for r in load.records if r.phase == "probe-reuse"]
    return {
        "requests": len(turns),
        "errors": sum(1 for r in load.records if not r.ok),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        "ttft_p50_s": _percentile(ttfts, 0.5),
        "ttft_p99_s": _percentile(ttfts, 0.99),
        "ttft_resent_mean_s": statistics.fmean(resent) if resent else None,
        "latency_mean_s": statistics.fmean(latencies) if latencies else None,
        "latency_p99_s": _percentile(latencies, 0.99),
        "requests_per_s": len(load.records) / turn_wall if turn_wall else None,
        "output_tokens_per_s": (sum(r.completion_tokens for r in load.records) / turn_wall)
        if turn_wall
        else None,
        "prompt_tokens": sum(r.prompt_tokens for r in turns),
        "local_hit_tokens": load.totals.get("local_hit_tokens"),
        "external_hit_tokens": load.totals.get("external_hit_tokens"),
        "preemptions": load.totals.get("preemptions"),
        "probe_reuse_external_hit_tokens": load.probe.get("external_hit_tokens"),
        "probe_reuse_ttft_s": reuse[0].ttft_s if reuse else None,
        # The engine's view of the same requests (means over every request of the run, probe included).
        **{
            f"engine_{phase}_mean_s": (load.totals[f"{phase}_s_sum"] / load.totals[f"{phase}_s_count"])
            if load.totals.get(f"{phase}_s_count")
            else None
            for phase in _VLLM_PHASES
        },
    }


def agreement(records: Sequence[RequestRecord], reference: Sequence[RequestRecord]) -> float | None:
    """Fraction of requests (matched by phase, session, turn) whose greedy token ids equal the reference's."""
    ref = {(r.phase, r.session, r.turn): r.token_ids for r in reference if r.ok}
    pairs = [
        (r.token_ids, ref[(r.phase, r.session, r.turn)])
        for r in records
        if r.ok and (r.phase, r.session, r.turn) in ref
    ]
    if not pairs:
        return None
    return sum(1 for mine, theirs in pairs if mine == theirs) / len(pairs)


@dataclass(frozen=True)
class Divergence:
    """How a run's greedy tokens compare with a reference run's, request by request.

    A differing answer changes every later turn of its session, so only requests whose conversation so far
    is identical to the reference's (every earlier answer of the session the same text) are compared; the
    others are counted in ``num_diverged_conversations``. For each differing request, the reference's
    top-2 log-probability gap at the first differing token says how near a tie that choice was: about 0 (a
    bfloat16 tie) is batching noise, a clear gap would be a wrong token.
    """

    num_compared: int
    num_equal: int
    num_diverged_conversations: int
    #: per differing request: (phase, session, turn, first differing token, reference gap there or None)
    differing: tuple[tuple[str, int, int, int, float | None], ...]

    @property
    def agreement(self) -> float | None:
        return self.num_equal / self.num_compared if self.num_compared else None

    @property
    def max_reference_gap(self) -> float | None:
        gaps = [gap for *_, gap in self.differing if gap is not None]
        return max(gaps) if gaps else None


def divergence(records: Sequence[RequestRecord], reference: Sequence[RequestRecord]) -> Divergence:
    """Compare ``records`` with ``reference`` request by request (see ``Divergence``)."""
    ref = {(r.phase, r.session, r.turn): r for r in reference if r.ok}
    mine = {(r.phase, r.session, r.turn): r for r in records if r.ok}
    num_compared = num_equal = num_diverged = 0
    differing: list[tuple[str, int, int, int, float | None]] = []
    for key in sorted(mine.keys() & ref.keys(), key=lambda k: (k[0], k[1], k[2])):
        phase, session, turn = key
        if phase == "turn":
            earlier = [("turn", session, t) for t in range(turn)]
            if any(k not in mine or k not in ref or mine[k].text != ref[k].text for k in earlier):
                num_diverged += 1
                continue
        num_compared += 1
        a, b = mine[key].token_ids, ref[key].token_ids
        if a == b:
            num_equal += 1
            continue
        position = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        gaps = ref[key].top2_gaps
        differing.append((phase, session, turn, position, gaps[position] if position < len(gaps) else None))
    return Divergence(num_compared, num_equal, num_diverged, tuple(differing))


def _divergence_columns(d: Divergence) -> dict[str, Any]:
    return {
        "agreement_same_prompt": d.agreement,
        "same_prompt_requests": d.num_compared,
        "diverged_conversations": d.num_diverged_conversations,
        "differing_max_reference_gap": d.max_reference_gap,
        "differing": [list(x) for x in d.differing],
    }


def check_after_load(server: OpenAIServer, audit: Path | None) -> dict[str, Any]:
    """What must hold once the load is over: nothing running or waiting, no pinned blocks (the local prefix
    cache resets), and for hybridkv a clean audit log whose every lifecycle terminated."""
    samples = metrics_samples(server.base_url)
    out: dict[str, Any] = {
        "running": metric(samples, "vllm:num_requests_running"),
        "waiting": metric(samples, "vllm:num_requests_waiting"),
    }
    try:
        out["reset_attempts"] = server.reset_prefix_cache(attempts=30)
    except RuntimeError:
        out["reset_attempts"] = None
    if audit is not None:
        out.update(audit_summary(audit))
    return out


def audit_summary(audit: Path) -> dict[str, Any]:
    from hybridkv.audit.replay import audit_files, rotated_set

    paths = rotated_set(audit) if audit.exists() else []
    if not paths:
        return {"audit_ok": None}
    report = audit_files(paths)
    return {
        "audit_ok": report.ok,
        "audit_lifecycles": report.num_lifecycles,
        "audit_unterminated": report.num_lifecycles - report.num_terminated,
        "audit_violations": report.violation_counts(),
        "audit_dropped": report.num_dropped,
    }


# --- the whole bench ------------------------------------------------------------------------------------------


@dataclass
class ConfigRun:
    config: str
    summary: dict[str, Any]
    after: dict[str, Any]
    per_turn: list[dict[str, float]]
    records: list[RequestRecord]
    local_cache_tokens: int | None
    self_records: list[RequestRecord] | None = None
    #: the concurrency-1 pass (``serial_workload``), every prefix then from this configuration's tier
    serial_records: list[RequestRecord] | None = None
    error: str | None = None


def run_config(
    config: str,
    model: Path,
    workdir: Path,
    workload: Workload,
    shape: ServerShape,
    master: MooncakeMaster | None,
    *,
    self_check: bool = False,
    serial: Workload | None = None,
    progress: Callable[[int], None] | None = None,
) -> ConfigRun:
    """Start the server of ``config``; run the ``serial`` workload (concurrency 1) on it first (without one,
    ``warmup_workload``), then reset the local and the external cache; drive the load (twice with
    ``self_check``: the second pass after ``reset_prefix_cache``); check the aftermath; stop the server."""
    server, audit = server_for(config, model, workdir, shape, workload, master)
    after: dict[str, Any] = {}
    try:
        server.wait_healthy()
        serial_records = None
        if serial is not None:
            serial_load = run_serial(server, serial, progress)
            serial_records = serial_load.records
            after["serial_external_hit_tokens"] = serial_load.totals.get("external_hit_tokens")
        else:
            # The first requests after start are several times slower (measured: first-turn TTFT 0.4-0.9 s
            # against ~0.1 s once warm); the serial pass warms the server otherwise.
            run_load(server.base_url, warmup_workload(workload), probe=False)
        # The load starts with nothing cached, locally or in the store.
        try:
            server.reset_prefix_cache(attempts=30, reset_external=True)
            after["store_reset_before_load"] = True
        except RuntimeError:
            after["store_reset_before_load"] = False  # the connector cannot reset: its store stays warm
            server.reset_prefix_cache(attempts=30)
        load = run_load(server.base_url, workload, progress=progress)
        self_records = None
        if self_check:
            server.reset_prefix_cache(attempts=30)
            self_records = run_load(server.base_url, workload, progress=progress).records
        after.update(check_after_load(server, None))
    finally:
        rc = server.stop()
    if audit is not None:
        after.update(audit_summary(audit))
    log = server.log_text()
    after["exit_status"] = rc
    after["server_errors"] = len(re.findall(r" ERROR ", log.partition("shutdown triggered")[0]))
    after["engine_core_ids"] = engine_core_ids(log)
    return ConfigRun(
        config=config,
        summary=summarize(load),
        after=after,
        per_turn=load.per_turn,
        records=load.records,
        local_cache_tokens=local_cache_tokens(log),
        self_records=self_records,
        serial_records=serial_records,
    )


def run_serial(
    server: OpenAIServer, serial: Workload, progress: Callable[[int], None] | None = None
) -> LoadResult:
    """The serial workload on a fresh server (one request at a time, no eviction probe)."""
    assert serial.concurrency == 1, f"the serial pass runs at concurrency 1, got {serial.concurrency}"
    return run_load(server.base_url, serial, progress=progress, probe=False)


def run_serial_reference(
    model: Path,
    workdir: Path,
    shape: ServerShape,
    serial: Workload,
    progress: Callable[[int], None] | None = None,
) -> list[RequestRecord]:
    """The serial workload on a no-connector server whose local cache holds all of it
    (``shape.reference_kv_cache_bytes``): every resent prefix a local hit. An external hit restores the
    same KV and state a local hit keeps, so a configuration's serial pass must give these tokens exactly. (A
    prefix recomputed after eviction may round differently in bfloat16 and flip a greedy tie: the
    no-connector server with the small cache is not an exact reference.)"""
    big = replace(shape, kv_cache_bytes=shape.reference_kv_cache_bytes)
    server, _ = server_for("none", model, workdir, big, serial, None, log_name="server-serial-reference.log")
    try:
        server.wait_healthy()
        return run_serial(server, serial, progress).records
    finally:
        server.stop()


def warmup_workload(workload: Workload) -> Workload:
    """Two one-turn sessions of other prompts (another seed), one at a time: warms a server up before the
    measured load when no serial pass does."""
    return replace(workload, seed=workload.seed + 1, num_sessions=2, num_turns=1, concurrency=1)


def serial_workload(workload: Workload, num_sessions: int) -> Workload:
    """The concurrency-1 check: the first ``num_sessions`` sessions of ``workload``, one request at a time
    (no batching to change greedy tokens), on each configuration's fresh server with its small local cache:
    resent prefixes evicted locally come from the configuration's tier. Compared with
    ``run_serial_reference``."""
    return replace(workload, concurrency=1, num_sessions=min(num_sessions, workload.num_sessions))


def working_set_tokens(records: Sequence[RequestRecord], workload: Workload, model: Path) -> int:
    """Distinct tokens of the multi-turn load: each session's last prompt and answer, with the shared system
    prompts counted once (their length from the model's tokenizer)."""
    last: dict[int, int] = {}
    for r in records:
        if r.phase == "turn" and r.ok:
            last[r.session] = max(last.get(r.session, 0), r.prompt_tokens + r.completion_tokens)
    if not last:
        return 0
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    system_tokens = len(tokenizer.encode(system_prompt(workload, 0)).ids)
    num_shared = min(workload.num_system_prompts, len(last))
    return sum(last.values()) - system_tokens * (len(last) - num_shared)


def run_serve_bench(
    configs: Sequence[str],
    model: Path,
    workload: Workload,
    shape: ServerShape,
    workdir: Path,
    *,
    self_check: bool = True,
    serial_sessions: int = 4,
    progress: Callable[[int], None] | None = None,
    on_config: Callable[[str], None] | None = None,
    checkpoint: Callable[[dict[str, Any]], object] | None = None,
) -> dict[str, Any]:
    """Run every configuration in the order given (rotate it between repeated runs: a host's load drifts over
    a run, and whichever configuration runs first or last would meet the same part of that drift every time);
    return the report (JSON-ready, rows in ``CONFIGS`` order; agreement is against ``none`` wherever it ran).
    ``serial_sessions`` > 0 adds the concurrency-1 pass (``serial_workload``) to every configuration.
    ``checkpoint`` gets the report so far after each configuration."""
    serial = serial_workload(workload, serial_sessions) if serial_sessions > 0 else None
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown serve configuration(s) {unknown}; expected some of {list(CONFIGS)}")
    ordered = list(dict.fromkeys(configs))
    load_start = os.getloadavg()
    master: MooncakeMaster | None = None
    runs: dict[str, ConfigRun] = {}
    try:
        if MOONCAKE_CONFIGS & set(ordered):
            if not loopback_only_namespace():
                raise RuntimeError(f"Mooncake configurations: {NETNS_HINT}")
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
            master = MooncakeMaster(workdir / "mooncake-master.log", lease_ttl="200ms")
            master.start()
        serial_reference: list[RequestRecord] | None = None
        if serial is not None:
            if on_config is not None:
                on_config("serial reference")
            serial_reference = run_serial_reference(model, workdir, shape, serial, progress)
        for config in ordered:
            if on_config is not None:
                on_config(config)
            try:
                runs[config] = run_config(
                    config,
                    model,
                    workdir,
                    workload,
                    shape,
                    master,
                    self_check=self_check and config == "none",
                    serial=serial,
                    progress=progress,
                )
            except Exception as error:  # noqa: BLE001 -- one configuration's failure must not end the others
                # A server that did not start or died under load (its /metrics gone), or anything else that
                # ended this configuration: reported with the traceback and the last lines of the server's
                # log, and the other configurations still run.
                log = workdir / f"server-{config}.log"
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:]) if log.exists() else ""
                trace = "".join(traceback.format_exception(error)[-3:])
                runs[config] = ConfigRun(config, {}, {}, [], [], None, error=f"{trace}\n{tail}"[-4000:])
            if checkpoint is not None:
                checkpoint(build_report(runs, workload, shape, model, serial_reference))
    finally:
        if master is not None:
            master.stop()
    report = build_report(runs, workload, shape, model, serial_reference)
    # What else ran on the host: the 1-minute load average when the bench started and when it ended.
    report["load_average"] = {"start": load_start[0], "end": os.getloadavg()[0]}
    return report


#: The configurations whose ratios the targets judge, and the ones they are judged against.
HYBRID_CONFIGS: tuple[str, ...] = ("hybridkv-file", "hybridkv-mooncake")
BASE_CONFIGS: tuple[str, ...] = ("none", "mooncake-store")
#: The targets, a ratio of a hybridkv configuration's to a base's: mean TTFT and throughput (requests/s).
TARGETS: dict[str, tuple[str, float]] = {
    "ttft_mean_vs_none": ("<=", 0.5),
    "ttft_mean_vs_mooncake-store": ("<=", 0.8),
    "throughput_vs_none": (">=", 1.0),
    "throughput_vs_mooncake-store": (">=", 1.0),
}
#: Ratios ``run_ratios`` takes: the TTFT statistics (to the base's), and throughput.
_RATIO_METRICS = {
    "ttft_mean": "ttft_mean_s",
    "ttft_p50": "ttft_p50_s",
    "ttft_p99": "ttft_p99_s",
    # turns after the first: the requests whose prefix a tier can serve
    "ttft_resent_mean": "ttft_resent_mean_s",
}


def run_ratios(by_config: Mapping[str, Mapping[str, Any]], hybrid_config: str) -> dict[str, float]:
    """One run's ratios of ``hybrid_config``'s row to each base configuration's: ``ttft_{mean,p50,p99}_vs_<base>``
    (lower is better) and ``throughput_vs_<base>`` (requests/s; higher is better). Missing where either row
    lacks the number."""
    hybrid = by_config.get(hybrid_config) or {}
    ratios: dict[str, float] = {}
    for base in BASE_CONFIGS:
        other = by_config.get(base) or {}
        for name, key in (*_RATIO_METRICS.items(), ("throughput", "requests_per_s")):
            if hybrid.get(key) and other.get(key):
                ratios[f"{name}_vs_{base}"] = hybrid[key] / other[key]
    return ratios


def build_report(
    runs: Mapping[str, ConfigRun],
    workload: Workload,
    shape: ServerShape,
    model: Path,
    serial_reference: Sequence[RequestRecord] | None = None,
) -> dict[str, Any]:
    reference = runs.get("none")
    rows: list[dict[str, Any]] = []
    for config, run in sorted(runs.items(), key=lambda item: CONFIGS.index(item[0])):
        row: dict[str, Any] = {"config": config, **run.summary, **run.after}
        row["local_cache_tokens"] = run.local_cache_tokens
        if run.error is not None:
            row["error"] = run.error
        if reference is not None and reference.records and run.records:
            if config == "none" and run.self_records is not None:
                row["agreement"] = agreement(run.self_records, run.records)
                row.update(_divergence_columns(divergence(run.self_records, run.records)))
            elif config != "none":
                row["agreement"] = agreement(run.records, reference.records)
                row.update(_divergence_columns(divergence(run.records, reference.records)))
        if serial_reference and run.serial_records is not None:
            serial = divergence(run.serial_records, serial_reference)
            row["serial_requests"] = serial.num_compared
            row["serial_agreement"] = serial.agreement
            row["serial_differing"] = [list(d) for d in serial.differing]
        rows.append(row)
    working_set = max((working_set_tokens(r.records, workload, model) for r in runs.values()), default=0)
    local = next((r.local_cache_tokens for r in runs.values() if r.local_cache_tokens), None)
    by_config = {row["config"]: row for row in rows}
    target_rows: list[dict[str, Any]] = []
    for hybrid_config in HYBRID_CONFIGS:
        hybrid = by_config.get(hybrid_config)
        if hybrid is None or not hybrid.get("ttft_mean_s"):
            continue
        ratios = run_ratios(by_config, hybrid_config)
        for name, (op, bound) in TARGETS.items():
            value = ratios.get(name)
            met = None if value is None else (value <= bound if op == "<=" else value >= bound)
            target_rows.append(
                {
                    "config": hybrid_config,
                    "ratio": name,
                    "value": value,
                    "target": f"{op} {bound}",
                    "met": met,
                }
            )
    core_ids = {config: run.after.get("engine_core_ids") for config, run in runs.items() if run.after}
    return {
        "model": str(model),
        # the order the configurations ran in
        "run_order": list(runs),
        "workload": asdict(workload),
        "server": asdict(shape),
        "local_cache_tokens": local,
        "working_set_tokens": working_set,
        "local_fraction_of_working_set": (local / working_set) if local and working_set else None,
        "rows": rows,
        "targets": target_rows,
        # The same OpenMP cores for every configuration, or the comparison is not like for like.
        "engine_core_ids": core_ids,
        "per_turn": {config: run.per_turn for config, run in runs.items()},
        "ttfts": {
            config: [r.ttft_s for r in run.records if r.phase == "turn" and r.ttft_s is not None]
            for config, run in runs.items()
        },
    }


TABLE_COLUMNS = (
    "config",
    "requests",
    "errors",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "latency_mean_s",
    "requests_per_s",
    "output_tokens_per_s",
    "local_hit_tokens",
    "external_hit_tokens",
    "probe_reuse_external_hit_tokens",
    "agreement",
    "audit_ok",
)
#: Where the time goes: the engine's per-request phase means next to the client's TTFT.
PHASE_COLUMNS = (
    "config",
    "ttft_mean_s",
    "engine_ttft_mean_s",
    "engine_queue_mean_s",
    "engine_prefill_mean_s",
    "engine_decode_mean_s",
    "preemptions",
)


#: Greedy tokens against the ``none`` run (``none``: its second pass against its first): all requests, the
#: requests whose conversation so far was identical, the reference's top-2 gap at the worst first differing
#: token (about 0: a tie that batching flipped), and the concurrency-1 pass (must be exactly 1).
AGREEMENT_COLUMNS = (
    "config",
    "agreement",
    "agreement_same_prompt",
    "same_prompt_requests",
    "differing_max_reference_gap",
    "serial_requests",
    "serial_agreement",
)


def format_serve_table(report: Mapping[str, Any]) -> str:
    from hybridkv.tables import format_table

    lines = [format_table(report["rows"], TABLE_COLUMNS)]
    lines.append("")
    lines.append(format_table(report["rows"], PHASE_COLUMNS))
    lines.append("")
    lines.append(format_table(report["rows"], AGREEMENT_COLUMNS))
    lines.append("")
    lines.append(format_table(report["targets"], ("config", "ratio", "value", "target", "met")))
    core_ids = {str(ids) for ids in report.get("engine_core_ids", {}).values() if ids is not None}
    if len(core_ids) > 1:
        lines.append(f"\nWARNING: the engines computed on different cores: {report['engine_core_ids']}")
    local = report.get("local_cache_tokens")
    working = report.get("working_set_tokens")
    fraction = report.get("local_fraction_of_working_set")
    lines.append(
        f"\nlocal KV cache {local} tokens, working set ~{working} tokens"
        + (f" (local holds {fraction:.0%})" if fraction else "")
    )
    for row in report["rows"]:
        if row.get("error"):
            causes = [line for line in row["error"].splitlines() if "Error" in line] or row[
                "error"
            ].splitlines()
            lines.append(f"{row['config']}: failed: {causes[-1].strip()[-300:]}")
    return "\n".join(lines)


# --- repeated runs --------------------------------------------------------------------------------------------


def rotated(configs: Sequence[str], run: int) -> list[str]:
    """``configs`` rotated left by ``run``: the order of run ``run`` of a repeated bench, so each configuration
    takes each place in turn."""
    shift = run % len(configs) if configs else 0
    return [*configs[shift:], *configs[:shift]]


#: Per configuration, the numbers ``summarize_runs`` takes the median and [min, max] of.
RUN_METRICS = (
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "ttft_resent_mean_s",
    "requests_per_s",
    "output_tokens_per_s",
    "local_hit_tokens",
    "external_hit_tokens",
    "agreement_same_prompt",
    "engine_queue_mean_s",
    "engine_prefill_mean_s",
)


def _spread(values: Sequence[float | None]) -> dict[str, float] | None:
    present = [float(v) for v in values if v is not None]
    if not present:
        return None
    return {"median": statistics.median(present), "min": min(present), "max": max(present), "n": len(present)}


#: Per turn, where a request's time goes: the client's TTFT (mean over the turn's requests), vLLM's queue and
#: prefill time per request, and hybridkv's load job seconds per request (0 for the other configurations).
_TURN_METRICS = ("ttft_mean_s", "engine_queue_s", "engine_prefill_s", "load_job_s")


def turn_breakdown(report: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Per configuration and turn of one run: ``_TURN_METRICS`` (the client's TTFTs only where every request
    of the run had one: the report lists them in turn order)."""
    sessions = report["workload"]["num_sessions"]
    out: dict[str, list[dict[str, Any]]] = {}
    for config, turns in report.get("per_turn", {}).items():
        ttfts = report.get("ttfts", {}).get(config, [])
        rows = []
        for turn in turns:
            index = int(turn["turn"])
            count = turn.get("prefill_s_count") or 0
            mine = (
                ttfts[index * sessions : (index + 1) * sessions]
                if len(ttfts) == sessions * len(turns)
                else []
            )
            rows.append(
                {
                    "turn": index + 1,
                    "ttft_mean_s": statistics.fmean(mine) if mine else None,
                    "engine_queue_s": turn["queue_s_sum"] / count if count else None,
                    "engine_prefill_s": turn["prefill_s_sum"] / count if count else None,
                    "load_job_s": turn.get("hybridkv_load_job_seconds", 0.0) / count if count else None,
                }
            )
        out[config] = rows
    return out


def summarize_runs(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians and [min, max] over repeated runs of the bench (each a ``run_serve_bench`` report): per
    configuration the ``RUN_METRICS``, its errors and its serial pass's worst agreement; per hybridkv
    configuration its ratios to each base (``run_ratios``, taken per run, then the median); and the
    ``TARGETS`` judged at those medians, with the failed requests and serial exactness of every run."""
    from hybridkv.bench.report import target_row

    configs = sorted({row["config"] for r in reports for row in r["rows"]}, key=CONFIGS.index)
    rows: list[dict[str, Any]] = []
    for config in configs:
        mine = [row for r in reports for row in r["rows"] if row["config"] == config]
        row: dict[str, Any] = {"config": config, "runs": len(mine)}
        row["failed_runs"] = sum(1 for x in mine if x.get("error"))
        row["errors"] = sum(x.get("errors") or 0 for x in mine)
        serial = [x["serial_agreement"] for x in mine if x.get("serial_agreement") is not None]
        row["serial_agreement_min"] = min(serial) if serial else None
        for metric_name in RUN_METRICS:
            row[metric_name] = _spread([x.get(metric_name) for x in mine])
        rows.append(row)
    ratios: dict[str, dict[str, dict[str, float] | None]] = {}
    for hybrid_config in HYBRID_CONFIGS:
        per_run = [run_ratios({row["config"]: row for row in r["rows"]}, hybrid_config) for r in reports]
        names = sorted({name for one in per_run for name in one})
        if names:
            ratios[hybrid_config] = {name: _spread([one.get(name) for one in per_run]) for name in names}
    targets: list[dict[str, Any]] = []
    for hybrid_config, spreads in ratios.items():
        for name, (op, bound) in TARGETS.items():
            spread = spreads.get(name)
            if spread is None:
                continue  # the base configuration did not run
            targets.append(
                target_row(
                    f"{hybrid_config} {name}, median of {len(reports)} runs",
                    spread["median"],
                    op,
                    bound,
                )
            )
    failed = sum(row["errors"] + row["failed_runs"] for row in rows)
    targets.append(target_row("failed requests and configurations, every run", float(failed), "==", 0))
    exact = [row["serial_agreement_min"] for row in rows if row["config"] in EXACT_CONFIGS]
    if exact and all(value is not None for value in exact):
        targets.append(
            target_row("serial pass agreement of hybridkv-file/-mooncake, worst run", min(exact), "==", 1)
        )
    breakdowns = [turn_breakdown(r) for r in reports if "workload" in r]
    per_turn: dict[str, list[dict[str, Any]]] = {}
    for config in configs:
        runs_turns = [b[config] for b in breakdowns if config in b]
        num_turns = min((len(turns) for turns in runs_turns), default=0)
        per_turn[config] = [
            {
                "turn": index + 1,
                **{name: _spread([turns[index][name] for turns in runs_turns]) for name in _TURN_METRICS},
            }
            for index in range(num_turns)
        ]
    return {
        "runs": len(reports),
        "run_orders": [r.get("run_order") for r in reports],
        "per_turn": per_turn,
        "load_average": [r.get("load_average") for r in reports],
        "local_cache_tokens": _spread([r.get("local_cache_tokens") for r in reports]),
        "working_set_tokens": _spread([r.get("working_set_tokens") for r in reports]),
        "rows": rows,
        "ratios": ratios,
        "targets": targets,
    }


def _cell(spread: Mapping[str, float] | None, digits: int) -> str | None:
    if spread is None:
        return None
    fmt = f"{{:,.{digits}f}}"
    return f"{fmt.format(spread['median'])} [{fmt.format(spread['min'])}, {fmt.format(spread['max'])}]"


def format_runs_table(summary: Mapping[str, Any]) -> str:
    """The summary of repeated runs (``summarize_runs``) as text: medians [min, max]."""
    from hybridkv.bench.report import format_targets
    from hybridkv.tables import format_table

    digits = {"local_hit_tokens": 0, "external_hit_tokens": 0, "agreement_same_prompt": 3}
    rows = [
        {
            "config": row["config"],
            "runs": row["runs"],
            "errors": row["errors"],
            "serial": row["serial_agreement_min"],
            **{name: _cell(row[name], digits.get(name, 3)) for name in RUN_METRICS},
        }
        for row in summary["rows"]
    ]
    lines = [f"{summary['runs']} runs: medians [min, max]", ""]
    lines.append(format_table(rows, ("config", "runs", "errors", "serial", *RUN_METRICS[:6])))
    lines.append("")
    lines.append(format_table(rows, ("config", *RUN_METRICS[6:])))
    turn_rows = [
        {"config": config, "turn": turn["turn"], **{name: _cell(turn[name], 3) for name in _TURN_METRICS}}
        for config, turns in summary["per_turn"].items()
        for turn in turns
    ]
    if turn_rows:
        lines += ["", "per turn, every session's request (medians [min, max] over runs):"]
        lines.append(format_table(turn_rows, ("config", "turn", *_TURN_METRICS)))
    ratio_rows = [
        {"config": config, "ratio": name, "median [min, max] over runs": _cell(spread, 3)}
        for config, spreads in summary["ratios"].items()
        for name, spread in spreads.items()
    ]
    lines += ["", format_table(ratio_rows, ("config", "ratio", "median [min, max] over runs"))]
    lines += ["", format_targets(summary["targets"])]
    return "\n".join(lines)


def plot_serve(report: Mapping[str, Any], path: Path) -> Path | None:
    """Two panels: TTFT distribution per configuration (box plot), external and local hit tokens per turn."""
    from hybridkv.bench.report import pyplot_or_none

    plt = pyplot_or_none()
    if plt is None:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    ttfts = {c: [v * 1000 for v in vs] for c, vs in report["ttfts"].items() if vs}
    if ttfts:
        left.boxplot(list(ttfts.values()), tick_labels=list(ttfts.keys()), showmeans=True)
        left.set_ylabel("TTFT (ms)")
        left.set_title("time to first token, all turns")
        left.tick_params(axis="x", rotation=20)
    num_turns = 0
    for index, (config, turns) in enumerate(report["per_turn"].items()):
        if not turns:
            continue
        color = f"C{index}"
        xs = [int(t["turn"]) + 1 for t in turns]
        num_turns = max(num_turns, len(xs))
        external = [t.get("external_hit_tokens", 0) for t in turns]
        local = [t.get("local_hit_tokens", 0) for t in turns]
        # Configurations with identical hits overlap: later ones are drawn thinner on top.
        width = 4.0 - 1.2 * index
        right.plot(xs, external, marker="o", color=color, linewidth=width, label=f"{config} external")
        right.plot(
            xs, local, marker="x", linestyle="--", color=color, linewidth=width, label=f"{config} local"
        )
    right.set_xticks(range(1, num_turns + 1))
    right.set_xlabel("turn")
    right.set_ylabel("hit tokens (all sessions)")
    right.set_title("prefix hit tokens per turn")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
