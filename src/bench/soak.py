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
request with ``hybridkv.bench.serve.divergence``.

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

import http.client
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hybridkv.bench.serve import Workload
from hybridkv.devkit.openai_server import (
    OpenAIServer,
    StreamResult,
    http_json,
    hybridkv_transfer_config,
    metric,
    metrics_samples,
    openai_client,
    stream_request,
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

#: Faults of the chaos view: failed, corrupted and late (answered TIMEOUT, finished 200 ms later) gets and
#: puts, failed existence checks.
DEFAULT_CHAOS = (
    "get_fail=0.1&put_fail=0.1&exists_fail=0.05&corrupt=0.05&get_late=0.05&put_late=0.05&late_ms=200&seed=3"
)

#: sample key -> ``/metrics`` series (docs/metrics.md): what the connector holds now.
CONNECTOR_GAUGES: dict[str, str] = {
    "tracked_requests": "vllm:hybridkv_tracked_requests",
    "pinned_blocks": "vllm:hybridkv_pinned_blocks",
    "save_inflight_bytes": "vllm:hybridkv_save_inflight_bytes",
    "staging_bytes_out": "vllm:hybridkv_staging_bytes_out",
    "late_calls_pending": "vllm:hybridkv_late_calls_pending",
    "audit_queued_records": "vllm:hybridkv_audit_queued_records",
}
#: The gauges a settled engine holds at zero (``settle`` waits for them).
HELD_GAUGES = (
    "tracked_requests",
    "pinned_blocks",
    "save_inflight_bytes",
    "staging_bytes_out",
    "late_calls_pending",
)


#: The soak's conversations: 4 open sessions of 3 turns, 2 clients, short prompts, no eviction prompts.
SOAK_WORKLOAD = Workload(
    num_sessions=4,
    num_turns=3,
    concurrency=2,
    system_prompt_words=60,
    user_turn_words=50,
    max_tokens=8,
    num_evict_prompts=0,
    num_top_logprobs=0,
)


@dataclass(frozen=True)
class SoakPlan:
    """What the soak sends, to which server. Prompt sizes are in words (about 3.3 tokens each)."""

    num_requests: int = 1000
    sample_every: int = 25
    #: the conversations (``hybridkv.bench.serve.Workload``): ``num_sessions`` open at once (a finished one's
    #: slot goes to a new conversation) of ``num_turns`` turns, ``concurrency`` clients, prompt sizes
    workload: Workload = field(default_factory=lambda: SOAK_WORKLOAD)
    #: every this-many-th request is aborted after its first streamed chunk (0: none)
    abort_every: int = 9
    #: after every this-many-th request, ``POST /reset_prefix_cache``; every other one with the connector's
    #: reset (0: none)
    reset_every: int = 40
    #: sessions of the serial exactness pass (0: skip it)
    serial_sessions: int = 2
    warmup_fraction: float = 0.25
    #: the server's local KV cache: about 12 blocks of 128 tokens of the tiny GDN hybrid, a third of what the
    #: open sessions resend
    kv_cache_bytes: int = 6 << 20
    max_model_len: int = 1024
    #: the file store's capacity: about 10 entries of the tiny GDN hybrid, below what the sessions save
    store_capacity_bytes: int = 6 << 20
    chaos: str = DEFAULT_CHAOS
    #: CPU cores vLLM's CPU backend leaves to other processes (``VLLM_CPU_NUM_OF_RESERVED_CPU``)
    reserved_cpus: int = 1
    #: a request still unanswered after this long fails (a stranded request must not hang the soak); the
    #: tiny models answer in well under a second
    request_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("num_requests", "sample_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"SoakPlan.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_sessions", "num_turns", "concurrency", "max_tokens"):
            if getattr(self.workload, name) < 1:
                raise ValueError(f"SoakPlan.workload.{name} must be >= 1, got {getattr(self.workload, name)}")
        for name in ("abort_every", "reset_every", "serial_sessions", "reserved_cpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"SoakPlan.{name} must be >= 0, got {getattr(self, name)}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"SoakPlan.request_timeout_s must be > 0, got {self.request_timeout_s}")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"SoakPlan.warmup_fraction must be in [0, 1), got {self.warmup_fraction}")


# --- samples ------------------------------------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live descendant of it (from each process's parent in ``/proc/*/stat``)."""
    pid_to_parent: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
        pid_to_parent[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
    tree = [pid]
    for parent in tree:  # grows while it is walked: breadth first
        tree.extend(child for child, of in sorted(pid_to_parent.items()) if of == parent)
    return tree


def _process_sample(pid: int) -> dict[str, Any] | None:
    """One process's name, resident bytes, threads and open descriptors; None when it ended meanwhile."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        num_threads = len(os.listdir(f"/proc/{pid}/task"))
        num_fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss_kib = int(fields.get("VmRSS", "0 kB").split()[0])
    return {
        "pid": pid,
        "name": fields.get("Name", "?").strip(),
        "rss_bytes": rss_kib << 10,
        "num_threads": num_threads,
        "num_fds": num_fds,
    }


def process_tree_sample(pid: int) -> dict[str, Any]:
    """The process tree of ``pid`` (``process_tree``): per process and summed over it, resident bytes,
    threads and open file descriptors, and the number of processes."""
    processes = [p for p in (_process_sample(p) for p in process_tree(pid)) if p is not None]
    return {
        "rss_mib": sum(p["rss_bytes"] for p in processes) / (1 << 20),
        "num_threads": sum(p["num_threads"] for p in processes),
        "num_fds": sum(p["num_fds"] for p in processes),
        "num_processes": len(processes),
        "processes": processes,
    }


def _files_under(directory: Path) -> list[int]:
    """Sizes of the regular files anywhere under ``directory`` (none when it does not exist)."""
    sizes: list[int] = []
    for root, _dirs, names in os.walk(directory):
        for name in names:
            try:
                sizes.append(os.stat(os.path.join(root, name)).st_size)
            except OSError:  # evicted or published meanwhile
                continue
    return sizes


def store_files_sample(store_dir: Path) -> dict[str, Any]:
    """The file store's files (``hybridkv.store.file.layout``): published frames under ``objects/`` (count,
    bytes, the median size), temp files under ``tmp/``, recycled spares under ``spare/`` (count, bytes);
    ``store_bytes`` is objects and spares together (what ``capacity`` bounds)."""
    objects = _files_under(store_dir / "objects")
    spares = _files_under(store_dir / "spare")
    return {
        "num_store_files": len(objects),
        "object_bytes": sum(objects),
        "median_object_bytes": sorted(objects)[len(objects) // 2] if objects else None,
        "num_tmp_files": len(_files_under(store_dir / "tmp")),
        "num_spare_files": len(spares),
        "spare_bytes": sum(spares),
        "store_bytes": sum(objects) + sum(spares),
    }


def connector_sample(base_url: str) -> dict[str, float]:
    """The connector's gauges (``CONNECTOR_GAUGES``) and vLLM's requests running plus waiting, from
    ``/metrics``. Gauges refresh at engine steps (``settle`` makes one)."""
    samples = metrics_samples(base_url)
    out = {key: metric(samples, name) for key, name in CONNECTOR_GAUGES.items()}
    out["vllm_requests_in_engine"] = metric(samples, "vllm:num_requests_running") + metric(
        samples, "vllm:num_requests_waiting"
    )
    return out


def take_sample(
    num_requests: int, server_pid: int, base_url: str, store_dir: Path | None, *, started: float
) -> dict[str, Any]:
    """One sample of every series after ``num_requests`` requests: the server's process tree, the
    connector's gauges, the store's files (``store_dir`` None: none), seconds since ``started``
    (``time.monotonic``)."""
    sample: dict[str, Any] = {"requests": num_requests, "wall_s": time.monotonic() - started}
    sample.update(process_tree_sample(server_pid))
    sample.update(connector_sample(base_url))
    if store_dir is not None:
        sample.update(store_files_sample(store_dir))
    return sample


def tick(base_url: str) -> bool:
    """One greedy one-token completion of a prompt shorter than a block (nothing to save or load): the engine
    steps, and the stats of that step refresh every gauge. False when it failed."""
    try:
        openai_client(base_url, 120.0).completions.create(
            model="tiny", prompt="ping", max_tokens=1, temperature=0
        )
    except Exception:  # noqa: BLE001 -- a failed tick is reported by the caller, never raised
        return False
    return True


def settle(base_url: str, *, max_ticks: int = 8, pause_s: float = 0.3) -> dict[str, Any]:
    """Let the engine come to rest and refresh its gauges: wait ``pause_s`` (late store calls finish within
    ``late_ms``), ``tick``, read the gauges; again while a gauge of ``HELD_GAUGES`` is above 0, at most
    ``max_ticks`` times. Returns the number of ticks, of failed ticks and the last gauges read."""
    num_ticks = num_failed = 0
    gauges: dict[str, float] = {}
    while num_ticks < max_ticks:
        time.sleep(pause_s)
        num_ticks += 1
        num_failed += not tick(base_url)
        gauges = connector_sample(base_url)
        if all(gauges[key] == 0 for key in HELD_GAUGES) and gauges["vllm_requests_in_engine"] == 0:
            break
    return {"num_ticks": num_ticks, "num_failed_ticks": num_failed, "gauges": gauges}


# --- verdict ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SeriesBound:
    """What one series may do after the warm-up cut; ``None``: not bounded that way.

    ``max_slope_per_100``: least-squares slope per 100 requests (needs at least 3 samples after the cut);
    ``max_rise``: their max minus the warm-up samples' max; ``max_value``: every sample after the cut (and
    the last one, taken after the load) at most this. ``why``: the reason for the numbers.
    """

    series: str
    unit: str
    why: str
    max_slope_per_100: float | None = None
    max_rise: float | None = None
    max_value: float | None = None


#: What the connector may add to the server's resident memory per 100 requests after warm-up, over what vLLM
#: alone does under the same load: one leaked store entry per request (~450 KiB on the tiny GDN hybrid, both
#: groups) would add 44 MiB.
RSS_SLOPE_OVER_BASELINE = 16.0
#: Without a baseline: vLLM's own drift (measured, no connector: its CPU worker's RSS grows ~390 MiB over
#: the first 300 requests of this load and 10-15 MiB per 100 requests at 400-600) plus the margin above.
RSS_SLOPE_ALONE = 32.0


def series_bounds(
    store_capacity_bytes: int,
    *,
    median_object_bytes: int | None,
    baseline_rss: Mapping[str, Any] | None = None,
) -> list[SeriesBound]:
    """The bounds of every series (see each ``why``): the long run's. ``median_object_bytes``: the median
    frame the store held (bounds its file count through its capacity). ``baseline_rss``: the ``rss_mib``
    row of the same load on a no-connector server (``analyze_series``): the memory bound is then relative
    to vLLM's own drift."""
    capacity_mib = store_capacity_bytes / (1 << 20)
    max_files = 2 * store_capacity_bytes // median_object_bytes if median_object_bytes else None
    if baseline_rss is not None and baseline_rss.get("slope_per_100") is not None:
        rss = SeriesBound(
            "rss_mib",
            "MiB",
            "resident memory of the server's processes: vLLM's own drift under the same load without the "
            f"connector ({baseline_rss['slope_per_100']:+.1f} MiB per 100 requests, the baseline run) plus "
            f"{RSS_SLOPE_OVER_BASELINE:g} (one leaked store entry per request adds 44)",
            max_slope_per_100=max(0.0, baseline_rss["slope_per_100"]) + RSS_SLOPE_OVER_BASELINE,
            max_rise=max(0.0, baseline_rss["rise"] or 0.0) + 128.0,
        )
    else:
        rss = SeriesBound(
            "rss_mib",
            "MiB",
            "resident memory of the server's processes: vLLM's own drift (measured without the connector: "
            f"10-15 MiB per 100 requests after 400) plus {RSS_SLOPE_OVER_BASELINE:g}",
            max_slope_per_100=RSS_SLOPE_ALONE,
        )
    return [
        rss,
        SeriesBound(
            "num_threads",
            "threads",
            "thread pools are fixed; a late call holds a thread only for late_ms; one leaked thread per "
            "late call (5 % of the store calls) would add several per 100 requests",
            max_slope_per_100=1.0,
            max_rise=8,
        ),
        SeriesBound(
            "num_fds",
            "fds",
            "store files are opened per call and closed; client connections are pooled (one per client "
            "thread); a descriptor leaked per request or per store call adds dozens per 100 requests",
            max_slope_per_100=1.0,
            max_rise=16,
        ),
        SeriesBound("num_processes", "processes", "no process is started after warm-up", max_rise=0),
        SeriesBound(
            "vllm_requests_in_engine",
            "requests",
            "settled, vLLM runs and queues nothing: a request left there is stranded",
            max_value=0,
        ),
        SeriesBound(
            "tracked_requests",
            "requests",
            "settled, the connector follows no request: one left is stranded",
            max_value=0,
        ),
        SeriesBound(
            "pinned_blocks", "blocks", "settled, every save job finished and unpinned its blocks", max_value=0
        ),
        SeriesBound(
            "save_inflight_bytes",
            "bytes",
            "settled, every admitted save job ended and gave its bytes back",
            max_value=0,
        ),
        SeriesBound(
            "staging_bytes_out",
            "bytes",
            "settled, every private host buffer was released (a late call's once it returned)",
            max_value=0,
        ),
        SeriesBound(
            "late_calls_pending",
            "calls",
            "late calls finish late_ms after they answered; settle waits for them",
            max_value=0,
        ),
        SeriesBound(
            "audit_queued_records",
            "records",
            "the audit writer keeps up: a settled engine leaves at most the last step's records queued, far "
            "below the 65,536 at which records are dropped",
            max_value=1024,
        ),
        SeriesBound(
            "store_bytes",
            "bytes",
            f"the file store's contract: objects and spares within capacity ({capacity_mib:g} MiB) once no "
            "put is in flight",
            max_value=store_capacity_bytes,
        ),
        SeriesBound(
            "num_store_files",
            "files",
            "twice as many frames as the capacity holds of the median one (frames differ in size: a "
            "Mamba state, a block of attention KV, the manifest)",
            max_value=max_files,
        ),
        SeriesBound(
            "spare_bytes",
            "bytes",
            "recycled files are kept within 10 % of capacity (the eviction hysteresis band)",
            max_value=store_capacity_bytes // 10,
        ),
        SeriesBound(
            "num_tmp_files", "files", "a temp file outlives its put only if its writer crashed", max_value=0
        ),
    ]


