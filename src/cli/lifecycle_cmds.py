"""``hybridkv audit``, ``hybridkv diagram`` and ``hybridkv bench lifecycle``."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from hybridkv.cli.bench_options import add_report_arguments
from hybridkv.cli.exit_codes import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE
from hybridkv.tables import format_table

if TYPE_CHECKING:
    from hybridkv.audit.replay import AuditReport


def register(
    subparsers: argparse._SubParsersAction[Any], bench_subparsers: argparse._SubParsersAction[Any]
) -> None:
    audit = subparsers.add_parser(
        "audit",
        help="replay an audit log against the lifecycle table",
        description="Replay every request's records against the transition table, and the engine's (namespace "
        "gate, reset epochs, fingerprint) against the engine's table; every load must use the engine's latest "
        "epoch and fingerprint, with the gate open. A FILE is read together "
        "with its rotated siblings (FILE.N ... FILE.1, FILE-<date>, .gz included), oldest first, as one "
        "history. Exit 0: clean, 1: violations (illegal transitions, unterminated lifecycles, loops, stale loads), "
        "2: unreadable file or malformed lines (not UTF-8, not a JSON object, fields of the wrong type: "
        "stderr names the first). With --export vllm-trace the records are written as vLLM's "
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
        description="Write lifecycle.mmd (Mermaid) and lifecycle.dot, engine.mmd and engine.dot, plus an .svg of "
        "each .dot when `dot` exists.",
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


def _say(text: str, file: IO[str] | None = None) -> None:
    """``print`` that never fails on what a log holds: a lone surrogate (a JSON ``\\udcff`` escape in a
    request id) or a byte that is not UTF-8 in a file name is written backslash-escaped."""
    stream = sys.stdout if file is None else file
    encoding = getattr(stream, "encoding", None) or "utf-8"
    print(text.encode(encoding, "backslashreplace").decode(encoding), file=stream)


class _Lines:
    """The lines of ``paths`` as one stream (as ``audit_files`` reads them), remembering where each file
    ends so that a line number of the stream can be named as a file's line."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        #: each file read so far and the stream's number of its last line
        self.ends: list[tuple[Path, int]] = []

    def __iter__(self) -> Iterator[str]:
        from hybridkv.audit.replay import read_lines

        num_lines = 0
        for path in self.paths:
            for line in read_lines([path], errors="surrogateescape"):
                num_lines += 1
                yield line
            self.ends.append((path, num_lines))

    def where(self, line: int) -> str:
        """``FILE line N`` for line ``line`` of the stream (with the stream's number too for several files)."""
        start = 0
        for path, end in self.ends:
            if line <= end:
                return (
                    f"{path} line {line}"
                    if len(self.paths) == 1
                    else f"line {line} ({path} line {line - start})"
                )
            start = end
        return f"line {line}"


def _audit(args: argparse.Namespace) -> int:
    from hybridkv.audit.replay import ViolationKind, replay_records

    if args.max_violations < 0:
        print(f"hybridkv audit: --max-violations must be >= 0, got {args.max_violations}", file=sys.stderr)
        return EXIT_USAGE
    paths = _audit_paths(args)
    if args.export == "vllm-trace":
        return _export_trace(paths, args.out, log_prefix=args.log_prefix)
    lines = _Lines(paths)
    try:
        report = replay_records(lines)
    except OSError as error:
        _say(
            f"hybridkv audit: cannot read {error.filename or args.files}: {error.strerror or error}",
            sys.stderr,
        )
        return EXIT_USAGE
    if args.json:
        print(json.dumps({"files": [str(p) for p in paths], **report.to_dict()}, indent=2, sort_keys=True))
    else:
        _print_report(report, paths, args.max_violations)
    malformed = [v for v in report.violations if v.kind is ViolationKind.MALFORMED]
    if malformed:
        first = malformed[0]
        more = f" ({len(malformed)} malformed lines)" if len(malformed) > 1 else ""
        where = lines.where(first.line) if first.line is not None else "a line"
        _say(f"hybridkv audit: {where} is malformed: {first.message}{more}", sys.stderr)
        return EXIT_USAGE
    return EXIT_OK if report.ok else EXIT_PROBLEM


def _print_report(report: AuditReport, paths: list[Path], max_violations: int) -> None:
    _say(
        f"{', '.join(str(p) for p in paths)}: {report.num_records} records, "
        f"{report.num_lifecycles} lifecycles ({report.num_terminated} terminated), "
        f"{report.num_truncations} truncations, {report.num_retries} retries, "
        f"{len(report.violations)} violations"
    )
    if report.num_engine_records:
        print(
            f"engine: {report.num_engine_records} records, {report.num_resets} resets, "
            f"ends {report.engine_state}; every load checked against the engine's epoch and fingerprint"
        )
    if report.num_dropped:
        print(f"the audit sink dropped {report.num_dropped} records (its queue was full)")
    if report.group_counts:
        rows = [{"group": g, **counts} for g, counts in sorted(report.group_counts.items())]
        print(format_table(rows, ["group", "hit", "miss", "verified", "truncated"]))
    for violation in report.violations[:max_violations]:
        where = f"line {violation.line}" if violation.line is not None else "-"
        _say(f"{violation.kind:14} {where:>10}  {violation.request_id or '-'}: {violation.message}")
    if len(report.violations) > max_violations:
        print(f"... {len(report.violations) - max_violations} more (use --json)")


def _exportable(record: dict[str, Any]) -> bool:
    """Whether the trace can carry ``record``: its clock reading in nanoseconds is a finite number and its
    request id is text (no lone surrogate). Others are skipped, as the trace skips malformed records."""
    monotonic = record.get("monotonic")
    if isinstance(monotonic, (int, float)) and not isinstance(monotonic, bool):
        try:
            if not math.isfinite(monotonic * 1e9):
                return False
        except OverflowError:  # an int too large for a float
            return False
    request_id = record.get("request_id")
    if isinstance(request_id, str):
        try:
            request_id.encode("utf-8")
        except UnicodeEncodeError:
            return False
    return True


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
                except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
                    continue
                if isinstance(record, dict) and _exportable(record):
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
        _say(f"hybridkv audit: cannot read {error.filename}: {error.strerror or error}", sys.stderr)
        return EXIT_USAGE
    text = "".join(line + "\n" for line in lines)
    if out == "-":
        sys.stdout.write(text)
    else:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text, encoding="utf-8")
    return EXIT_OK


def _diagram(args: argparse.Namespace) -> int:
    from hybridkv.audit.diagram import DIAGRAMS, write_diagrams

    out = Path(args.out)
    if args.check:
        stale = [
            name
            for name, render in DIAGRAMS.items()
            if not (out / name).is_file() or (out / name).read_text(encoding="utf-8") != render()
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
