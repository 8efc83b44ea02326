"""``hybridkv bench datapath``: the connector's block data path (gather / scatter) vs a plain copy.

Registering imports nothing heavy; torch is imported only when the benchmark runs. The same flags serve
``python -m hybridkv.bench.datapath`` on a bare GPU host.
"""

from __future__ import annotations

import argparse
import sys

from hybridkv.bench.report import format_targets
from hybridkv.cli.exit_codes import ExitCode


def register(subparsers: argparse._SubParsersAction, bench_subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``datapath`` to ``bench_subparsers`` (no top-level command)."""
    bench = bench_subparsers.add_parser(
        "datapath",
        help="block gather/scatter GB/s (device<->pinned host on CUDA) vs one contiguous copy",
        description="Gather (device -> pinned host) and scatter (pinned host -> device) throughput of the "
        "connector's BlockMover for realistic KV geometries and batch sizes, next to one contiguous copy "
        "of the same bytes measured in the same run (CPU: np.copyto). Writes a JSON report.",
    )
    add_arguments(bench)
    bench.set_defaults(func=handle_bench)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags (``hybridkv bench datapath`` and ``python -m hybridkv.bench.datapath``)."""
    parser.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda if available; %(default)s)")
    parser.add_argument("--out", default="bench-results", help="report directory or .json path (%(default)s)")
    parser.add_argument("--batches", default="16,64,256", help="blocks per batch (%(default)s)")
    parser.add_argument("--geometries", default="attn,mamba", help="comma-separated, of attn, mamba")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="interleaved timed rounds per measurement; medians and spread reported",
    )
    parser.add_argument("--stage-mib", type=int, default=32, help="device staging buffer MiB (%(default)s)")
    parser.add_argument("--no-per-page", action="store_true", help="skip the naive per-page copy baseline")
    parser.add_argument(
        "--no-beside-compute",
        action="store_true",
        help="CUDA: skip timing a matmul loop with each path's transfers running beside it",
    )


def handle_bench(args: argparse.Namespace) -> int:
    try:
        from hybridkv.bench import datapath
    except ModuleNotFoundError as error:
        print(f"error: bench datapath needs {error.name}", flush=True)
        return ExitCode.USAGE
    try:
        batches = [int(x) for x in str(args.batches).split(",") if x.strip()]
    except ValueError as error:
        print(f"error: bad --batches: {error}", file=sys.stderr)
        return ExitCode.USAGE
    geometries = [x.strip() for x in str(args.geometries).split(",") if x.strip()]
    unknown = [g for g in geometries if g not in datapath.GEOMETRIES]
    if unknown or not batches or min(batches) < 1:
        print(f"error: bad --geometries {unknown} or --batches {batches}", file=sys.stderr)
        return ExitCode.USAGE
    try:
        report = datapath.run_bench(
            str(args.device),
            geometries=geometries,
            batches=batches,
            repeats=args.repeats,
            stage_bytes=args.stage_mib << 20,
            per_page=not args.no_per_page,
            beside_compute=not args.no_beside_compute,
        )
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return ExitCode.USAGE
    print(datapath.format_table(report["rows"]))
    if report["beside_compute"]:
        print(datapath.format_table(report["beside_compute"], datapath.BESIDE_COLUMNS))
    if report["targets"]:
        print("\n" + format_targets(report["targets"]))
    print(f"report: {datapath.write_report(report, args.out)}")
    return ExitCode.OK