def least_squares_slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """The slope of the least-squares line through ``(xs, ys)``; None with fewer than 3 points or one x."""
    if len(xs) < 3:
        return None
    mean_x = sum(xs) / len(xs)
    mean_y = sum(ys) / len(ys)
    spread_x = sum((x - mean_x) ** 2 for x in xs)
    if spread_x == 0:
        return None
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread_x


def analyze_series(
    samples: Sequence[Mapping[str, Any]], bounds: Sequence[SeriesBound], warmup_fraction: float
) -> list[dict[str, Any]]:
    """Per bounded series present in ``samples``: the warm-up cut (the first ``warmup_fraction`` of the
    samples, at least one, and at least one left after it), first and last value, the slope per 100 requests
    after the cut, the spread (max - min) and rise (max after minus max during warm-up), each bound and
    ``met`` (every bound given met; a slope bound with too few samples for a slope is not judged)."""
    rows: list[dict[str, Any]] = []
    num_warmup = min(max(1, int(len(samples) * warmup_fraction)), max(0, len(samples) - 1))
    for bound in bounds:
        points = [
            (float(s["requests"]), float(s[bound.series])) for s in samples if s.get(bound.series) is not None
        ]
        if not points:
            continue
        warm, after = points[:num_warmup], points[num_warmup:]
        values = [y for _, y in after] or [y for _, y in warm]
        slope = least_squares_slope([x for x, _ in after], [y for _, y in after])
        slope_100 = None if slope is None else slope * 100.0
        rise = (max(y for _, y in after) - max(y for _, y in warm)) if warm and after else None
        checks: list[bool] = []
        if bound.max_slope_per_100 is not None and slope_100 is not None:
            checks.append(slope_100 <= bound.max_slope_per_100)
        if bound.max_rise is not None and rise is not None:
            checks.append(rise <= bound.max_rise)
        if bound.max_value is not None:
            checks.append(max(values) <= bound.max_value)
        rows.append(
            {
                "series": bound.series,
                "unit": bound.unit,
                "num_warmup": len(warm),
                "num_after": len(after),
                "first": points[0][1],
                "last": points[-1][1],
                "min_after": min(values),
                "max_after": max(values),
                "spread_after": max(values) - min(values),
                "rise": rise,
                "slope_per_100": slope_100,
                "max_slope_per_100": bound.max_slope_per_100,
                "max_rise": bound.max_rise,
                "max_value": bound.max_value,
                "met": all(checks),
                "why": bound.why,
            }
        )
    return rows


