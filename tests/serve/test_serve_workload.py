"""``hybridkv bench serve``'s workload and command line, without a server."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from hybridkv.cli import EXIT_OK, EXIT_USAGE, main
from hybridkv_dev.bench.serve import (
    ConfigRun,
    RequestRecord,
    ServerShape,
    Workload,
    build_report,
    conversation_messages,
    divergence,
    format_runs_table,
    rotated,
    summarize_runs,
)


def test_each_turn_resends_the_conversation_so_far() -> None:
    workload = Workload(num_sessions=3, num_turns=3, num_system_prompts=2)
    answers = ["first answer", "second answer"]
    turns = [conversation_messages(workload, 2, answers[:n]) for n in range(3)]
    for earlier, later in itertools.pairwise(turns):
        # The previous request, its answer, then one new user turn.
        assert later[: len(earlier)] == earlier
        assert later[len(earlier)]["role"] == "assistant" and later[-1]["role"] == "user"
    assert [m["content"] for m in turns[2] if m["role"] == "assistant"] == answers
    # Sessions 0 and 2 share a system prompt; session 1 has the other one; user turns are per session.
    assert conversation_messages(workload, 0, [])[0] == turns[0][0]
    assert conversation_messages(workload, 1, [])[0] != turns[0][0]
    assert conversation_messages(workload, 0, [])[1] != turns[0][1]


def test_bad_workload_is_refused_naming_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "--configs", "none,vllm-magic"]) == EXIT_USAGE
    assert "vllm-magic" in capsys.readouterr().err
    assert main(["bench", "serve", "--concurrency", "0"]) == EXIT_USAGE
    assert "concurrency" in capsys.readouterr().err
    assert main(["bench", "serve", "--serial-sessions", "-1"]) == EXIT_USAGE
    assert "--serial-sessions" in capsys.readouterr().err
    assert main(["bench", "serve", "--reserved-cpus", "-2"]) == EXIT_USAGE
    assert "--reserved-cpus" in capsys.readouterr().err
    for flag in ("--max-model-len", "--max-num-batched-tokens", "--runs"):
        assert main(["bench", "serve", flag, "0"]) == EXIT_USAGE
        assert flag in capsys.readouterr().err


def _record(session: int, turn: int, tokens: list[int], gaps: list[float]) -> RequestRecord:
    return RequestRecord(
        phase="turn",
        session=session,
        turn=turn,
        ok=True,
        error=None,
        ttft_s=0.1,
        latency_s=0.2,
        prompt_tokens=100,
        completion_tokens=len(tokens),
        token_ids=tokens,
        text=" ".join(map(str, tokens)),
        top2_gaps=gaps,
    )


def test_divergence_compares_only_identical_conversations_and_reports_the_reference_gap() -> None:
    reference = [
        _record(0, 0, [5, 6, 7], [0.5, 0.0, 0.2]),
        _record(0, 1, [8, 9], [0.3, 0.3]),
        _record(1, 0, [1, 2], [0.4, 0.4]),
        _record(1, 1, [3, 4], [0.4, 0.4]),
    ]
    other = [
        _record(0, 0, [5, 9, 7], [0.5, 0.0, 0.2]),  # differs at token 1, a tie in the reference
        _record(0, 1, [8, 9], [0.3, 0.3]),  # its conversation already differs: not compared
        _record(1, 0, [1, 2], [0.4, 0.4]),
        _record(1, 1, [3, 5], [0.4, 0.4]),  # differs at token 1, where the reference was clear
    ]
    d = divergence(other, reference)
    assert (d.num_compared, d.num_equal, d.num_diverged_conversations) == (3, 1, 1)
    assert d.differing == (("turn", 0, 0, 1, 0.0), ("turn", 1, 1, 1, 0.4))
    assert d.agreement == 1 / 3
    assert d.max_reference_gap == 0.4
    assert divergence(reference, reference).agreement == 1.0
    assert divergence(reference, reference).differing == ()


def test_configurations_run_in_the_order_given_and_rotate_between_runs() -> None:
    configs = ["none", "hybridkv-file", "hybridkv-mooncake", "mooncake-store"]
    assert [rotated(configs, run)[0] for run in range(5)] == [*configs, "none"]
    assert sorted(rotated(configs, 3)) == sorted(configs)
    # The report keeps the order they ran in; its rows are in the usual order whatever it was.
    runs = {c: ConfigRun(c, {"ttft_mean_s": 1.0}, {}, [], [], None) for c in rotated(configs, 2)}
    report = build_report(runs, Workload(), ServerShape(), Path("unused"))
    assert report["run_order"] == rotated(configs, 2)
    assert [row["config"] for row in report["rows"]] == configs


def _report(ttft: dict[str, float], rps: dict[str, float], external: float) -> dict[str, Any]:
    rows = [
        {
            "config": config,
            "errors": 0,
            "ttft_mean_s": ttft[config],
            "ttft_p50_s": ttft[config],
            "ttft_p99_s": 2 * ttft[config],
            "requests_per_s": rps[config],
            "external_hit_tokens": 0.0 if config == "none" else external,
            **({"serial_agreement": 1.0} if config.startswith("hybridkv") else {}),
        }
        for config in ttft
    ]
    # Two sessions, two turns: the second turn's prefix came from the tier (load job seconds), or not.
    per_turn = {
        config: [
            {"turn": float(t), "queue_s_sum": 0.2, "prefill_s_sum": 2.0 / (t + 1), "prefill_s_count": 2.0}
            | ({"hybridkv_load_job_seconds": 0.1 * t} if config.startswith("hybridkv") else {})
            for t in range(2)
        ]
        for config in ttft
    }
    ttfts = {config: [ttft[config]] * 2 + [ttft[config] / 2] * 2 for config in ttft}
    return {
        "rows": rows,
        "run_order": list(ttft),
        "local_cache_tokens": 100,
        "working_set_tokens": 400,
        "workload": {"num_sessions": 2},
        "per_turn": per_turn,
        "ttfts": ttfts,
    }


def test_summary_of_runs_takes_ratios_per_run_then_medians(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = [
        _report(
            {"none": 2.0, "hybridkv-file": 1.0, "mooncake-store": 2.0},
            {"none": 1, "hybridkv-file": 2, "mooncake-store": 1},
            10,
        ),
        _report(
            {"none": 4.0, "hybridkv-file": 1.0, "mooncake-store": 1.0},
            {"none": 1, "hybridkv-file": 1, "mooncake-store": 2},
            30,
        ),
        _report(
            {"none": 1.0, "hybridkv-file": 0.7, "mooncake-store": 1.0},
            {"none": 1, "hybridkv-file": 3, "mooncake-store": 1},
            20,
        ),
    ]
    summary = summarize_runs(runs)
    rows = {row["config"]: row for row in summary["rows"]}
    assert rows["hybridkv-file"]["external_hit_tokens"] == {"median": 20.0, "min": 10.0, "max": 30.0, "n": 3}
    assert (
        rows["hybridkv-file"]["serial_agreement_min"] == 1.0 and rows["none"]["serial_agreement_min"] is None
    )
    ratios = summary["ratios"]["hybridkv-file"]
    # Per run: 1/2, 1/1, 0.7/1 (not the ratio of the medians, 1.0/1.0).
    assert ratios["ttft_mean_vs_mooncake-store"] == {"median": 0.7, "min": 0.5, "max": 1.0, "n": 3}
    assert ratios["throughput_vs_mooncake-store"]["median"] == 2.0
    assert ratios["ttft_p99_vs_none"]["median"] == 0.5
    targets = {row["target"]: row for row in summary["targets"]}
    assert targets["hybridkv-file ttft_mean_vs_mooncake-store, median of 3 runs"]["met"] is True
    assert targets["hybridkv-file ttft_mean_vs_none, median of 3 runs"]["met"] is True
    assert targets["failed requests and configurations, every run"]["met"] is True
    # hybridkv-mooncake did not run: no target judges it.
    assert not any("hybridkv-mooncake" in name for name in targets)
    # Per turn: the client's TTFT of the turn's requests, vLLM's queue and prefill and hybridkv's load job
    # per request.
    second = summary["per_turn"]["hybridkv-file"][1]
    assert second["turn"] == 2 and second["ttft_mean_s"]["median"] == 0.5
    assert second["engine_prefill_s"]["median"] == 0.5 and second["load_job_s"]["median"] == 0.05
    assert summary["per_turn"]["none"][1]["load_job_s"]["median"] == 0.0
    text = format_runs_table(summary)
    assert "0.700 [0.500, 1.000]" in text and "20 [10, 30]" in text and "targets:" in text

    paths = []
    for index, report in enumerate(runs):
        paths.append(tmp_path / f"run{index}.json")
        paths[-1].write_text(json.dumps(report))
    out = tmp_path / "summary.json"
    assert main(["bench", "serve", "--summarize", *map(str, paths), "--out", str(out)]) == EXIT_OK
    assert "0.700 [0.500, 1.000]" in capsys.readouterr().out
    assert json.loads(out.read_text())["ratios"] == json.loads(json.dumps(summary["ratios"]))
    assert main(["bench", "serve", "--summarize", str(tmp_path / "missing.json")]) == EXIT_USAGE


def test_step_events_join_the_audit_and_the_client_into_each_hits_way(tmp_path: Path) -> None:
    """``--trace``'s join, without a server: the scheduler's step events as the server's log prints them
    (structlog's console renderer), the audit log and the client's record of one hit."""
    import structlog
    from hybridkv.connector.metadata import HybridStoreMetadata, LoadJob
    from hybridkv.connector.scheduler.step_trace import StepTrace
    from hybridkv_dev.bench.serve.trace import STAGES, format_traces, hit_trace

    class _Output:  # the fields of vLLM's SchedulerOutput the trace reads
        def __init__(self, tokens: int, new: list[str]) -> None:
            self.total_num_scheduled_tokens = tokens
            self.scheduled_new_reqs = [type("New", (), {"req_id": rid})() for rid in new]

    rid = "chatcmpl-abc-0123"
    trace = StepTrace()
    render = structlog.dev.ConsoleRenderer(colors=False)
    config = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with structlog.testing.capture_logs() as logs:
            trace.answered(rid, None)  # step 0: asked, "ask again"
            trace.emit(_Output(2048, []), HybridStoreMetadata(scheme=None))  # type: ignore[arg-type]
            trace.answered(rid, 256)  # step 1: answered, its load sent
            trace.emit(_Output(2048, []), HybridStoreMetadata(scheme=None, loads=[LoadJob(rid, 256, ())]))  # type: ignore[arg-type]
            trace.output([rid])  # step 1's output: every rank reported the load
            trace.emit(_Output(64, [rid]), HybridStoreMetadata(scheme=None))  # type: ignore[arg-type]  # step 2
    finally:
        structlog.configure(**config)
    assert [entry["step"] for entry in logs] == [0, 1, 2] and logs[0]["log_level"] == "debug"
    server_log = "\n".join(
        "2026-12-06 15:20:17 " + render(None, "debug", {"level": "debug", **entry}) for entry in logs
    )
    start = logs[0]["monotonic"] - 0.05
    audit = tmp_path / "audit.jsonl"
    audit.write_text(
        "\n".join(
            json.dumps({"request_id": rid, "trigger": trigger, "monotonic": when})
            for trigger, when in (
                ("start_lookup", start + 0.001),
                ("lookup_hit", logs[1]["monotonic"]),
                ("start_load", logs[1]["monotonic"]),
                ("load_verified", logs[2]["output_monotonic"]),
            )
        )
    )
    record = _record(0, 1, [1], [])
    record.response_id, record.start_monotonic, record.ttft_s = "chatcmpl-abc", start, 1.0
    traced = hit_trace(server_log, audit, [record])
    assert traced["num_step_events"] == 3
    (hit,) = traced["hits"]
    assert hit["step"] == {"first_ask": 0, "answered": 1, "load_start": 1, "load_done": 2, "scheduled": 2}
    assert hit["asked_again"] == 1 and hit["boundaries"] == {"answered": 1, "load_done": 1, "scheduled": 0}
    assert [hit["ms"][stage] for stage in STAGES] == sorted(hit["ms"][stage] for stage in STAGES)
    assert [step["tokens"] for step in hit["stage_steps"]["load_done"]] == [2048]
    # A record that is not a resent turn, or whose id the audit does not know, is not traced.
    assert hit_trace(server_log, audit, [_record(0, 0, [1], [])])["hits"] == []
    assert "1 hits traced over 3 steps" in format_traces({"hybridkv-file": traced})
