"""The agentic trace replayed through real engines (``hybridkv bench agentic-serve``): external hit tokens,
TTFT and store bytes written, per KV-tier configuration at one store capacity.

``hybridkv bench agentic`` replays its seeded agentic trace (:mod:`hybridkv.bench.agentic`: sessions of ~43
turns re-sending a growing prefix, sub-agent forks, tool and human pauses, tenants, one-off requests of a
``background`` tenant) at store level. This bench sends the same trace's prompts to vLLM's OpenAI server, one
server per configuration and round, and reads what the engines did.

The trace (:func:`build_serve_trace`): :func:`hybridkv.bench.agentic.generate_trace` of
:func:`serve_workload`, whose token counts are the real ones divided by ``token_scale`` (default 256, the
store bench's 64: every token knob of ``AgenticWorkload`` times 64 / ``token_scale``) so that prompts fit the
tiny model's ``max_model_len``; ``num_sessions`` sessions (default 8) arriving over a window scaled like the
session count (the store bench's 24 sessions over 30 minutes), so that about as many sessions are live at
once. The trace's blocks are the engine's (``block_tokens``, passed to vLLM as ``--block-size``). Requests
whose prompt does not fit (more than ``max_model_len - max_tokens`` tokens: the longest sessions' last
turns, a rare long one-off) are left out and counted, then the trace is cut to its first ``max_requests``
requests in time order (counted too). Token ids (drawn from 150,000) are mapped into the model's vocabulary
(``3 + id % (vocab - 3)``, past pad/bos/eos), which keeps every shared prefix shared.

The replay (:func:`replay_trace`): requests in trace order through streamed ``/v1/completions`` with the
prompt as a token-id list, ``max_tokens`` (4) greedy tokens, ``ignore_eos``, and ``cache_salt`` =
``salt:<tenant>`` (vLLM 0.32's completions API takes it: vLLM mixes it into the first block's hash, so each
tenant's blocks, hence their store keys, are its own; the store namespace is one per configuration). The
trace's clock is compressed: each request is sent once the requests it follows are answered (at concurrency
1, the previous one; at 2, the previous request of its session, of its parent or of its sub-agents), never
waiting for the trace's pauses, so a replay of an hour of trace takes about a minute. TTFT is the time to
the first streamed token. Before the replay two short prompts (less than a block: nothing to cache) warm the
server up.

Configurations (:data:`CONFIGURATIONS`), all with the same store capacity C = ``capacity_fraction`` (0.25)
of the trace's working set (the KV bytes of every distinct whole prompt block, per tenant: the tiny Llama's
``layers x 2 x kv_heads x head_dim x 2 bytes`` per token), and the same local KV cache (``kv_cache_mib``,
smaller than C):

- ``file-lru``: ``HybridStoreConnector`` on ``file://DIR?capacity=C`` (a fresh directory per run).
- ``file-lru+sessions``: the same, each request of a session or sub-agent carrying
  ``kv_transfer_params = {"hybridkv_session": {"id": "<tenant>/chain-<n>", "ttl_s": 3600, "end": <is it
  the chain's last request in the replay>}}`` (``hybridkv.connector.sessions``); one-offs carry none.
- ``mooncake-store``: vLLM's in-tree ``MooncakeStoreConnector`` (embedded mode, TCP) on a fresh
  ``mooncake_master`` per run on 127.0.0.1, its one worker mounting a global segment of C bytes (so the pool
  is C); run the bench inside ``scripts/netns-run``. (Not ``hybridkv.bench.serve.server_for``, which fixes
  that segment at 512 MiB; the servers here are built with the same ``OpenAIServer`` and
  ``hybridkv_transfer_config``, and the same reserved CPU so every engine computes on the same cores.)
- ``none``: no connector: the floor (vLLM's local prefix cache only).

Counted per configuration and round, from ``/metrics`` deltas over the replay (``hybridkv.bench.serve.counters``):
prompt tokens (the replay's own sum; vLLM's counter is reported next to it), external hit tokens
(``vllm:external_prefix_cache_hits_total``: what the connector loaded, the same counter for every
connector) and local hit tokens, their shares of the prompt tokens, TTFT p50/p99 over the requests that
succeeded, failed requests, and store bytes written: hybridkv's ``vllm:hybridkv_save_bytes_total`` (keys
already stored are skipped, not rewritten), Mooncake's ``vllm:mooncake_store_operation_bytes_total`` of its
``save_put`` operations (after its own existence check; statuses ``ok`` and ``partial_failure``), ``None``
for ``none`` (no store). The share served from the store over the trace (the plot) is the external hit
share per window of requests (counters read at each window's end, the first round).

Rounds: round ``r`` builds the trace of seed ``seed + r`` (its own working set and C) and runs every
configuration on it in an order rotated by ``r``, each on a fresh server and store; figures are medians over
rounds with [min, max], and the points against ``file-lru`` are taken per round (same trace) first.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shutil
import statistics
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from hybridkv.bench.agentic import (
    TARGET_POINTS_OVER_LRU,
    AgenticWorkload,
    RequestKind,
    generate_trace,
)
from hybridkv.bench.report import pyplot_or_none, save_figure, target_row
from hybridkv.bench.serve import counters, local_cache_tokens
from hybridkv.bench.store import bench_scratch_dir
from hybridkv.devkit.mooncake import MooncakeMaster
from hybridkv.devkit.net import NETNS_HINT, loopback_only_namespace
from hybridkv.devkit.openai_server import (
    OpenAIServer,
    StreamResult,
    http_json,
    hybridkv_transfer_config,
    metric,
    metrics_samples,
    stream_request,
)
from hybridkv.devkit.tiny_models import DEFAULT_MODELS_DIR, build_tiny_model
from hybridkv.store.mooncake_node import MIN_SEGMENT_BYTES

__all__ = [
    "BASELINE",
    "CONFIGURATIONS",
    "MOONCAKE_CONFIGURATION",
    "SESSIONS_CONFIGURATION",
    "TABLE_COLUMNS",
    "ReplayRequest",
    "ServeSetup",
    "ServeTrace",
    "attention_block_bytes",
    "build_serve_trace",
    "describe_report",
    "plot_report",
    "replay_trace",
    "request_body",
    "run_agentic_serve_bench",
    "serve_workload",
]

BASELINE = "file-lru"
SESSIONS_CONFIGURATION = "file-lru+sessions"
MOONCAKE_CONFIGURATION = "mooncake-store"
CONFIGURATIONS: tuple[str, ...] = (BASELINE, SESSIONS_CONFIGURATION, MOONCAKE_CONFIGURATION, "none")
HYBRIDKV_CONFIGURATIONS = frozenset({BASELINE, SESSIONS_CONFIGURATION})
#: The store bench's token scale (``AgenticWorkload``'s token counts are at it).
_WORKLOAD_TOKEN_SCALE = 64
#: The store bench's sessions and arrival window: the serve trace keeps sessions / window.
_WORKLOAD_SESSIONS = 24
_WORKLOAD_ARRIVAL_S = 1800.0
#: Token ids 0..2 are the tiny models' pad/bos/eos.
_FIRST_TOKEN_ID = 3
#: Windows of the hit share over the trace (the plot).
NUM_WINDOWS = 20
_NAMESPACE = "bench-agentic-serve"
#: The tiny Llama with 4 KV heads of 128 (4 KiB of KV per token, 128 KiB per 32-token block; 2 layers,
#: hidden 128): a working set of a few hundred requests is then over 64 MiB, so a quarter of it reaches
#: Mooncake's smallest global segment (16 MiB), and the compute stays that of the tiny model.
MODEL_OVERRIDES: dict[str, Any] = {"num_key_value_heads": 4, "head_dim": 128}
_MIB = float(1 << 20)
#: A server not healthy by then failed (vLLM's API server can outlive an engine core that died at start).
_START_TIMEOUT_S = 300.0


@dataclass(frozen=True, kw_only=True)
class ServeSetup:
    """The bench's knobs: the trace's scale, the engines' shape and the store's capacity."""

    num_sessions: int = 16
    #: the trace is cut to its first this many requests (time order), after the too-long ones are left out
    max_requests: int = 600
    #: real tokens per trace token (the store bench's is 64)
    token_scale: int = 256
    #: the engine's KV block (``--block-size``) and the trace's hash block
    block_tokens: int = 32
    max_tokens: int = 4
    concurrency: int = 1
    #: the store capacity C of every configuration, a fraction of the trace's working set
    capacity_fraction: float = 0.25
    #: the engine's local KV cache (``--kv-cache-memory-bytes``), MiB
    kv_cache_mib: float = 10.0
    max_model_len: int = 2048
    session_ttl_s: float = 3600.0
    #: ``VLLM_CPU_NUM_OF_RESERVED_CPU``, the same for every configuration (see ``ServerShape.reserved_cpus``)
    reserved_cpus: int = 1
    #: Mooncake's per-client transfer buffer (``local_buffer_size``)
    mooncake_local_buffer_mib: int = 32

    def __post_init__(self) -> None:
        checks = {
            "num_sessions >= 1": self.num_sessions >= 1,
            "max_requests >= 1": self.max_requests >= 1,
            "token_scale >= 1": self.token_scale >= 1,
            "block_tokens >= 1": self.block_tokens >= 1,
            "1 <= max_tokens < max_model_len": 1 <= self.max_tokens < self.max_model_len,
            "concurrency 1 or 2": self.concurrency in (1, 2),
            "capacity_fraction > 0": self.capacity_fraction > 0,
            "kv_cache_mib > 0": self.kv_cache_mib > 0,
            "session_ttl_s in (0, 86400]": 0 < self.session_ttl_s <= 86400,
            "reserved_cpus >= 0": self.reserved_cpus >= 0,
        }
        failed = [name for name, ok in checks.items() if not ok]
        if failed:
            raise ValueError(f"ServeSetup: need {', '.join(failed)}")

    @property
    def max_prompt_tokens(self) -> int:
        return self.max_model_len - self.max_tokens


def serve_workload(setup: ServeSetup) -> AgenticWorkload:
    """The store bench's workload at ``setup``'s token scale, session count and block size: every token count
    times 64 / ``token_scale``, the arrival window scaled like the session count."""
    factor = _WORKLOAD_TOKEN_SCALE / setup.token_scale
    base = AgenticWorkload()
    return replace(
        base,
        num_sessions=setup.num_sessions,
        token_scale=setup.token_scale,
        block_tokens=setup.block_tokens,
        system_prompt_tokens=max(1, round(base.system_prompt_tokens * factor)),
        user_task_tokens=max(1, round(base.user_task_tokens * factor)),
        model_output_median_tokens=max(1.0, base.model_output_median_tokens * factor),
        tool_output_median_tokens=max(1.0, base.tool_output_median_tokens * factor),
        subagent_task_tokens=max(1, round(base.subagent_task_tokens * factor)),
        one_off_median_tokens=max(float(setup.block_tokens + 1), base.one_off_median_tokens * factor),
        session_arrival_window_s=_WORKLOAD_ARRIVAL_S * setup.num_sessions / _WORKLOAD_SESSIONS,
    )


@dataclass(frozen=True)
class ReplayRequest:
    """One request of the replay: its token ids (in the model's vocabulary) and what it waits for."""

    index: int  # position in the replay
    trace_index: int  # position in the generated trace
    chain: int
    kind: RequestKind
    tenant: str
    prompt: tuple[int, ...] = field(repr=False)
    block_hashes: tuple[bytes, ...] = field(repr=False)
    #: the session hint's id (``None``: a one-off, no hint) and whether this is its chain's last request
    session_id: str | None
    session_end: bool
    #: replay indices that must be answered before this one is sent (concurrency > 1)
    after: tuple[int, ...]
    time_s: float

    @property
    def cache_salt(self) -> str:
        return f"salt:{self.tenant}"


@dataclass(frozen=True)
class ServeTrace:
    """A generated trace cut to what the engines replay."""

    seed: int
    workload: AgenticWorkload
    requests: tuple[ReplayRequest, ...]
    num_trace_requests: int
    num_too_long: int
    num_cut: int

    def working_set_blocks(self) -> int:
        """Distinct whole prompt blocks (per tenant) of the replay: what an unbounded store ends up holding."""
        return len({(r.tenant, h) for r in self.requests for h in r.block_hashes})

    def ideal_hit_tokens(self) -> list[int]:
        """Per request, the hit of an unbounded store with an attention-only model and no local cache: the
        deepest whole block, at most the prompt less one token, that an earlier request of its tenant
        stored (vLLM hashes prefixes, so a block present means every block before it is)."""
        block = self.workload.block_tokens
        stored: set[tuple[str, bytes]] = set()
        hits: list[int] = []
        for request in self.requests:
            cap = min(len(request.prompt) - 1, len(request.block_hashes) * block) // block
            hit = next(
                (
                    n * block
                    for n in range(cap, 0, -1)
                    if (request.tenant, request.block_hashes[n - 1]) in stored
                ),
                0,
            )
            hits.append(hit)
            stored.update((request.tenant, h) for h in request.block_hashes)
        return hits

    def shape(self) -> dict[str, Any]:
        prompts = [len(r.prompt) for r in self.requests]
        ideal = self.ideal_hit_tokens()
        return {
            "seed": self.seed,
            "token_scale": self.workload.token_scale,
            "block_tokens": self.workload.block_tokens,
            "num_sessions": len({r.chain for r in self.requests if r.kind is RequestKind.TURN}),
            "num_trace_requests": self.num_trace_requests,
            "num_too_long": self.num_too_long,
            "num_cut": self.num_cut,
            "num_requests": len(self.requests),
            "num_requests_by_kind": {
                kind.value: sum(r.kind is kind for r in self.requests) for kind in RequestKind
            },
            "tenants": sorted({r.tenant for r in self.requests}),
            "prompt_tokens": sum(prompts),
            "prompt_tokens_median": float(statistics.median(prompts)) if prompts else 0.0,
            "prompt_tokens_max": max(prompts, default=0),
            "span_s": self.requests[-1].time_s if self.requests else 0.0,
            "working_set_blocks": self.working_set_blocks(),
            "ideal_share": sum(ideal) / max(1, sum(prompts)),
        }


def build_serve_trace(setup: ServeSetup, seed: int, vocab_size: int) -> ServeTrace:
    """The trace of ``serve_workload(setup)`` for ``seed``, without the prompts that do not fit, cut to
    ``setup.max_requests`` requests, token ids mapped into ``vocab_size`` (pure)."""
    workload = serve_workload(setup)
    trace = generate_trace(workload, seed)
    fitting = [r for r in trace.requests if r.num_prompt_tokens <= setup.max_prompt_tokens]
    kept = fitting[: setup.max_requests]
    chain_to_last = {r.chain: position for position, r in enumerate(kept)}
    parent_of = {c.chain: c.parent for c in trace.chains}
    children_of: dict[int, list[int]] = {}
    for chain in trace.chains:
        if chain.parent is not None:
            children_of.setdefault(chain.parent, []).append(chain.chain)
    #: the replay index of the latest request of each chain so far
    latest: dict[int, int] = {}
    modulus = vocab_size - _FIRST_TOKEN_ID
    requests: list[ReplayRequest] = []
    for position, r in enumerate(kept):
        related = [r.chain, *children_of.get(r.chain, ())]
        parent = parent_of[r.chain]
        if parent is not None:
            related.append(parent)
        after = tuple(sorted({latest[c] for c in related if c in latest}))
        latest[r.chain] = position
        one_off = r.kind is RequestKind.ONE_OFF
        requests.append(
            ReplayRequest(
                index=position,
                trace_index=r.index,
                chain=r.chain,
                kind=r.kind,
                tenant=r.tenant,
                prompt=tuple(_FIRST_TOKEN_ID + t % modulus for t in trace.prompt_tokens(r)),
                block_hashes=r.block_hashes,
                session_id=None if one_off else f"{r.tenant}/chain-{r.chain}",
                session_end=not one_off and chain_to_last[r.chain] == position,
                after=after,
                time_s=r.time_s,
            )
        )
    return ServeTrace(
        seed=seed,
        workload=workload,
        requests=tuple(requests),
        num_trace_requests=len(trace.requests),
        num_too_long=len(trace.requests) - len(fitting),
        num_cut=len(fitting) - len(kept),
    )


def bench_model(models_dir: Path | None = None) -> Path:
    """The bench's model (the tiny Llama with ``MODEL_OVERRIDES``), built once under ``models_dir`` (default:
    ``$HYBRIDKV_TEST_MODELS``, ``hybridkv.devkit.tiny_models.DEFAULT_MODELS_DIR``)."""
    return build_tiny_model("llama", models_dir or DEFAULT_MODELS_DIR, **MODEL_OVERRIDES)


def attention_block_bytes(model_dir: Path, block_tokens: int, dtype_bytes: int = 2) -> int:
    """KV bytes of one ``block_tokens`` block of ``model_dir``'s full-attention layers (bfloat16): layers x
    K and V x kv heads x head dim x tokens x 2 bytes. Exact for an attention-only model (the tiny Llama)."""
    config = json.loads((model_dir / "config.json").read_text())
    layer_types = config.get("layer_types")
    num_layers = (
        sum(1 for t in layer_types if t in ("full_attention", "attention"))
        if layer_types
        else int(config["num_hidden_layers"])
    )
    heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    return num_layers * 2 * heads * head_dim * block_tokens * dtype_bytes


def model_vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


# -- one configuration ----------------------------------------------------------------------------------------


def request_body(request: ReplayRequest, configuration: str, setup: ServeSetup) -> dict[str, Any]:
    """The ``/v1/completions`` body of ``request`` under ``configuration`` (the session hint only for
    ``file-lru+sessions``)."""
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": list(request.prompt),
        "max_tokens": setup.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "cache_salt": request.cache_salt,
    }
    if configuration == SESSIONS_CONFIGURATION and request.session_id is not None:
        body["kv_transfer_params"] = {
            "hybridkv_session": {
                "id": request.session_id,
                "ttl_s": setup.session_ttl_s,
                "end": request.session_end,
            }
        }
    return body