# --- the load -----------------------------------------------------------------------------------------------


@dataclass
class SoakRequest:
    """One request of the load: its place in the schedule, whether it was aborted on purpose, its outcome."""

    index: int
    session: int
    turn: int
    aborted: bool
    ok: bool
    error: str | None
    completion_tokens: int
    latency_s: float
    #: the answer's text (the next turn resends it)
    text: str = ""
    #: the reset sent after it: "local", "external" or None; and vLLM's answer (False: blocks were in use)
    reset: str | None = None
    reset_success: bool | None = None
    reset_error: str | None = None


def aborted_request(base_url: str, body: Mapping[str, Any], *, timeout: float = 600.0) -> StreamResult:
    """Send ``body`` streamed to ``/v1/chat/completions`` and close the stream after its first chunk with
    content: the server sees the client go and aborts the request. ``ok`` when that chunk came."""
    import openai

    result = StreamResult(ok=False)
    start = time.perf_counter()
    try:
        stream = openai_client(base_url, timeout).chat.completions.create(stream=True, **body)
        with stream:  # closing it drops the connection mid-response
            for chunk in stream:
                if any(choice.delta.content for choice in chunk.choices or ()):
                    result.ok = True
                    result.ttft_s = time.perf_counter() - start
                    break
        if not result.ok:
            result.error = "stream ended before its first content chunk"
    except openai.OpenAIError as error:
        result.error = f"{type(error).__name__}: {error}"[:300]
    finally:
        result.latency_s = time.perf_counter() - start
    return result


