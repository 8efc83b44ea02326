"""``hybridkv audit``, ``hybridkv diagram`` and ``hybridkv bench lifecycle``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hybridkv.cli import add_report_arguments
from hybridkv.cli.exit_codes import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE
from hybridkv.tables import format_table


def register(
    subparsers: argparse._SubParsersAction[Any], bench_subparsers: argparse._SubParsersAction[Any]
) -> None:
    audit = subparsers.add_parser(
        "audit",
        help="replay an audit log against the lifecycle table",
        description="Replay every request's records against the transition table. A FILE is read together "
        "with its rotated siblings (FILE.N ... FILE.1, FILE-<date>, .gz included), oldest first, as one "
        "history. Exit 0: clean, 1: violations (illegal transitions, unterminated lifecycles, loops, "
        "malformed lines), 2: unreadable file. With --export vllm-trace the records are written as vLLM's "
        "KV-connector lifecycle trace (schema vllm-kv-connector-v1) instead.",
    )
    audit.add_argument(
        "files", nargs="+", metavar="FILE", help="JSON-lines audit log (the connector's audit_log)"
    )
    audit.add_argument("--json", action="store_true", help="print the report as JSON")
    audit.add_argument("--max-violations", type=int, default=50, help="violations to list in text mode")
    audit.add_argument(
        "--single", action="store_true", help="read only the FILEs named, not their rotated siblings"
    )
    audit.add_argument(
        "--export",
        choices=["vllm-trace"],
        help="write the records as vLLM's connector lifecycle trace (hashed request ids) instead of checking",
    )
    audit.add_argument("--out", default="-", help="--export destination (default: stdout)")
    audit.add_argument(
        "--log-prefix",
        action="store_true",
        help="--export: start each line with vLLM's `KV_CONNECTOR_LIFECYCLE ` log marker",
    )
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
    add_report_arguments(bench, "bench-results/lifecycle.json")
    bench.set_defaults(func=_bench)


def _audit_paths(args: argparse.Namespace) -> list[Path]:
    from hybridkv.audit.replay import rotated_set

    paths: list[Path] = []
    for name in args.files:
        expanded = [Path(name)] if args.single else rotated_set(name)
        paths.extend(expanded or [Path(name)])  # a missing FILE is reported by the reader
    return paths


def _audit(args: argparse.Namespace) -> int:
    from hybridkv.audit.replay import audit_files

    paths = _audit_paths(args)
    if args.export == "vllm-trace":
        return _export_trace(paths, args.out, log_prefix=args.log_prefix)
    try:
        report = audit_files(paths)
    except OSError as error:
        print(
            f"hybridkv audit: cannot read {error.filename or args.files}: {error.strerror}", file=sys.stderr
        )
        return EXIT_USAGE
    if args.json:
        print(json.dumps({"files": [str(p) for p in paths], **report.to_dict()}, indent=2, sort_keys=True))
    else:
        print(
            f"{', '.join(str(p) for p in paths)}: {report.num_records} records, "
            f"{report.num_lifecycles} lifecycles ({report.num_terminated} terminated), "
            f"{report.num_truncations} truncations, {report.num_retries} retries, "
            f"{len(report.violations)} violations"
        )
        if report.num_dropped:
            print(f"the audit sink dropped {report.num_dropped} records (its queue was full)")
        if report.group_counts:
            rows = [{"group": g, **counts} for g, counts in sorted(report.group_counts.items())]
            print(format_table(rows, ["group", "hit", "miss", "verified", "truncated"]))
        for violation in report.violations[: args.max_violations]:
            where = f"line {violation.line}" if violation.line is not None else "-"
            print(f"{violation.kind:14} {where:>10}  {violation.request_id or '-'}: {violation.message}")
        if len(report.violations) > args.max_violations:
            print(f"... {len(report.violations) - args.max_violations} more (use --json)")
    return EXIT_OK if report.ok else EXIT_PROBLEM


def _export_trace(paths: list[Path], out: str, *, log_prefix: bool) -> int:
    """Each file's records, its last record anchored at the file's modification time (trace.py)."""
    from hybridkv.audit.replay import read_lines
    from hybridkv.audit.trace import LOG_PREFIX, records_to_trace

    lines: list[str] = []
    try:
        for path in paths:
            records = []
            for raw in read_lines([path]):
                try:
                    record = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    records.append(record)
            monotonics = [r["monotonic"] for r in records if isinstance(r.get("monotonic"), (int, float))]
            anchor_monotonic_s = max(monotonics, default=0.0)
            anchor_wall_ns = path.stat().st_mtime_ns
            lines.extend(
                (LOG_PREFIX if log_prefix else "") + trace.to_json()
                for trace in records_to_trace(
                    records, anchor_monotonic_s=anchor_monotonic_s, anchor_wall_ns=anchor_wall_ns
                )
            )
    except OSError as error:
        print(f"hybridkv audit: cannot read {error.filename}: {error.strerror}", file=sys.stderr)
        return EXIT_USAGE
    text = "".join(line + "\n" for line in lines)
    if out == "-":
        sys.stdout.write(text)
    else:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text, encoding="utf-8")
    return EXIT_OK


def _diagram(args: argparse.Namespace) -> int:
    from hybridkv.audit.diagram import render_dot, render_mermaid, write_diagrams

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
    from hybridkv.bench.lifecycle import TABLE_COLUMNS, plot_report, run_lifecycle_bench
    from hybridkv.bench.report import save_report

    report = run_lifecycle_bench(iterations=args.iterations, repeats=args.repeats)
    print(format_table(report["rows"], TABLE_COLUMNS))
    save_report(report, args.out, plot_report, no_plot=args.no_plot, prefix="")
    return EXIT_OK