@dataclass
class ReplayOutcome:
    """What one replay through one server measured."""

    results: list[StreamResult]
    #: counter deltas over the whole replay (``hybridkv.bench.serve.counters`` names, plus ``mooncake_put_bytes``)
    totals: dict[str, float]
    #: per window of requests: (prompt tokens, external hit tokens, local hit tokens)
    windows: list[tuple[int, float, float]]
    seconds: float


def _samples_counters(base_url: str) -> dict[str, float]:
    samples = metrics_samples(base_url)
    out = counters(samples)
    out["mooncake_put_bytes"] = sum(
        metric(samples, "vllm:mooncake_store_operation_bytes_total", operation="save_put", status=status)
        for status in ("ok", "partial_failure")
    )
    return out


def _settled(base_url: str, num_succeeded: float, timeout_s: float = 10.0) -> dict[str, float]:
    """Counters once ``num_succeeded`` requests are counted (stats reach the API server with the engine's
    outputs), and the connector's store writes have stopped moving (saves finish after their request)."""
    deadline = time.monotonic() + timeout_s
    now = _samples_counters(base_url)
    while now["requests_succeeded"] < num_succeeded and time.monotonic() < deadline:
        time.sleep(0.1)
        now = _samples_counters(base_url)
    while True:
        time.sleep(0.3)
        later = _samples_counters(base_url)
        written = ("hybridkv_save_bytes", "mooncake_put_bytes")
        if all(later.get(k) == now.get(k) for k in written) or time.monotonic() > deadline:
            return later
        now = later


