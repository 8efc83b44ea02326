"""``hybridkv bench serve``: the OpenAI server under a multi-turn load, with and without an external KV tier.

Per configuration one server process (``python -m vllm.entrypoints.openai.api_server``) with a local KV cache
deliberately smaller than the working set, driven over HTTP by ``concurrency`` client threads:

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
``hybridkv-full`` (a file store smaller than the working set).

Per configuration: TTFT (time to the first streamed content chunk) mean/p50/p99, end-to-end latency,
requests/s and output tokens/s, local and external hit tokens (``/metrics`` deltas, per turn), hybridkv's own
counters, errors, and greedy-token agreement with the ``none`` run (and of ``none`` with itself in a second
pass, where batching alone may change greedy tokens). After the load: nothing running or waiting,
``POST /reset_prefix_cache`` succeeds (no blocks stay pinned), the audit log is clean and every lifecycle in
it terminated.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hybridkv.testing.openai_server import (
    OpenAIServer,
    StreamResult,
    free_port,
    hybridkv_transfer_config,
    metric,
    metrics_samples,
    stream_request,
)

__all__ = [
    "CONFIGS",
    "Workload",
    "conversation_messages",
    "format_serve_table",
    "plot_serve",
    "run_serve_bench",
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
        if match and match.group(1) != "group_hit_tokens":
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
    body = {"model": "tiny", "max_tokens": workload.max_tokens, "temperature": 0, "ignore_eos": True}

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


@dataclass
class MooncakeMasterProcess:
    """A ``mooncake_master`` on 127.0.0.1 (the bench's own; stopped with the bench)."""

    log_path: Path
    rpc_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def start(self) -> None:
        binary = Path(sys.executable).parent / "mooncake_master"
        if not binary.exists():
            raise RuntimeError(f"mooncake_master not found next to {sys.executable} (install Mooncake)")
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    str(binary),
                    "--rpc_address=127.0.0.1",
                    f"--rpc_port={self.rpc_port}",
                    "--metrics_host=127.0.0.1",
                    f"--metrics_port={self.metrics_port}",
                    "--default_kv_lease_ttl=200ms",
                    "--logtostderr",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mooncake_master exited early; see {self.log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.rpc_port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"mooncake_master did not listen within 15 s; see {self.log_path}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def loopback_only_namespace() -> bool:
    """Whether this process's network namespace has only ``lo`` (Mooncake clients listen on 0.0.0.0)."""
    return sorted(name for _index, name in socket.if_nameindex()) == ["lo"]


@dataclass(frozen=True)
class ServerShape:
    """The server's limits: the local KV cache (bytes) is what the bench makes too small."""

    kv_cache_bytes: int = 12 << 20
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048
    store_capacity: str = "1GiB"
    full_store_capacity: str = "4MiB"


def server_for(
    config: str,
    model: Path,
    workdir: Path,
    shape: ServerShape,
    workload: Workload,
    master: MooncakeMasterProcess | None,
) -> tuple[OpenAIServer, Path | None]:
    """Start the server of ``config``; returns it and its audit log path (hybridkv configurations)."""
    audit: Path | None = None
    env: dict[str, str] = {}
    kv: dict[str, Any] | None = None
    store_dir = workdir / f"store-{config}"
    if config.startswith("hybridkv"):
        audit = workdir / f"audit-{config}.jsonl"
        if config == "hybridkv-mooncake":
            assert master is not None, "hybridkv-mooncake needs the mooncake master"
            store = f"mooncake://{master.address}?segment=512MiB&local_buffer=128MiB&timeout_ms=2000"
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
                    "global_segment_size": 512 << 20,
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
        workdir / f"server-{config}.log",
        kv_transfer_config=kv,
        max_model_len=shape.max_model_len,
        max_num_seqs=workload.concurrency,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        kv_cache_memory_bytes=shape.kv_cache_bytes,
        extra_env=env,
    )
    return server, audit


_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")


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
    from hybridkv.lifecycle.audit import audit_files, rotated_set

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
    error: str | None = None


def run_config(
    config: str,
    model: Path,
    workdir: Path,
    workload: Workload,
    shape: ServerShape,
    master: MooncakeMasterProcess | None,
    *,
    self_check: bool = False,
    progress: Callable[[int], None] | None = None,
) -> ConfigRun:
    """Start the server of ``config``, drive the load (twice with ``self_check``: the second pass after
    ``reset_prefix_cache``), check the aftermath, stop the server."""
    server, audit = server_for(config, model, workdir, shape, workload, master)
    try:
        server.wait_healthy()
        load = run_load(server.base_url, workload, progress=progress)
        self_records = None
        if self_check:
            server.reset_prefix_cache(attempts=30)
            self_records = run_load(server.base_url, workload, progress=progress).records
        after = check_after_load(server, None)
    finally:
        rc = server.stop()
    if audit is not None:
        after.update(audit_summary(audit))
    log = server.log_text()
    after["exit_status"] = rc
    after["server_errors"] = len(re.findall(r" ERROR ", log.partition("shutdown triggered")[0]))
    return ConfigRun(
        config=config,
        summary=summarize(load),
        after=after,
        per_turn=load.per_turn,
        records=load.records,
        local_cache_tokens=local_cache_tokens(log),
        self_records=self_records,
    )


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
    progress: Callable[[int], None] | None = None,
    on_config: Callable[[str], None] | None = None,
    checkpoint: Callable[[dict[str, Any]], object] | None = None,
) -> dict[str, Any]:
    """Run every configuration in order (``none`` first when present: the token reference); return the
    report (JSON-ready). ``checkpoint`` gets the report so far after each configuration."""
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown serve configuration(s) {unknown}; expected some of {list(CONFIGS)}")
    ordered = sorted(configs, key=lambda c: CONFIGS.index(c))
    master: MooncakeMasterProcess | None = None
    runs: dict[str, ConfigRun] = {}
    try:
        if MOONCAKE_CONFIGS & set(ordered):
            if not loopback_only_namespace():
                raise RuntimeError(
                    "Mooncake configurations need a private network namespace with only 'lo' (Mooncake "
                    "clients listen on 0.0.0.0): run the bench under scripts/netns-run"
                )
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
            master = MooncakeMasterProcess(workdir / "mooncake-master.log")
            master.start()
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
                    progress=progress,
                )
            except (RuntimeError, OSError) as error:
                # A server that did not start or died under load (its /metrics gone): reported with the last
                # lines of its log, and the other configurations still run.
                log = workdir / f"server-{config}.log"
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:]) if log.exists() else ""
                runs[config] = ConfigRun(config, {}, {}, [], [], None, error=f"{error}\n{tail}"[-4000:])
            if checkpoint is not None:
                checkpoint(build_report(runs, workload, shape, model))
    finally:
        if master is not None:
            master.stop()
    return build_report(runs, workload, shape, model)