def _chat_body(plan: SoakPlan, workload: Any, session: int, answers: Sequence[str]) -> dict[str, Any]:
    from hybridkv.bench.serve import conversation_messages

    return {
        "model": "tiny",
        "messages": conversation_messages(workload, session, answers),
        "max_tokens": plan.workload.max_tokens,
        "temperature": 0,
    }


def send_soak_request(
    plan: SoakPlan, workload: Any, base_url: str, index: int, session: int, answers: Sequence[str]
) -> SoakRequest:
    """Request ``index`` of the load: ``session``'s next turn after ``answers``, aborted after its first
    chunk when its index says so, followed by a reset when its index says so (``SoakPlan``)."""
    body = _chat_body(plan, workload, session, answers)
    aborted = plan.abort_every > 0 and index % plan.abort_every == plan.abort_every - 1
    if aborted:
        result = aborted_request(base_url, body, timeout=plan.request_timeout_s)
    else:
        result = stream_request(
            base_url, "/v1/chat/completions", {**body, "ignore_eos": True}, timeout=plan.request_timeout_s
        )
    record = SoakRequest(
        index=index,
        session=session,
        turn=len(answers),
        aborted=aborted,
        ok=result.ok,
        error=result.error,
        completion_tokens=result.completion_tokens,
        latency_s=result.latency_s,
        text=result.text,
    )
    if plan.reset_every > 0 and (index + 1) % plan.reset_every == 0:
        # While the other client threads' requests run: vLLM may refuse (blocks in use), which is fine.
        external = (index + 1) // plan.reset_every % 2 == 0
        url = f"{base_url}/reset_prefix_cache" + ("?reset_external=true" if external else "")
        record.reset = "external" if external else "local"
        try:
            answer = http_json(url, {}, method="POST")
        except (OSError, http.client.HTTPException) as error:  # the server died (the load notices)
            record.reset_error = f"{type(error).__name__}: {error}"[:300]
            answer = None
        record.reset_success = isinstance(answer, dict) and answer.get("success") is True
    return record


@dataclass
class LoadOutcome:
    requests: list[SoakRequest] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    settles: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    #: why the load ended before its last request (the server died, ``/metrics`` stopped answering)
    error: str | None = None