def replay_trace(
    base_url: str,
    trace: ServeTrace,
    configuration: str,
    setup: ServeSetup,
    *,
    num_windows: int = NUM_WINDOWS,
    progress: Callable[[int], None] | None = None,
) -> ReplayOutcome:
    """Send ``trace``'s requests to the server at ``base_url`` in trace order (each once those it follows
    are answered, ``setup.concurrency`` at a time), reading the counters at the end of each window of
    requests; never raises on a failed request."""
    requests = trace.requests
    size = max(1, math.ceil(len(requests) / max(1, num_windows)))
    results: list[StreamResult | None] = [None] * len(requests)
    done = [threading.Event() for _ in requests]
    start_counters = _samples_counters(base_url)
    before = start_counters
    num_ok = 0
    windows: list[tuple[int, float, float]] = []

    def send(request: ReplayRequest) -> None:
        for index in request.after:
            done[index].wait()
        try:
            results[request.index] = stream_request(
                base_url, "/v1/completions", request_body(request, configuration, setup)
            )
        finally:
            done[request.index].set()
        if progress is not None:
            progress(1)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=setup.concurrency, thread_name_prefix="agentic-client") as pool:
        for first in range(0, len(requests), size):
            window = requests[first : first + size]
            for future in [pool.submit(send, r) for r in window]:
                future.result()
            num_ok += sum(1 for r in window if (result := results[r.index]) is not None and result.ok)
            after = _settled(base_url, start_counters["requests_succeeded"] + num_ok)
            windows.append(
                (
                    sum(len(r.prompt) for r in window),
                    after["external_hit_tokens"] - before["external_hit_tokens"],
                    after["local_hit_tokens"] - before["local_hit_tokens"],
                )
            )
            before = after
    seconds = time.perf_counter() - start
    totals = {k: before[k] - start_counters.get(k, 0.0) for k in before}
    final = [r if r is not None else StreamResult(ok=False, error="not sent") for r in results]
    return ReplayOutcome(final, totals, windows, seconds)