def build_report(
    runs: Mapping[str, ConfigRun], workload: Workload, shape: ServerShape, model: Path
) -> dict[str, Any]:
    reference = runs.get("none")
    rows: list[dict[str, Any]] = []
    for config, run in runs.items():
        row: dict[str, Any] = {"config": config, **run.summary, **run.after}
        row["local_cache_tokens"] = run.local_cache_tokens
        if run.error is not None:
            row["error"] = run.error
        if reference is not None and reference.records and run.records:
            if config == "none" and run.self_records is not None:
                row["agreement"] = agreement(run.self_records, run.records)
            elif config != "none":
                row["agreement"] = agreement(run.records, reference.records)
        rows.append(row)
    working_set = max((working_set_tokens(r.records, workload, model) for r in runs.values()), default=0)
    local = next((r.local_cache_tokens for r in runs.values() if r.local_cache_tokens), None)
    ratios: dict[str, Any] = {}
    by_config = {row["config"]: row for row in rows}
    hybrid = by_config.get("hybridkv-file") or by_config.get("hybridkv-mooncake")
    if hybrid is not None and hybrid.get("ttft_mean_s"):
        for base in ("none", "mooncake-store"):
            other = by_config.get(base)
            if other is not None and other.get("ttft_mean_s"):
                ratios[f"ttft_mean_vs_{base}"] = hybrid["ttft_mean_s"] / other["ttft_mean_s"]
                ratios[f"throughput_vs_{base}"] = hybrid["requests_per_s"] / other["requests_per_s"]
    targets = {
        "ttft_mean_vs_none": ("<=", 0.5),
        "ttft_mean_vs_mooncake-store": ("<=", 0.8),
        "throughput_vs_none": (">=", 1.0),
        "throughput_vs_mooncake-store": (">=", 1.0),
    }
    target_rows = [
        {
            "ratio": name,
            "value": ratios.get(name),
            "target": f"{op} {bound}",
            "met": None
            if ratios.get(name) is None
            else (ratios[name] <= bound if op == "<=" else ratios[name] >= bound),
        }
        for name, (op, bound) in targets.items()
    ]
    return {
        "model": str(model),
        "workload": asdict(workload),
        "server": asdict(shape),
        "local_cache_tokens": local,
        "working_set_tokens": working_set,
        "local_fraction_of_working_set": (local / working_set) if local and working_set else None,
        "rows": rows,
        "targets": target_rows,
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


def format_serve_table(report: Mapping[str, Any]) -> str:
    from hybridkv.bench.report import format_table

    lines = [format_table(report["rows"], TABLE_COLUMNS)]
    lines.append("")
    lines.append(format_table(report["rows"], PHASE_COLUMNS))
    lines.append("")
    lines.append(format_table(report["targets"], ("ratio", "value", "target", "met")))
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
