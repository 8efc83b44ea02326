"""One configuration's figures: the load's summary, agreement with the reference, the checks after the
load."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv_dev.bench.record import RequestRecord
from hybridkv_dev.bench.serve.load import VLLM_PHASES, LoadResult
from hybridkv_dev.devkit.openai_server import (
    OpenAIServer,
    metric,
    metrics_samples,
)

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
            for phase in VLLM_PHASES
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


def divergence_columns(d: Divergence) -> dict[str, Any]:
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