def _warm_up(base_url: str, setup: ServeSetup) -> None:
    """Two prompts shorter than a block (nothing to cache, locally or in a store): the first requests after
    start are several times slower. Returns once ``/metrics`` counts them."""
    length = max(1, min(setup.block_tokens - 1, 24))
    for index in range(2):
        body = {
            "model": "tiny",
            "prompt": [_FIRST_TOKEN_ID + (index * 7 + k) % 100 for k in range(length)],
            "max_tokens": setup.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "cache_salt": "salt:warm-up",
        }
        stream_request(base_url, "/v1/completions", body)
    _settled(base_url, 2)  # their counts are in before the replay's first reading


def _start_server(
    configuration: str,
    model: Path,
    rundir: Path,
    setup: ServeSetup,
    capacity_bytes: int,
    *,
    master: MooncakeMaster | None,
    store_dir: Path,
) -> OpenAIServer:
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(setup.reserved_cpus)}
    kv: dict[str, Any] | None = None
    if configuration in HYBRIDKV_CONFIGURATIONS:
        kv = hybridkv_transfer_config(f"file://{store_dir}?capacity={capacity_bytes}", namespace=_NAMESPACE)
    elif configuration == MOONCAKE_CONFIGURATION:
        assert master is not None, "mooncake-store needs its master"
        mooncake_config = rundir / "mooncake-store.json"
        mooncake_config.write_text(
            json.dumps(
                {
                    "mode": "embedded",
                    "metadata_server": "P2PHANDSHAKE",
                    "master_server_address": master.address,
                    "global_segment_size": capacity_bytes,
                    "local_buffer_size": setup.mooncake_local_buffer_mib << 20,
                    "protocol": "tcp",
                    "device_name": "",
                }
            )
        )
        env.update(MOONCAKE_CONFIG_PATH=str(mooncake_config), MC_TCP_BIND_ADDRESS="127.0.0.1")
        kv = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
    elif configuration != "none":
        raise ValueError(f"unknown configuration {configuration!r}; expected one of {CONFIGURATIONS}")
    return OpenAIServer(
        model,
        rundir / "server.log",
        kv_transfer_config=kv,
        max_model_len=setup.max_model_len,
        max_num_seqs=setup.concurrency,
        max_num_batched_tokens=setup.max_model_len,
        kv_cache_memory_bytes=int(setup.kv_cache_mib * (1 << 20)),
        extra_args=("--block-size", str(setup.block_tokens)),
        extra_env=env,
        start_timeout_s=_START_TIMEOUT_S,
    )


