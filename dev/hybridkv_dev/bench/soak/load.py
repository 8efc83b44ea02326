"""The soak's load: requests (some aborted mid-stream, some followed by a reset), sampled every K."""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridkv_dev.bench.soak.plan import SoakPlan
from hybridkv_dev.bench.soak.samples import settle, take_sample
from hybridkv_dev.devkit.openai_server import (
    OpenAIServer,
    StreamResult,
    http_json,
    openai_client,
    stream_request,
)

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


def chat_body(plan: SoakPlan, workload: Any, session: int, answers: Sequence[str]) -> dict[str, Any]:
    from hybridkv_dev.bench.serve import conversation_messages

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
    body = chat_body(plan, workload, session, answers)
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


#: The series a no-connector baseline has (the server's processes).
PROCESS_SERIES = ("rss_mib", "num_threads", "num_fds", "num_processes")


def is_timeout(error: str | None) -> bool:
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
        "timed_out": sum(1 for r in failed if is_timeout(r.error)),
        "first_failures": [(r.index, r.session, r.turn, r.error) for r in failed[:10]],
    }