def run_soak_load(
    plan: SoakPlan,
    server: OpenAIServer,
    store_dir: Path | None,
    *,
    progress: Callable[[int], None] | None = None,
) -> LoadOutcome:
    """Send ``plan.num_requests`` requests in rounds (every open session's next turn; a finished session's
    slot starts a new one), aborts and resets mixed in (see the module docstring); settle and sample before
    the first request, at the end of every round that reaches the next multiple of ``sample_every``, and after
    the last. Never raises on a failed request; ends early (``error`` says why) when the server exits or
    stops answering ``/metrics``."""
    workload = plan.workload
    base_url = server.base_url
    outcome = LoadOutcome()
    started = time.monotonic()
    slot_to_session = list(range(plan.workload.num_sessions))
    session_to_answers: dict[int, list[str]] = {s: [] for s in slot_to_session}
    next_session = plan.workload.num_sessions
    num_sent = 0
    next_sample_at = plan.sample_every
    lock = threading.Lock()

    def sample() -> None:
        outcome.settles.append({"requests": num_sent, **settle(base_url)})
        outcome.samples.append(take_sample(num_sent, server.proc.pid, base_url, store_dir, started=started))

    def one(index: int, session: int) -> SoakRequest:
        record = send_soak_request(plan, workload, base_url, index, session, session_to_answers[session])
        if progress is not None:
            with lock:
                progress(1)
        return record

    try:
        sample()
    except (OSError, http.client.HTTPException) as error:
        outcome.error = f"the first sample failed: {type(error).__name__}: {error}"[:500]
        return outcome
    with ThreadPoolExecutor(max_workers=plan.workload.concurrency, thread_name_prefix="soak-client") as pool:
        while num_sent < plan.num_requests:
            sessions = slot_to_session[: plan.num_requests - num_sent]
            indexes = range(num_sent, num_sent + len(sessions))
            records = list(pool.map(one, indexes, sessions))
            num_sent += len(records)
            outcome.requests.extend(records)
            for slot, record in enumerate(records):
                answers = session_to_answers[record.session]
                # An aborted or failed turn still continues the conversation, with a stand-in answer.
                answers.append("(no answer)" if record.aborted or not record.ok else record.text)
                if (
                    len(answers) == plan.workload.num_turns
                ):  # the conversation is over: a new one takes the slot
                    del session_to_answers[record.session]
                    slot_to_session[slot] = next_session
                    session_to_answers[next_session] = []
                    next_session += 1
            if server.proc.poll() is not None:
                outcome.error = f"the server exited with {server.proc.returncode} after {num_sent} requests"
                break
            if num_sent >= next_sample_at or num_sent >= plan.num_requests:
                try:
                    sample()
                except (OSError, http.client.HTTPException) as error:
                    outcome.error = f"sampling after {num_sent} requests: {type(error).__name__}: {error}"[
                        :500
                    ]
                    break
                while next_sample_at <= num_sent:
                    next_sample_at += plan.sample_every
    outcome.wall_s = time.monotonic() - started
    return outcome


# --- the whole soak -----------------------------------------------------------------------------------------


def soak_store_url(plan: SoakPlan, store_dir: Path) -> str:
    """The chaos view of the file store in ``store_dir`` (``plan.chaos``, capacity ``plan.store_capacity_bytes``)."""
    from hybridkv.store.params import format_size

    return f"faulty+file://{store_dir}?capacity={format_size(plan.store_capacity_bytes)}&{plan.chaos}"


def start_server(
    plan: SoakPlan, model: Path, workdir: Path, *, connector: bool = True
) -> tuple[OpenAIServer, Path, Path]:
    """The soak's server (not yet healthy) with its store folder and audit log; ``connector=False``: the
    baseline's, without a KV connector (its log ``server-baseline.log``; no store, no audit log)."""
    store_dir = workdir / "store"
    audit = workdir / "audit.jsonl"
    kv = (
        hybridkv_transfer_config(soak_store_url(plan, store_dir), namespace="soak", audit_log=str(audit))
        if connector
        else None
    )
    server = OpenAIServer(
        model,
        workdir / ("server.log" if connector else "server-baseline.log"),
        kv_transfer_config=kv,
        max_model_len=plan.max_model_len,
        max_num_seqs=plan.workload.concurrency,
        max_num_batched_tokens=plan.max_model_len,
        kv_cache_memory_bytes=plan.kv_cache_bytes,
        extra_env={"VLLM_CPU_NUM_OF_RESERVED_CPU": str(plan.reserved_cpus)},
    )
    return server, store_dir, audit


#: The series a no-connector baseline has (the server's processes).
PROCESS_SERIES = ("rss_mib", "num_threads", "num_fds", "num_processes")