def _master_metrics(master: MooncakeMaster) -> dict[str, float]:
    """The master's own gauges and counters whose names speak of bytes or capacity (``{}`` if unreadable)."""
    try:
        text = str(http_json(f"http://127.0.0.1:{master.metrics_port}/metrics", timeout=5.0))
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if re.search(r"byte|capacity|size", key) and "_bucket" not in key:
            try:
                out[key] = float(value)
            except ValueError:
                continue
    return out


def _percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank ``q`` quantile (``None`` when empty)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def run_configuration(
    configuration: str,
    model: Path,
    trace: ServeTrace,
    setup: ServeSetup,
    capacity_bytes: int,
    rundir: Path,
    *,
    store_dir: Path | None = None,
    round_index: int = 0,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """One configuration on one trace: a fresh server (and store under ``store_dir``, default
    ``rundir/store``, removed afterwards; and master), the warm-up, the replay, the counters; the run's dict
    (``error`` set, with the server log's tail, when the server failed)."""
    rundir.mkdir(parents=True, exist_ok=True)
    store_dir = store_dir if store_dir is not None else rundir / "store"
    master: MooncakeMaster | None = None
    run: dict[str, Any] = {"configuration": configuration, "round": round_index, "seed": trace.seed}
    server: OpenAIServer | None = None
    try:
        if configuration == MOONCAKE_CONFIGURATION:
            master = MooncakeMaster(rundir / "mooncake-master.log", lease_ttl="200ms")
            master.start()
        started = time.perf_counter()
        server = _start_server(
            configuration, model, rundir, setup, capacity_bytes, master=master, store_dir=store_dir
        )
        server.wait_healthy()
        run["server_start_s"] = time.perf_counter() - started
        _warm_up(server.base_url, setup)
        outcome = replay_trace(server.base_url, trace, configuration, setup, progress=progress)
        if master is not None:
            run["mooncake_master"] = _master_metrics(master)
    except Exception as error:  # noqa: BLE001 -- one run's failure must not end the others
        log = rundir / "server.log"
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.exists() else ""
        run["error"] = ("".join(traceback.format_exception(error)[-3:]) + "\n" + tail)[-4000:]
        return run
    finally:
        if server is not None:
            run["exit_status"] = server.stop()
            run["local_cache_tokens"] = local_cache_tokens(server.log_text())
        if master is not None:
            master.stop()
        shutil.rmtree(store_dir, ignore_errors=True)
    ok = [r for r in outcome.results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    prompt_tokens = sum(len(r.prompt) for r in trace.requests)
    totals = outcome.totals
    if configuration in HYBRIDKV_CONFIGURATIONS:
        written: float | None = totals.get("hybridkv_save_bytes", 0.0)
        written_source = "vllm:hybridkv_save_bytes_total"
    elif configuration == MOONCAKE_CONFIGURATION:
        written = totals.get("mooncake_put_bytes", 0.0)
        written_source = 'vllm:mooncake_store_operation_bytes_total{operation="save_put"}'
    else:
        written, written_source = None, "no store"
    run.update(
        {
            "requests": len(outcome.results),
            "errors": len(outcome.results) - len(ok),
            "error_samples": sorted({str(r.error) for r in outcome.results if not r.ok})[:3],
            "prompt_tokens": prompt_tokens,
            "vllm_prompt_tokens": totals.get("prompt_tokens"),
            "external_hit_tokens": totals.get("external_hit_tokens", 0.0),
            "local_hit_tokens": totals.get("local_hit_tokens", 0.0),
            "store_share": totals.get("external_hit_tokens", 0.0) / max(1, prompt_tokens),
            "local_share": totals.get("local_hit_tokens", 0.0) / max(1, prompt_tokens),
            "ttft_p50_s": _percentile(ttfts, 0.5),
            "ttft_p99_s": _percentile(ttfts, 0.99),
            "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
            "store_bytes_written": written,
            "store_bytes_written_source": written_source,
            "capacity_bytes": capacity_bytes,
            "replay_s": outcome.seconds,
            "window_store_shares": [ext / max(1, p) for p, ext, _ in outcome.windows],
            "window_local_shares": [loc / max(1, p) for p, _, loc in outcome.windows],
            "window_sizes": [p for p, _, _ in outcome.windows],
            "hybridkv": {k: v for k, v in totals.items() if k.startswith("hybridkv_")},
        }
    )
    return run


# -- the bench ------------------------------------------------------------------------------------------------


def _spread(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": float(statistics.median(values)), "min": float(min(values)), "max": float(max(values))}


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(statistics.median(present)) if present else None


def _row(
    configuration: str, runs: Sequence[Mapping[str, Any]], base_runs: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """One configuration's table row: medians over its measured rounds, [min, max], the points against the
    baseline per round (rounds where both ran)."""
    measured = [r for r in runs if "error" not in r]
    share = _spread([r["store_share"] for r in measured])
    base_by_round = {r["round"]: r for r in base_runs if "error" not in r}
    points = _spread(
        [
            100.0 * (r["store_share"] - base_by_round[r["round"]]["store_share"])
            for r in measured
            if r["round"] in base_by_round
        ]
    )
    is_baseline = configuration == BASELINE
    written = [r["store_bytes_written"] for r in measured]
    hybridkv = [r["hybridkv"] for r in measured]
    return {
        "configuration": configuration,
        "rounds": len(measured),
        "failed_rounds": len(runs) - len(measured),
        "requests": _median([r["requests"] for r in measured]),
        "errors": sum(r["errors"] for r in measured),
        "prompt_tokens": _median([r["prompt_tokens"] for r in measured]),
        "external_hit_tokens": _median([r["external_hit_tokens"] for r in measured]),
        "store_share": None if share is None else share["median"],
        "store_share_min": None if share is None else share["min"],
        "store_share_max": None if share is None else share["max"],
        "store_share_spread": None if share is None else f"[{share['min']:.3f}, {share['max']:.3f}]",
        "points_vs_baseline": None if is_baseline or points is None else points["median"],
        "points_spread": None
        if is_baseline or points is None
        else f"[{points['min']:+.1f}, {points['max']:+.1f}]",
        "local_share": _median([r["local_share"] for r in measured]),
        "ttft_p50_ms": _scaled(_median([r["ttft_p50_s"] for r in measured]), 1000.0),
        "ttft_p99_ms": _scaled(_median([r["ttft_p99_s"] for r in measured]), 1000.0),
        "ttft_p99_ms_spread": _ms_spread([r["ttft_p99_s"] for r in measured]),
        "written_mib": None if not written or written[0] is None else _scaled(_median(written), 1 / _MIB),
        "written_source": measured[0]["store_bytes_written_source"] if measured else None,
        "session_retained_keys": _median([h.get("hybridkv_session_retained_keys") for h in hybridkv])
        if hybridkv
        else None,
        "session_hints_refused": sum(h.get("hybridkv_session_hints_refused", 0) for h in hybridkv)
        if hybridkv
        else None,
        "store_failures": sum(
            h.get("hybridkv_load_failed_keys", 0) + h.get("hybridkv_save_failed_keys", 0) for h in hybridkv
        )
        if hybridkv
        else None,
    }


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _ms_spread(values: Sequence[float | None]) -> str | None:
    present = [v * 1000 for v in values if v is not None]
    return f"[{min(present):.0f}, {max(present):.0f}]" if present else None


def _targets(
    rows: Sequence[Mapping[str, Any]], runs: Mapping[str, Sequence[Mapping[str, Any]]]
) -> list[dict[str, Any]]:
    """The issue's target (``file-lru+sessions`` >= 15 points over ``file-lru``), its share against
    ``mooncake-store``'s (>= 0 points, per round), and no failed request anywhere."""
    by_name = {row["configuration"]: row for row in rows}
    out: list[dict[str, Any]] = []
    sessions = by_name.get(SESSIONS_CONFIGURATION)
    if sessions is not None and BASELINE in by_name:
        out.append(
            target_row(
                f"{SESSIONS_CONFIGURATION}: prompt tokens served from the store vs {BASELINE}, points",
                sessions["points_vs_baseline"],
                ">=",
                TARGET_POINTS_OVER_LRU,
            )
        )
    if sessions is not None and MOONCAKE_CONFIGURATION in by_name:
        mine = {r["round"]: r["store_share"] for r in runs[SESSIONS_CONFIGURATION] if "error" not in r}
        theirs = [r for r in runs[MOONCAKE_CONFIGURATION] if "error" not in r and r["round"] in mine]
        points = _spread([100.0 * (mine[r["round"]] - r["store_share"]) for r in theirs])
        out.append(
            target_row(
                f"{SESSIONS_CONFIGURATION}: prompt tokens served from the store vs {MOONCAKE_CONFIGURATION}, points",
                None if points is None else points["median"],
                ">=",
                0,
            )
        )
    failed = sum(row["errors"] for row in rows)
    failed_runs = sum(row["failed_rounds"] for row in rows)
    out.append(target_row("failed requests, every configuration and round", failed + 0.0, "==", 0))
    out.append(target_row("failed runs (a server that did not start or died)", failed_runs + 0.0, "==", 0))
    return out


def run_agentic_serve_bench(
    model: Path,
    setup: ServeSetup,
    workdir: Path,
    *,
    configurations: Sequence[str] = CONFIGURATIONS,
    num_rounds: int = 3,
    seed: int = 0,
    scratch_dir: str | None = None,
    progress: Callable[[str], None] | None = None,
    on_request: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Round ``r`` builds the trace of ``seed + r`` and runs every configuration on it (order rotated by
    ``r``), each on a fresh server and store of capacity ``setup.capacity_fraction`` of that trace's working
    set (file stores under ``scratch_dir``, default ``/dev/shm`` when present; logs under ``workdir``).
    Returns the report (``rows``, ``targets``, ``shape``, ``windows``, every run under ``runs``).
    ``RuntimeError`` for Mooncake outside a loopback-only network namespace; ``ValueError`` when a round's
    capacity is below Mooncake's smallest global segment (16 MiB) and Mooncake is among the
    configurations."""
    unknown = [c for c in configurations if c not in CONFIGURATIONS]
    assert not unknown and configurations, f"configurations {unknown} not in {CONFIGURATIONS}"
    assert num_rounds >= 1, num_rounds
    if MOONCAKE_CONFIGURATION in configurations:
        if not loopback_only_namespace():
            raise RuntimeError(f"{MOONCAKE_CONFIGURATION}: {NETNS_HINT}")
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    ordered = [c for c in CONFIGURATIONS if c in configurations]
    vocab_size = model_vocab_size(model)
    block_bytes = attention_block_bytes(model, setup.block_tokens)
    traces = [build_serve_trace(setup, seed + r, vocab_size) for r in range(num_rounds)]
    capacities = [max(1, int(setup.capacity_fraction * t.working_set_blocks() * block_bytes)) for t in traces]
    if MOONCAKE_CONFIGURATION in ordered and min(capacities) < MIN_SEGMENT_BYTES:
        raise ValueError(
            f"store capacity {min(capacities) / _MIB:.1f} MiB ({setup.capacity_fraction:g} of the working set) "
            f"is below Mooncake's smallest global segment ({MIN_SEGMENT_BYTES >> 20} MiB): raise the capacity "
            "fraction or the trace (sessions, requests), or leave mooncake-store out"
        )
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in ordered}
    started = time.perf_counter()
    with bench_scratch_dir(scratch_dir) as scratch:
        for round_index, (trace, capacity) in enumerate(zip(traces, capacities, strict=True)):
            shift = round_index % len(ordered)
            for configuration in [*ordered[shift:], *ordered[:shift]]:
                name = configuration.replace("+", "-")
                run = run_configuration(
                    configuration,
                    model,
                    trace,
                    setup,
                    capacity,
                    workdir / f"round-{round_index}" / name,
                    store_dir=Path(scratch) / f"store-{round_index}-{name}",
                    round_index=round_index,
                    progress=on_request,
                )
                runs[configuration].append(run)
                if progress is not None:
                    progress(_progress_line(run, round_index, num_rounds))
    rows = [_row(c, runs[c], runs.get(BASELINE, [])) for c in ordered]
    first = traces[0]
    first_runs = {c: rs[0] for c, rs in runs.items() if rs and "error" not in rs[0]}
    ideal = first.ideal_hit_tokens()
    size = max(1, math.ceil(len(first.requests) / NUM_WINDOWS))
    prompts = [len(r.prompt) for r in first.requests]
    return {
        "benchmark": "agentic-serve",
        "model": str(model),
        "setup": asdict(setup),
        "workload": asdict(first.workload),
        "seed": seed,
        "num_rounds": num_rounds,
        "configurations": ordered,
        "baseline": BASELINE,
        "block_bytes": block_bytes,
        "working_set_bytes": [t.working_set_blocks() * block_bytes for t in traces],
        "capacity_bytes": capacities,
        "local_cache_bytes": int(setup.kv_cache_mib * (1 << 20)),
        "local_cache_tokens": next(
            (r["local_cache_tokens"] for rs in runs.values() for r in rs if r.get("local_cache_tokens")), None
        ),
        "shape": first.shape(),
        "shapes": [t.shape() for t in traces],
        "store_ceiling_share": _store_ceiling(traces, runs.get("none", [])),
        "rows": rows,
        "targets": _targets(rows, runs),
        "windows": {
            "num_requests": len(first.requests),
            "window_requests": size,
            **_ideal_windows(ideal, prompts, size, first_runs.get("none")),
            **{c: r["window_store_shares"] for c, r in first_runs.items()},
        },
        "runs": runs,
        "seconds": time.perf_counter() - started,
        "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
    }


def _ideal_windows(
    ideal: Sequence[int], prompts: Sequence[int], size: int, floor_run: Mapping[str, Any] | None
) -> dict[str, list[float]]:
    """Per window of ``size`` requests: ``ideal``, the unbounded store's share with no local cache, and
    (with the ``none`` run of the same trace) ``ceiling``, that less the share the local cache alone served:
    the most a store can add there."""
    shares = [
        sum(ideal[i : i + size]) / max(1, sum(prompts[i : i + size])) for i in range(0, len(prompts), size)
    ]
    if floor_run is None:
        return {"ideal": shares}
    local = floor_run["window_local_shares"]
    return {"ideal": shares, "ceiling": [max(0.0, a - b) for a, b in zip(shares, local, strict=True)]}


def _store_ceiling(traces: Sequence[ServeTrace], floor_runs: Sequence[Mapping[str, Any]]) -> float | None:
    """The most a store can add (median over rounds): what an unbounded store with no local cache serves,
    less what the local cache alone served (the ``none`` run of the same trace); ``None`` without it."""
    ceilings = [
        traces[run["round"]].shape()["ideal_share"] - run["local_share"]
        for run in floor_runs
        if "error" not in run
    ]
    return _median(ceilings)


def _progress_line(run: Mapping[str, Any], round_index: int, num_rounds: int) -> str:
    head = f"round {round_index + 1}/{num_rounds} {run['configuration']}"
    if "error" in run:
        causes = [line for line in run["error"].splitlines() if "Error" in line] or run["error"].splitlines()
        return f"{head}: FAILED: {causes[-1].strip()[-200:] if causes else '?'}"
    return (
        f"{head}: store share {run['store_share']:.3f}, local {run['local_share']:.3f}, "
        f"{run['errors']} errors, replay {run['replay_s']:.0f}s (start {run.get('server_start_s', 0):.0f}s)"
    )


#: Columns of the main table.
TABLE_COLUMNS = [
    "configuration",
    "rounds",
    "requests",
    "errors",
    "store_share",
    "store_share_spread",
    "points_vs_baseline",
    "points_spread",
    "local_share",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "ttft_p99_ms_spread",
    "written_mib",
    "session_retained_keys",
]


def describe_report(report: Mapping[str, Any]) -> str:
    """The trace's shape and the run's setup, the lines the command prints above its table."""
    s = report["shape"]
    setup = report["setup"]
    kinds = s["num_requests_by_kind"]
    working = statistics.median(report["working_set_bytes"]) / _MIB
    blocks = statistics.median(shape["working_set_blocks"] for shape in report["shapes"])
    capacity = statistics.median(report["capacity_bytes"]) / _MIB
    local = report["local_cache_bytes"] / _MIB
    last_seed = report["seed"] + report["num_rounds"] - 1
    trace = (
        f"trace (seed {s['seed']}; tokens scaled 1/{s['token_scale']}, blocks of {s['block_tokens']}): "
        f"{s['num_sessions']} sessions, {s['num_requests']} requests replayed ({kinds['turn']} turns, "
        f"{kinds['subagent']} sub-agent, {kinds['one_off']} one-off) of {s['num_trace_requests']} "
        f"({s['num_too_long']} longer than {setup['max_model_len'] - setup['max_tokens']} tokens left out, "
        f"{s['num_cut']} past --max-requests cut)"
    )
    prompts = (
        f"  prompt median {s['prompt_tokens_median']:g} tokens, max {s['prompt_tokens_max']}; "
        f"{s['span_s'] / 60:.0f} min of trace replayed back to back at concurrency {setup['concurrency']}; "
        f"tenants {', '.join(s['tenants'])} (cache_salt); an unbounded store with no local cache would "
        f"serve {s['ideal_share']:.1%} of the prompt tokens"
    )
    ceiling = report.get("store_ceiling_share")
    if ceiling is not None:
        prompts += (
            f"; less the local cache's share without a connector (none), a store can serve at most "
            f"{ceiling:.1%} (median over rounds)"
        )
    sizes = (
        f"model {Path(report['model']).name}: {report['block_bytes'] >> 10} KiB per block; working set "
        f"{working:.1f} MiB ({blocks:g} blocks; medians over rounds), store capacity {setup['capacity_fraction']:g} "
        f"of it = {capacity:.2f} MiB for every configuration; local KV cache {local:.1f} MiB "
        f"({report['local_cache_tokens']} tokens)"
    )
    rounds = (
        f"{report['num_rounds']} interleaved rounds (seeds {report['seed']}..{last_seed}): medians, spread "
        f"[min, max]; points vs {report['baseline']} per round; store_share = external hit tokens / "
        "prompt tokens"
    )
    return f"{trace}\n{prompts}\n{sizes}\n{rounds}"


def plot_report(report: Mapping[str, Any], path: Path) -> Path | None:
    """The share of prompt tokens served from the store over the first round's trace (windows of requests),
    one line per configuration, the unbounded store's dotted and (with ``none``) the ceiling dashed; ``None``
    without matplotlib."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    windows = report["windows"]
    size = windows["window_requests"]
    figure, axes = plt.subplots(figsize=(7, 4))
    styles = {
        "ideal": ({"linestyle": ":", "color": "grey"}, "unbounded store, no local cache"),
        "ceiling": (
            {"linestyle": "--", "color": "black"},
            "ceiling: unbounded store less the local cache (none)",
        ),
    }
    for name, shares in windows.items():
        if name in ("num_requests", "window_requests"):
            continue
        positions = [(index + 0.5) * size for index in range(len(shares))]
        style, label = styles.get(name, ({"marker": "o", "markersize": 3}, name))
        axes.plot(positions, shares, label=label, **style)
    axes.set_xlabel(f"request (trace order, seed {report['seed']}, windows of {size})")
    axes.set_ylabel("prompt tokens served from the store")
    axes.set_ylim(0, 1)
    capacity = statistics.median(report["capacity_bytes"]) / _MIB
    axes.set_title(
        f"agentic trace on real engines, store {capacity:.1f} MiB "
        f"({report['setup']['capacity_fraction']:g} x working set)"
    )
    axes.legend(fontsize="small", loc="best")
    return save_figure(figure, path)
