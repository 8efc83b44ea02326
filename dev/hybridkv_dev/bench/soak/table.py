"""The soak's report, its table and its plot."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hybridkv_dev.bench.soak.load import PROCESS_SERIES, LoadOutcome, is_timeout, request_summary
from hybridkv_dev.bench.soak.plan import SoakPlan


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
        1 for *_, error in (serial or {}).get("failures", ()) if is_timeout(error)
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
