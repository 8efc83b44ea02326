"""One request a bench sent to an OpenAI server, as every serving bench records it (``bench serve``,
``bench soak``'s serial pass): what it was, how it went, what came back."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridkv_dev.devkit.openai_server import StreamResult


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
    #: ``time.monotonic()`` when it was sent (the clock of hybridkv's audit log and step trace); 0: unknown
    start_monotonic: float = 0.0


def request_record(phase: str, session: int, turn: int, result: StreamResult) -> RequestRecord:
    """The record of ``result``, a streamed request of ``phase`` (session ``session``'s turn ``turn``)."""
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
        start_monotonic=result.start_monotonic,
    )
