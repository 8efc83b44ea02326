"""``hybridkv bench soak``'s pure parts, without a server: the verdict per series (warm-up cut, slope, rise,
bounds), the samples of this process's tree and of a real file store's folder, the report's pass criteria
and table, and the command's flags."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hybridkv.cli import build_parser
from hybridkv.store import Status, open_store
from hybridkv_dev.bench.soak import (
    LoadOutcome,
    SeriesBound,
    SoakPlan,
    SoakRequest,
    analyze_series,
    build_soak_report,
    format_soak_table,
    least_squares_slope,
    process_tree,
    process_tree_sample,
    series_bounds,
    store_files_sample,
)
from hybridkv_dev.bench.soak.plan import sized_for_dtype


def _samples(series: str, values: list[float], every: int = 10) -> list[dict[str, Any]]:
    return [{"requests": i * every, series: v} for i, v in enumerate(values)]


def test_slope_is_the_least_squares_one_and_needs_three_points() -> None:
    assert least_squares_slope([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(2.0)
    assert least_squares_slope([0, 1], [0, 5]) is None
    assert least_squares_slope([4, 4, 4], [1, 2, 3]) is None


def test_growth_after_warm_up_fails_a_flat_series_passes() -> None:
    bound = SeriesBound("num_fds", "fds", "test", max_slope_per_100=1.0, max_rise=2)
    # Warm-up (first quarter: 2 of 8 samples) climbs, then flat: passes.
    flat = analyze_series(_samples("num_fds", [10, 40, 41, 41, 40, 41, 41, 41]), [bound], 0.25)
    assert flat[0]["num_warmup"] == 2 and flat[0]["met"], flat
    assert flat[0]["rise"] == 1 and flat[0]["slope_per_100"] == pytest.approx(0.0, abs=1.0)
    # One descriptor per 10 requests after warm-up: 10 per 100 requests.
    leak = analyze_series(_samples("num_fds", [10, 40, 41, 42, 43, 44, 45, 46]), [bound], 0.25)
    assert not leak[0]["met"] and leak[0]["slope_per_100"] == pytest.approx(10.0)


def test_value_bounds_judge_every_sample_after_warm_up_and_missing_series_are_skipped() -> None:
    bounds = [
        SeriesBound("num_tmp_files", "files", "test", max_value=0),
        SeriesBound("absent", "x", "not sampled", max_value=0),
    ]
    rows = analyze_series(_samples("num_tmp_files", [3, 0, 0, 1]), bounds, 0.25)
    assert [row["series"] for row in rows] == ["num_tmp_files"]
    assert not rows[0]["met"] and rows[0]["max_after"] == 1
    assert analyze_series(_samples("num_tmp_files", [3, 0, 0, 0]), bounds, 0.25)[0]["met"]


def test_memory_bound_is_relative_to_the_baseline_when_there_is_one() -> None:
    alone = {b.series: b for b in series_bounds(6 << 20, median_object_bytes=None)}
    relative = {
        b.series: b
        for b in series_bounds(
            6 << 20, median_object_bytes=1 << 20, baseline_rss={"slope_per_100": 9.0, "rise": 50.0}
        )
    }
    assert alone["rss_mib"].max_slope_per_100 == 32.0
    assert relative["rss_mib"].max_slope_per_100 == 9.0 + 16.0
    assert relative["num_store_files"].max_value == 12
    assert alone["store_bytes"].max_value == 6 << 20
    assert all(bound.why for bound in alone.values())


def test_process_tree_sample_counts_this_process_and_its_children() -> None:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in process_tree(os.getpid())
        sample = process_tree_sample(os.getpid())
        assert sample["num_processes"] >= 2
        assert sample["rss_mib"] > 1 and sample["num_threads"] >= 2 and sample["num_fds"] >= 3
        mine = next(p for p in sample["processes"] if p["pid"] == os.getpid())
        assert mine["num_fds"] > 0 and mine["rss_bytes"] > 0, mine
    finally:
        child.kill()
        child.wait()


def test_store_files_sample_counts_a_real_file_store(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/store?capacity=1MiB")
    try:
        assert store.put(["a", "b"], [b"x" * 100, b"y" * 200]) == [Status.OK, Status.OK]
        sample = store_files_sample(tmp_path / "store")
    finally:
        store.close()
    assert sample["num_store_files"] == 2 and sample["num_tmp_files"] == 0
    assert 300 < sample["object_bytes"] == sample["store_bytes"] <= 1 << 20
    assert sample["median_object_bytes"] is not None and sample["median_object_bytes"] > 100
    assert store_files_sample(tmp_path / "nowhere")["num_store_files"] == 0


def _report(**changes: Any) -> dict[str, Any]:
    plan = SoakPlan(num_requests=2, sample_every=1, serial_sessions=1)
    requests = [
        SoakRequest(0, 0, 0, aborted=False, ok=True, error=None, completion_tokens=8, latency_s=0.1),
        SoakRequest(1, 1, 0, aborted=True, ok=True, error=None, completion_tokens=1, latency_s=0.1),
    ]
    load = LoadOutcome(requests=requests, samples=_samples("num_tmp_files", [0, 0, 0], every=1))
    fields: dict[str, Any] = {
        "plan": plan,
        "model": Path("/models/tiny"),
        "store_url": "faulty+file:///s",
        "load": load,
        "rows": analyze_series(load.samples, [SeriesBound("num_tmp_files", "files", "t", max_value=0)], 0.25),
        "after": {
            "exit_status": 0,
            "server_errors": 0,
            "final_gauges": {"vllm_requests_in_engine": 0.0, "tracked_requests": 0.0},
        },
        "audit": {"audit_ok": True, "audit_violations": {}, "audit_dropped": 0, "audit_unterminated": 0},
        "serial": {"requests": 3, "compared": 3, "equal": 3, "differing": []},
        "local_cache_tokens": 1228,
    }
    fields.update(changes)
    return build_soak_report(**fields)


def test_report_passes_only_when_every_criterion_holds() -> None:
    report = _report()
    assert report["passed"], report["targets"]
    assert report["requests"]["aborted"] == 1 and report["requests"]["failed"] == 0
    text = format_soak_table(report)
    assert "verdict: PASS" in text and "num_tmp_files" in text

    unterminated = _report(
        audit={"audit_ok": True, "audit_violations": {}, "audit_dropped": 0, "audit_unterminated": 2}
    )
    assert not unterminated["passed"]
    assert {t["target"]: t["value"] for t in unterminated["targets"]}["stranded requests"] == 2
    differing = _report(
        serial={"requests": 3, "compared": 3, "equal": 2, "differing": [["turn", 0, 1, 3, None]]}
    )
    assert not differing["passed"]
    timed_out = _report(
        serial={
            "requests": 3,
            "compared": 2,
            "equal": 2,
            "differing": [],
            "failures": [("after", 1, 1, "APITimeoutError: Request timed out.")],
        }
    )
    met = {t["target"]: t["met"] for t in timed_out["targets"]}
    assert not met["serial pass: failed requests"] and not met["stranded requests"], timed_out["targets"]
    assert "serial pass after: session 1 turn 1 failed: APITimeoutError" in format_soak_table(timed_out)
    died = _report(after={"exit_status": 0, "server_errors": 4})  # no final gauges: the server died
    assert not died["passed"]
    assert {t["target"]: t["met"] for t in died["targets"]}["stranded requests"] is False


def test_the_command_parses_its_flags() -> None:
    args = build_parser().parse_args(
        ["bench", "soak", "--requests", "50", "--sample-every", "5", "--family", "llama", "--no-plot"]
    )
    assert (args.requests, args.sample_every, args.family, args.no_plot) == (50, 5, "llama", True)
    assert args.func.__name__ == "handle_soak"
    assert args.dtype == "bfloat16"
    assert build_parser().parse_args(["bench", "soak", "--dtype", "float32"]).dtype == "float32"
    with pytest.raises(ValueError, match="sample_every"):
        SoakPlan(sample_every=0)
    with pytest.raises(ValueError, match="dtype must be one of bfloat16, float32, got 'half'"):
        SoakPlan(dtype="half")
    assert sized_for_dtype(SoakPlan.kv_cache_bytes, "float32") == 2 * SoakPlan.kv_cache_bytes
    assert sized_for_dtype(SoakPlan.kv_cache_bytes, "bfloat16") == SoakPlan.kv_cache_bytes