def run_baseline(
    plan: SoakPlan, model: Path, workdir: Path, *, progress: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """The same load on a server without a KV connector: its process series (``PROCESS_SERIES``) and their
    analysis, what vLLM alone does (its allocators' drift). ``error``: why its load ended early."""
    server, _, _ = start_server(plan, model, workdir, connector=False)
    try:
        server.wait_healthy()
        load = run_soak_load(plan, server, None, progress=progress)
    finally:
        server.stop()
    bounds = [
        b
        for b in series_bounds(plan.store_capacity_bytes, median_object_bytes=None)
        if b.series in PROCESS_SERIES
    ]
    samples = [
        {key: s[key] for key in ("requests", "wall_s", "processes", *PROCESS_SERIES)} for s in load.samples
    ]
    return {
        "samples": samples,
        "series": analyze_series(samples, bounds, plan.warmup_fraction),
        "failed": sum(1 for r in load.requests if not r.ok),
        "error": load.error,
    }


def _reset_all(server: OpenAIServer) -> bool:
    """Local and connector reset (the next pass starts cold); False when vLLM or the connector refused."""
    try:
        server.reset_prefix_cache(attempts=30, reset_external=True)
    except RuntimeError:
        return False
    return True


def _serial_pass(server: OpenAIServer, plan: SoakPlan) -> tuple[list[Any], bool]:
    """The serial exactness pass (after a local and a connector reset): ``plan.serial_sessions`` sessions of
    ``plan.workload.num_turns`` turns, turn by turn (every session's first, then every second...), one request at a
    time, each within ``plan.request_timeout_s``. Returns its records (``hybridkv.bench.serve.RequestRecord``,
    for ``divergence``) and whether the reset succeeded."""
    from hybridkv.bench.serve import RequestRecord

    reset_ok = _reset_all(server)
    workload = plan.workload
    session_to_answers: dict[int, list[str]] = {s: [] for s in range(plan.serial_sessions)}
    records: list[Any] = []
    for turn in range(plan.workload.num_turns):
        for session, answers in session_to_answers.items():
            body = {**_chat_body(plan, workload, session, answers), "ignore_eos": True}
            result = stream_request(
                server.base_url, "/v1/chat/completions", body, timeout=plan.request_timeout_s
            )
            records.append(
                RequestRecord(
                    phase="turn",
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
                )
            )
            answers.append(result.text if result.ok else "(no answer)")
    return records, reset_ok


def _timed_out(error: str | None) -> bool:
    """Whether a request's error is its deadline (the ``openai`` SDK's ``APITimeoutError``)."""
    return error is not None and "Timeout" in error


def request_summary(requests: Sequence[SoakRequest]) -> dict[str, Any]:
    """Counts of the load's requests: sent, completed, aborted on purpose, failed (an aborted request fails
    only when its first chunk never came), resets sent and refused, and the first failures."""
    failed = [r for r in requests if not r.ok]
    resets = [r for r in requests if r.reset is not None]
    return {
        "sent": len(requests),
        "completed": sum(1 for r in requests if r.ok and not r.aborted),
        "aborted": sum(1 for r in requests if r.aborted),
        "failed": len(failed),
        "resets_local": sum(1 for r in resets if r.reset == "local"),
        "resets_external": sum(1 for r in resets if r.reset == "external"),
        "resets_refused": sum(1 for r in resets if not r.reset_success),
        "output_tokens": sum(r.completion_tokens for r in requests),
        # Unanswered within ``request_timeout_s``: stranded in the server until the client gave up.
        "timed_out": sum(1 for r in failed if _timed_out(r.error)),
        "first_failures": [(r.index, r.session, r.turn, r.error) for r in failed[:10]],
    }


def run_soak(
    plan: SoakPlan,
    model: Path,
    workdir: Path,
    *,
    baseline: bool = True,
    progress: Callable[[int], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """With ``baseline``, first the same load on a no-connector server (``run_baseline``: vLLM's own memory
    drift, which the memory bound is relative to). Then start the soak's server, run the serial pass, the
    sampled load and the serial pass again, stop the server, replay the audit log; return the report
    (JSON-ready; ``report["passed"]`` is the verdict)."""
    from hybridkv.bench.serve import audit_summary, counters, divergence, local_cache_tokens

    def phase(name: str) -> None:
        if on_phase is not None:
            on_phase(name)

    workdir.mkdir(parents=True, exist_ok=True)
    baseline_report: dict[str, Any] | None = None
    if baseline:
        phase("baseline (no connector)")
        baseline_report = run_baseline(plan, model, workdir, progress=progress)
    server, store_dir, audit = start_server(plan, model, workdir)
    after: dict[str, Any] = {}
    serial_before: list[Any] = []
    serial_after: list[Any] = []
    load = LoadOutcome()
    try:
        phase("server start")
        server.wait_healthy()
        start_counters = counters(metrics_samples(server.base_url))
        if plan.serial_sessions:
            phase("serial pass, before")
            serial_before, after["serial_reset_before_ok"] = _serial_pass(server, plan)
        after["load_reset_ok"] = _reset_all(server)
        phase("load")
        load = run_soak_load(plan, server, store_dir, progress=progress)
        if load.error is None:
            try:
                if plan.serial_sessions:
                    phase("serial pass, after")
                    serial_after, after["serial_reset_after_ok"] = _serial_pass(server, plan)
                after["final_gauges"] = settle(server.base_url)["gauges"]
                end_counters = counters(metrics_samples(server.base_url))
            except (OSError, http.client.HTTPException) as error:
                load.error = f"after the load: {type(error).__name__}: {error}"[:500]
            else:
                after["counters"] = {
                    key: value - start_counters.get(key, 0.0)
                    for key, value in end_counters.items()
                    if key.startswith(("hybridkv_", "external_")) or key == "preemptions"
                }
    finally:
        phase("server stop")
        rc = server.stop()
    after["exit_status"] = rc
    log = server.log_text()
    serving = log.partition("shutdown triggered")[0]
    after["server_errors"] = serving.count(" ERROR ")
    after["load_error"] = load.error
    if load.error is not None or after["server_errors"]:
        # The first error the server logged, with what follows it: why it died, or what went wrong.
        first = serving.find(" ERROR ")
        after["server_log_excerpt"] = (
            serving[serving.rfind("\n", 0, first) + 1 :][:6000] if first >= 0 else ""
        )
    audit_report = audit_summary(audit)
    serial = divergence(serial_after, serial_before) if serial_before else None
    object_sizes = sorted(s["median_object_bytes"] for s in load.samples if s.get("median_object_bytes"))
    median_object = object_sizes[len(object_sizes) // 2] if object_sizes else None
    baseline_rss = next(
        (row for row in (baseline_report or {}).get("series", ()) if row["series"] == "rss_mib"), None
    )
    bounds = series_bounds(
        plan.store_capacity_bytes, median_object_bytes=median_object, baseline_rss=baseline_rss
    )
    rows = analyze_series(load.samples, bounds, plan.warmup_fraction)
    return build_soak_report(
        plan=plan,
        model=model,
        store_url=soak_store_url(plan, store_dir),
        load=load,
        rows=rows,
        after=after,
        audit=audit_report,
        serial=None
        if serial is None
        else {
            "requests": len(serial_before),
            "compared": serial.num_compared,
            "equal": serial.num_equal,
            "differing": [list(d) for d in serial.differing],
            # A request that failed (in either pass) is not compared: it fails the pass on its own.
            "failures": [
                (which, r.session, r.turn, r.error)
                for which, records in (("before", serial_before), ("after", serial_after))
                for r in records
                if not r.ok
            ],
        },
        local_cache_tokens=local_cache_tokens(log),
        baseline=baseline_report,
    )


def build_soak_report(
    *,
    plan: SoakPlan,
    model: Path,
    store_url: str,
    load: LoadOutcome,
    rows: Sequence[Mapping[str, Any]],
    after: Mapping[str, Any],
    audit: Mapping[str, Any],
    serial: Mapping[str, Any] | None,
    local_cache_tokens: int | None,
    baseline: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The report: plan, samples, per-series verdicts, request counts, the checks after the load, and the
    pass criteria as a targets table (``hybridkv.bench.report.target_row``)."""
    from hybridkv.bench.report import target_row

    summary = request_summary(load.requests)
    final_gauges = after.get("final_gauges")
    # Settled after the load: vLLM's requests and the connector's, lifecycles the audit left open, and the
    # requests (of the load or a serial pass) the server never answered before their deadline.
    num_timed_out = summary["timed_out"] + sum(
        1 for *_, error in (serial or {}).get("failures", ()) if _timed_out(error)
    )
    num_stranded = (
        None
        if final_gauges is None or audit.get("audit_unterminated") is None
        else final_gauges["vllm_requests_in_engine"]
        + final_gauges["tracked_requests"]
        + audit["audit_unterminated"]
        + num_timed_out
    )
    num_out_of_bounds = sum(1 for row in rows if not row["met"])
    targets = [
        target_row("requests sent", summary["sent"], "==", plan.num_requests),
        target_row("failed requests", summary["failed"], "==", 0),
        target_row("stranded requests", num_stranded, "==", 0),
        target_row("series out of bounds", num_out_of_bounds, "==", 0),
        target_row(
            "audit violations",
            None if audit.get("audit_ok") is None else sum((audit.get("audit_violations") or {}).values()),
            "==",
            0,
        ),
        target_row("audit records dropped", audit.get("audit_dropped"), "==", 0),
    ]
    if serial is not None:
        targets.append(target_row("serial pass: failed requests", len(serial.get("failures", ())), "==", 0))
        targets.append(
            target_row("serial pass: differing requests", serial["requests"] - serial["equal"], "==", 0)
        )
    targets.append(target_row("server errors while serving", after.get("server_errors"), "==", 0))
    passed = all(t["met"] for t in targets) and after.get("exit_status") is not None
    return {
        "model": str(model),
        "plan": asdict(plan),
        "store": store_url,
        "local_cache_tokens": local_cache_tokens,
        "load_wall_s": load.wall_s,
        "requests": summary,
        "samples": load.samples,
        "settles": load.settles,
        "series": list(rows),
        "serial": serial,
        "after": dict(after),
        "audit": dict(audit),
        "targets": targets,
        "passed": passed,
        "baseline": None if baseline is None else dict(baseline),
    }


SERIES_COLUMNS = (
    "series",
    "first",
    "last",
    "min_after",
    "max_after",
    "rise",
    "slope_per_100",
    "max_slope_per_100",
    "max_rise",
    "max_value",
    "met",
)


def format_soak_table(report: Mapping[str, Any]) -> str:
    """The series table, the request counts, the serial pass, the audit and the pass criteria."""
    from hybridkv.bench.report import format_targets
    from hybridkv.tables import format_table

    plan = report["plan"]
    requests = report["requests"]
    counts = (
        f"{requests['sent']} requests in {report['load_wall_s']:.0f} s at concurrency {plan['workload']['concurrency']}: "
        f"{requests['completed']} completed, {requests['aborted']} aborted mid-stream, "
        f"{requests['failed']} failed; resets {requests['resets_local']} local + "
        f"{requests['resets_external']} with the connector ({requests['resets_refused']} refused: blocks in use)"
    )
    sampling = (
        f"{len(report['samples'])} samples (every {plan['sample_every']} requests, settled); warm-up: the first "
        f"{plan['warmup_fraction']:.0%} of them; slopes per 100 requests after it"
    )
    lines = [
        counts,
        f"store {report['store']}; local KV cache {report['local_cache_tokens']} tokens",
        sampling,
        "",
        format_table(report["series"], SERIES_COLUMNS),
        "",
    ]
    baseline = report.get("baseline")
    if baseline is not None:
        lines.append("baseline: the same load without the connector (vLLM alone):")
        lines.append(format_table(baseline["series"], SERIES_COLUMNS[:7]))
        if baseline.get("error"):
            lines.append(f"baseline load ended early: {baseline['error']}")
        lines.append("")
    serial = report.get("serial")
    if serial is not None:
        lines.append(
            f"serial pass: {serial['equal']}/{serial['requests']} requests token-identical before and after the "
            f"load (differing: {serial['differing']})"
        )
        for which, session, turn, error in serial.get("failures", ()):
            lines.append(f"  serial pass {which}: session {session} turn {turn} failed: {error}")
    audit = report["audit"]
    lines.append(
        f"audit: ok={audit.get('audit_ok')} lifecycles={audit.get('audit_lifecycles')} "
        f"unterminated={audit.get('audit_unterminated')} dropped={audit.get('audit_dropped')}"
    )
    counters = report["after"].get("counters") or {}
    shown = (
        "hybridkv_store_faults_injected",
        "external_hit_tokens",
        "hybridkv_truncations",
        "hybridkv_load_failed_keys",
        "hybridkv_save_failed_keys",
    )
    lines.append("during the run: " + ", ".join(f"{k}={counters.get(k, 0):g}" for k in shown))
    lines.append("")
    lines.append(format_targets(report["targets"]))
    if report["after"].get("load_error"):
        lines.append(f"\nthe load ended early: {report['after']['load_error']}")
    excerpt = report["after"].get("server_log_excerpt")
    if excerpt:
        lines.append("the server's first error:\n" + "\n".join(excerpt.splitlines()[:40]))
    lines.append(f"\nverdict: {'PASS' if report['passed'] else 'FAIL'}")
    return "\n".join(lines)


def plot_soak(report: Mapping[str, Any], path: Path) -> Path | None:
    """One panel per series: the samples against requests sent, the warm-up shaded, the least-squares line
    after it, a bound on the value dotted; the baseline's (no connector) next to the process series."""
    from hybridkv.bench.report import pyplot_or_none, save_figure

    plt = pyplot_or_none()
    if plt is None:
        return None
    rows = list(report["series"])
    samples = report["samples"]
    baseline = report.get("baseline")
    num_cols = 4
    num_rows = max(1, -(-len(rows) // num_cols))
    fig, axes = plt.subplots(num_rows, num_cols, figsize=(4 * num_cols, 2.6 * num_rows), squeeze=False)
    for ax in axes.flat[len(rows) :]:
        ax.set_visible(False)
    for ax, row in zip(axes.flat, rows, strict=False):
        points = [(s["requests"], s[row["series"]]) for s in samples if s.get(row["series"]) is not None]
        xs = [x for x, _ in points]
        ys = [y for _, y in points]
        color = "C0" if row["met"] else "C3"
        ax.plot(xs, ys, marker="o", markersize=3, color=color, label="hybridkv")
        if baseline and row["series"] in PROCESS_SERIES:
            ax.plot(
                [s["requests"] for s in baseline["samples"]],
                [s[row["series"]] for s in baseline["samples"]],
                marker=".",
                markersize=2,
                color="0.55",
                label="no connector",
            )
            ax.legend(fontsize=6)
        if row["num_warmup"] and len(xs) > row["num_warmup"]:
            ax.axvspan(xs[0], xs[row["num_warmup"]], color="0.9", label="warm-up")
            after = points[row["num_warmup"] :]
            if row["slope_per_100"] is not None:
                mean_x = sum(x for x, _ in after) / len(after)
                mean_y = sum(y for _, y in after) / len(after)
                slope = row["slope_per_100"] / 100.0
                ends = [after[0][0], after[-1][0]]
                ax.plot(ends, [mean_y + slope * (x - mean_x) for x in ends], "--", color="0.3", linewidth=1)
        if row["max_value"] is not None:
            ax.axhline(row["max_value"], color="C3", linestyle=":", linewidth=1)
        slope_text = "" if row["slope_per_100"] is None else f", {row['slope_per_100']:+.3g}/100 req"
        ax.set_title(f"{row['series']} ({row['unit']}){slope_text}", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("requests", fontsize=7)
    verdict = "PASS" if report["passed"] else "FAIL"
    fig.suptitle(f"hybridkv bench soak: {report['requests']['sent']} requests, {verdict}", fontsize=10)
    return save_figure(fig, path)
