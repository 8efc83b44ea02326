"""``hybridkv audit``, ``hybridkv diagram`` and ``hybridkv bench lifecycle``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hybridkv.bench.report import format_table, pyplot_or_none, save_report
from hybridkv.cli.exit_codes import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE


def register(
    subparsers: argparse._SubParsersAction[Any], bench_subparsers: argparse._SubParsersAction[Any]
) -> None:
    audit = subparsers.add_parser(
        "audit",
        help="replay an audit log against the lifecycle table",
        description="Replay every request's records against the transition table. Exit 0: clean, "
        "1: violations (illegal transitions, unterminated lifecycles, loops, malformed lines), "
        "2: unreadable file.",
    )
    audit.add_argument("file", help="JSON-lines audit log (the connector's audit_log)")
    audit.add_argument("--json", action="store_true", help="print the report as JSON")
    audit.add_argument("--max-violations", type=int, default=50, help="violations to list in text mode")
    audit.set_defaults(func=_audit)

    diagram = subparsers.add_parser(
        "diagram",
        help="render the lifecycle table to docs/diagrams/",
        description="Write lifecycle.mmd (Mermaid) and lifecycle.dot, plus lifecycle.svg when `dot` exists.",
    )
    diagram.add_argument("--out", default="docs/diagrams", help="output folder (default: docs/diagrams)")
    diagram.add_argument(
        "--check", action="store_true", help="exit 1 if the files there are stale; write nothing"
    )
    diagram.set_defaults(func=_diagram)

    bench = bench_subparsers.add_parser(
        "lifecycle",
        help="microseconds per lifecycle transition and per request, with and without the audit sink",
    )
    bench.add_argument("--iterations", type=int, default=5000)
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--out", default="bench-results/lifecycle.json")
    bench.add_argument("--no-plot", action="store_true", help="do not write the PNG next to the JSON")
    bench.set_defaults(func=_bench)


def _audit(args: argparse.Namespace) -> int:
    from hybridkv.lifecycle.audit import audit_file

    try:
        report = audit_file(args.file)
    except OSError as error:
        print(f"hybridkv audit: cannot read {args.file}: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, sort_keys=True))
    else:
        print(
            f"{args.file}: {report.num_records} records, {report.num_lifecycles} lifecycles "
            f"({report.num_terminated} terminated), {report.num_truncations} truncations, "
            f"{report.num_retries} retries, {len(report.violations)} violations"
        )
        if report.group_counts:
            rows = [{"group": g, **counts} for g, counts in sorted(report.group_counts.items())]
            print(format_table(rows, ["group", "hit", "miss", "verified", "truncated"]))
        for violation in report.violations[: args.max_violations]:
            where = f"line {violation.line}" if violation.line is not None else "-"
            print(f"{violation.kind:14} {where:>10}  {violation.request_id or '-'}: {violation.message}")
        if len(report.violations) > args.max_violations:
            print(f"... {len(report.violations) - args.max_violations} more (use --json)")
    return EXIT_OK if report.ok else EXIT_PROBLEM


def _diagram(args: argparse.Namespace) -> int:
    from hybridkv.lifecycle.diagram import render_dot, render_mermaid, write_diagrams

    out = Path(args.out)
    if args.check:
        stale = [
            name
            for name, text in (("lifecycle.mmd", render_mermaid()), ("lifecycle.dot", render_dot()))
            if not (out / name).is_file() or (out / name).read_text(encoding="utf-8") != text
        ]
        for name in stale:
            print(f"stale: {out / name} (run `hybridkv diagram`)", file=sys.stderr)
        return EXIT_PROBLEM if stale else EXIT_OK
    for path in write_diagrams(out):
        print(path)
    return EXIT_OK


def _bench(args: argparse.Namespace) -> int:
    from hybridkv.bench.lifecycle import run_lifecycle_bench

    report = run_lifecycle_bench(iterations=args.iterations, repeats=args.repeats)
    print(
        format_table(
            report["rows"],
            ["sink", "us_per_transition", "target_us_per_transition", "meets_target", "us_per_lifecycle"],
        )
    )
    save_report(report, args.out, _plot, no_plot=args.no_plot, prefix="")
    return EXIT_OK


def _plot(report: dict[str, Any], path: Path) -> Path | None:
    """Bars of µs per transition per sink, with each sink's target as a tick; ``None`` without matplotlib."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    rows = report["rows"]
    positions = list(range(len(rows)))
    figure, axes = plt.subplots(figsize=(5, 3.5))
    axes.bar(positions, [row["us_per_transition"] for row in rows], width=0.6, label="measured")
    for position, row in zip(positions, rows, strict=True):
        if row["target_us_per_transition"] is not None:
            target = row["target_us_per_transition"]
            axes.hlines(target, position - 0.35, position + 0.35, colors="red", linestyles="--")
    axes.set_xticks(positions, [f"sink: {row['sink']}" for row in rows])
    axes.set_ylabel("µs per transition (red: target)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
